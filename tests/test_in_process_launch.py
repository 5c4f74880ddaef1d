"""``paramfsm.verify.launch`` in the test process: a rank's worker loop and the pool's collection of answers.

A :class:`RankPool` normally forks its ranks; here the worker function runs
as one rank in a thread of the test process (world 1, gloo over 127.0.0.1),
talking to the pool over a pipe exactly as a forked rank would, so what the
pool sends and how it collects results, failures and timeouts is seen by
``make mutate``. ``tests/test_launch.py`` runs real forked pools.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import threading
import time
from functools import partial

import pytest
import torch
import torch.distributed as dist

from paramfsm.verify import launch
from paramfsm.verify.launch import RankFailure, RankPool


def _rank_info(rank, world, extra):
    return (rank, world, dist.get_world_size(), os.environ.get("PARAMFSM_LAUNCH_PROBE"), extra)


def _slow(rank, world):
    time.sleep(1.5)
    return rank


def _fails(rank, world):
    raise ValueError("bad value on this rank")


class _Thread(threading.Thread):
    """A worker thread that also answers the pool's kill()."""

    def kill(self):
        raise AssertionError("an idle worker is stopped politely, never killed")


@pytest.fixture
def one_thread_rank(monkeypatch):
    """Starts ``launch._worker`` as rank 0 of 1 in a thread: ``start(backend)`` gives (pool, worker, exits)."""
    exits = []
    monkeypatch.setattr(launch.os, "_exit", exits.append)  # the worker ends its process; here only its loop
    saved = dict(os.environ)
    pools, workers = [], []

    def start(backend="gloo"):
        parent, child = mp.Pipe()
        environ = dict(os.environ, PARAMFSM_LAUNCH_PROBE="seen")
        worker = _Thread(target=launch._worker, daemon=True,
                         args=(0, 1, launch.free_port(), child, list(sys.path), torch.get_num_threads(), backend,
                               "cpu", environ))
        pool = RankPool(1, timeout=10)
        worker.start()
        pool._procs, pool._conns = [worker], [parent]
        pools.append(pool)
        workers.append(worker)
        return pool, worker, exits

    try:
        yield start
    finally:
        for pool in pools:
            pool.close()
        for worker in workers:
            worker.join(timeout=10)
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture
def pool_of_one_thread(one_thread_rank):
    """A one-rank pool whose rank is ``launch._worker`` in a thread, started: (pool, exit codes, worker)."""
    pool, worker, exits = one_thread_rank()
    assert pool._collect("start-up") == [None]
    return pool, exits, worker


def test_a_pool_runs_functions_with_their_arguments_and_stops_its_worker(pool_of_one_thread):
    pool, exits, worker = pool_of_one_thread
    assert pool.run(_rank_info, "x") == [(0, 1, 1, "seen", "x")]
    assert pool.run(_rank_info, 7) == [(0, 1, 1, "seen", 7)]  # the same worker, again
    pool.close()
    worker.join(timeout=10)
    assert not worker.is_alive() and exits == [0] and not dist.is_initialized()
    assert pool._procs == [] and pool._conns == []


def test_a_failing_function_raises_rank_failure_with_the_remote_traceback(pool_of_one_thread):
    pool, exits, worker = pool_of_one_thread
    with pytest.raises(RankFailure) as info:
        pool.run(_fails)
    assert info.value.rank == 0 and "ValueError: bad value on this rank" in info.value.detail
    assert str(info.value).startswith("rank 0 failed:\nTraceback")
    worker.join(timeout=10)
    assert not worker.is_alive() and pool._conns == []  # the pool stopped its worker


@pytest.mark.parametrize("fn", [_slow, partial(_slow)], ids=["function", "partial"])
def test_a_run_past_its_timeout_fails_naming_the_function(pool_of_one_thread, fn):
    pool, exits, worker = pool_of_one_thread
    with pytest.raises(RankFailure) as info:
        pool.run(fn, timeout=1)
    name = getattr(fn, "__name__", None) or str(fn)
    assert info.value.detail == f"{name}: no answer within 1s (a rank may be blocked in a collective)"
    worker.join(timeout=10)
    assert not worker.is_alive() and pool._conns == []


def test_a_worker_that_does_not_stop_is_killed():
    class Stuck:
        def __init__(self):
            self.calls = []

        def join(self, timeout=None):
            self.calls.append(("join", timeout))

        def is_alive(self):
            return not self.calls or self.calls[-1] != ("kill", None)

        def kill(self):
            self.calls.append(("kill", None))

    pool, stuck = RankPool(1), Stuck()
    parent, child = mp.Pipe()
    pool._procs, pool._conns = [stuck], [parent]
    pool.close()
    (first, wait), rest = stuck.calls[0], stuck.calls[1:]
    assert first == "join" and wait is not None and rest == [("kill", None), ("join", None)], stuck.calls
    assert child.recv() is None  # it was asked to stop first


def test_a_rank_that_cannot_join_the_group_fails_the_start(one_thread_rank):
    pool, worker, exits = one_thread_rank("cpu:no-such-backend")
    with pytest.raises(RankFailure) as info:
        pool._collect("start-up")
    assert info.value.rank == 0 and "backend type NO-SUCH-BACKEND" in info.value.detail, info.value.detail
    worker.join(timeout=10)
    assert not worker.is_alive() and exits == [] and not dist.is_initialized()


def test_a_worker_whose_pool_went_away_leaves_the_group(pool_of_one_thread):
    pool, exits, worker = pool_of_one_thread
    pool._conns[0].close()  # no stop message: the worker sees the end of the pipe
    pool._procs, pool._conns = [], []
    worker.join(timeout=10)
    assert not worker.is_alive() and exits == [0] and not dist.is_initialized()


def test_a_rank_that_does_not_answer_in_time_fails_the_run():
    pool = RankPool(2, timeout=30)
    ends = [mp.Pipe() for _ in range(2)]
    pool._conns = [parent for parent, _ in ends]
    ends[1][1].send(("ok", "second"))
    with pytest.raises(RankFailure) as info:
        pool._collect("job", timeout=0.2)
    assert info.value.rank == 0 and info.value.detail == \
        "job: no answer within 0s (a rank may be blocked in a collective)"
    assert pool._conns == []


def test_answers_are_ordered_by_rank_and_a_dead_worker_is_named():
    pool = RankPool(3)
    ends = [mp.Pipe() for _ in range(3)]
    pool._conns = [parent for parent, _ in ends]
    for rank in (2, 0, 1):
        ends[rank][1].send(("ok", f"from {rank}"))
    assert pool._collect("job") == ["from 0", "from 1", "from 2"]
    ends[0][1].send(("ok", 0))
    ends[1][1].close()
    with pytest.raises(RankFailure) as info:
        pool._collect("job")
    assert info.value.rank == 1 and info.value.detail == "job: the worker process died"


def test_a_pool_chooses_its_backend_and_threads(monkeypatch):
    assert (RankPool().world, RankPool().timeout) == (2, 300.0)
    monkeypatch.setattr(launch.os, "cpu_count", lambda: 8)
    assert [RankPool(w).threads for w in (1, 2, 3, 16)] == [8, 4, 2, 1]
    assert all(type(RankPool(w).threads) is int for w in (1, 2, 3))
    monkeypatch.setattr(launch.os, "cpu_count", lambda: None)  # unknown: two cores assumed
    assert [RankPool(w).threads for w in (1, 2)] == [2, 1]
    monkeypatch.undo()
    assert RankPool(2).backend == "gloo" and RankPool(2, device="cuda").backend == "nccl"
    assert RankPool(2, device="cuda", backend="gloo").backend == "gloo"
    assert RankPool(4, threads=3).threads == 3
    assert RankPool(1).threads == max(1, (os.cpu_count() or 2))
    assert RankPool(10 ** 6).threads == 1
    pool = RankPool(3, timeout=5.0)
    assert (pool.world, pool.timeout, pool.device) == (3, 5.0, "cpu")
    with pool as same:
        assert same is pool
    assert pool._procs == []


def test_ranks_fork_from_a_server_that_imported_torch():
    ctx = launch._context()
    assert ctx.get_start_method() == "forkserver"
    from multiprocessing import forkserver
    assert forkserver._forkserver._preload_modules == ["torch", "torch.distributed"]


def test_a_free_port_can_be_bound():
    port = launch.free_port()
    assert 1024 <= port < 65536
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_rank_failure_carries_the_rank_and_the_detail():
    failure = RankFailure(3, "Traceback: boom")
    assert isinstance(failure, RuntimeError) and (failure.rank, failure.detail) == (3, "Traceback: boom")
    assert str(failure) == "rank 3 failed:\nTraceback: boom"
