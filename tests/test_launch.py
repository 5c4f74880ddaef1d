"""``paramfsm.verify.launch.RankPool``: ranks forked from a server see the caller's environment and folder as of
the pool's start, and a closed pool's workers are gone."""

from __future__ import annotations

import os

from paramfsm.verify.launch import RankPool


def where_job(rank, world):
    import torch.distributed as dist

    return os.environ.get("PARAMFSM_POOL_PROBE"), os.getcwd(), dist.get_world_size(), os.getpid()


def test_a_pool_sees_the_callers_environment_and_folder_at_its_start(tmp_path, monkeypatch):
    with RankPool(1) as first:  # the fork server is running from here on
        before = first.run(where_job)[0]
    monkeypatch.setenv("PARAMFSM_POOL_PROBE", "set after the server started")
    monkeypatch.chdir(tmp_path)
    with RankPool(2) as pool:
        seen = pool.run(where_job)
        procs = list(pool._procs)
    assert before[0] is None
    assert [s[:3] for s in seen] == [("set after the server started", str(tmp_path), 2)] * 2
    assert len({s[3] for s in seen} | {before[3]}) == 3, "each rank is its own process"
    assert all(not proc.is_alive() for proc in procs), "a closed pool left workers running"
