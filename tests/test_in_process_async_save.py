"""Asynchronous saves on the one-rank group (:mod:`paramfsm.checkpoint.background`): the handle a user holds.

A failed write is raised by ``wait()`` every time it is asked and logged where it happened, and a failure
nobody saw is raised by the next save instead; a write still going is named by ``wait(timeout)``; the
staged copy's size is this rank's shards and optimizer state. The two-rank versions (a failure on one
rank only) are in ``test_checkpoint_async.py``.
"""

from __future__ import annotations

import errno
import logging
import threading
import time

import pytest
import torch

import paramfsm
import paramfsm.checkpoint as ck
from one_rank import one_rank  # noqa: F401 - fixture
from paramfsm.checkpoint import background, folders
from paramfsm.errors import ParamFSMError
from paramfsm.testing.models import mlp


@pytest.fixture
def trained(one_rank):  # noqa: F811
    torch.manual_seed(0)
    model = mlp(width=8, depth=2, d_in=4, d_out=3)
    rt = paramfsm.shard(model)
    opt = torch.optim.Adam(rt.model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    yield rt, opt
    folders.fault_hook = None
    rt.close()


def _fail_at(point):
    def hook(reached):
        if reached == point:
            raise OSError(errno.ENOSPC, "No space left on device")
    return hook


def test_a_failed_write_is_raised_at_every_wait_and_logged(trained, tmp_path, caplog):
    rt, opt = trained
    folders.fault_hook = _fail_at("data_written")
    with caplog.at_level(logging.ERROR, logger="paramfsm.checkpoint.background"):
        handle = ck.save(rt, tmp_path / "ck", optimizer=opt, async_save=True)
        messages = []
        for _ in range(2):
            with pytest.raises(ParamFSMError) as caught:
                handle.wait()
            messages.append(str(caught.value))
    assert messages[0] == messages[1]
    assert messages[0].startswith(f"paramfsm.checkpoint.save to '{tmp_path / 'ck'}' failed: ")
    assert "No space left on device" in messages[0] and "was not replaced" in messages[0]
    assert [r.getMessage() for r in caplog.records if r.name == background.logger.name] == [
        f"asynchronous paramfsm.checkpoint.save to {tmp_path / 'ck'} failed: {messages[0]}"]
    assert handle.done() and repr(handle) == f"<SaveHandle {tmp_path / 'ck'} failed>"
    folders.fault_hook = None
    ck.save(rt, tmp_path / "ck")  # the failure was seen: the next save goes ahead
    assert folders.problem(tmp_path / "ck") is None


def test_a_failure_nobody_waited_for_is_raised_by_the_next_save(trained, tmp_path):
    rt, opt = trained
    folders.fault_hook = _fail_at("data_written")
    handle = ck.save(rt, tmp_path / "ck", async_save=True)
    while not handle.done():  # done() only looks: the failure stays unseen
        time.sleep(0.01)
    folders.fault_hook = None
    with pytest.raises(ParamFSMError) as caught:
        ck.save(rt, tmp_path / "other")
    assert str(caught.value).startswith(f"paramfsm.checkpoint.save to '{tmp_path / 'ck'}' failed: ")
    assert str(caught.value).endswith(". This save did not start; call it again to retry")
    assert not (tmp_path / "other").exists()
    ck.save(rt, tmp_path / "other")  # raised once: the retry saves
    assert folders.problem(tmp_path / "other") is None


def test_an_error_that_is_not_paramfsm_s_is_named_with_its_type(trained, tmp_path):
    rt, _ = trained

    def broken():
        raise KeyError("lost")

    handle = background.SaveHandle(tmp_path / "ck", 0, broken)
    handle._thread.start()
    with pytest.raises(ParamFSMError) as caught:
        handle.wait()
    assert str(caught.value) == f"the asynchronous save to '{tmp_path / 'ck'}' failed: KeyError: 'lost'"
    assert isinstance(caught.value.__cause__, KeyError)


def test_a_write_still_going_is_named_and_staged_bytes_are_this_rank_s_state(trained, tmp_path):
    rt, opt = trained
    release = threading.Event()
    folders.fault_hook = lambda point: release.wait(30) if point == "writing" else None
    try:
        handle = ck.save(rt, tmp_path / "ck", optimizer=opt, async_save=True)
        assert repr(handle) == f"<SaveHandle {tmp_path / 'ck'} writing>" and not handle.done()
        assert f"paramfsm-save {tmp_path / 'ck'}" in {t.name for t in threading.enumerate()}, "named in dumps"
        with pytest.raises(ParamFSMError, match=r"is still writing after 0.05 s$"):
            handle.wait(0.05)
        shards = sum(s.numel() * s.element_size() for s in rt.shard_parameters())
        moments = sum(v.numel() * v.element_size() for state in opt.state.values() for v in state.values()
                      if isinstance(v, torch.Tensor))
        assert handle.staged_bytes == shards + moments
        assert background.staging_bytes(rt) == handle.staged_bytes
        assert background.pending(rt) is handle
    finally:
        release.set()
    handle.wait()
    assert repr(handle) == f"<SaveHandle {tmp_path / 'ck'} done>"
    assert background.staging_bytes(rt) == 0


def test_the_staged_copy_is_what_the_state_held_when_the_save_started():
    """Later writes to the shards, the optimizer state or a nested value do not reach the staged copy; a tied
    parameter's two keys share one copy and count once."""
    from types import SimpleNamespace

    from paramfsm.checkpoint.layout import model_shaped

    rec = SimpleNamespace(name="w", shape=torch.Size((2, 3)), numel=6, shard_numel=6)
    shard = torch.arange(6.0)
    pieces = model_shaped(SimpleNamespace(rank=0), rec, shard)
    tied = model_shaped(SimpleNamespace(rank=0), rec, shard)
    moment, nested = torch.ones(4, dtype=torch.float64), {"step": [1]}
    staged, nbytes = background.stage({"w": pieces, "tied": tied, "m": moment, "meta": nested, "n": 3})
    assert nbytes == 6 * 4 + 4 * 8, "the shared shard once, and the moment"
    assert staged["w"].flat is staged["tied"].flat, "one copy for both keys"
    shard.add_(100.0)
    moment.add_(100.0)
    nested["step"].append(2)
    assert torch.equal(staged["w"].flat, torch.arange(6.0)) and staged["w"].key == "w"
    assert torch.equal(staged["m"], torch.ones(4, dtype=torch.float64))
    assert staged["meta"] == {"step": [1]} and staged["n"] == 3


def test_closing_the_runtime_destroys_the_group_its_asynchronous_saves_ran_on(one_rank, tmp_path):  # noqa: F811
    import torch.distributed as dist

    torch.manual_seed(0)
    rt = paramfsm.shard(mlp(width=8, depth=2, d_in=4, d_out=3))
    release = threading.Event()
    folders.fault_hook = lambda point: release.wait(30) if point == "writing" else None
    try:
        handle = ck.save(rt, tmp_path / "ck", async_save=True)
        group = background._groups[rt]
        assert group in dist.distributed_c10d._world.pg_map and dist.get_process_group_ranks(group) == [0]
        background.release_group(rt)
        assert group in dist.distributed_c10d._world.pg_map, "a save still writes on it"
    finally:
        release.set()
        folders.fault_hook = None
    handle.wait()
    background.release_group(rt)
    assert group not in dist.distributed_c10d._world.pg_map, "its gloo threads and sockets would stay"
    ck.save(rt, tmp_path / "ck2", async_save=True).wait()
    again = background._groups[rt]
    rt.close()
    assert again not in dist.distributed_c10d._world.pg_map, "rt.close() releases it too"
