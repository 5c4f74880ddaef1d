"""Asynchronous saves at world 2: what is written is the state at the call, and a failure is never lost.

The background write is held at its first point (``writing``, before DCP
reads anything) while the loop trains on, so a save that wrote the live
shards instead of its staged copy would hold the later values.
"""

from __future__ import annotations

import errno
import threading
from pathlib import Path

import pytest
import torch

import paramfsm
import paramfsm.checkpoint as ck
from paramfsm.checkpoint import folders
from paramfsm.errors import ParamFSMError
from paramfsm.testing.models import mlp


@pytest.fixture(scope="module")
def ranks2(in_process2):
    """This file's two ranks are threads of the test process (``gloo_ranks.py``), where ``make mutate`` sees
    them; a test that needs processes of its own asks for ``suite_ranks2``."""
    return in_process2


def _setup():
    torch.manual_seed(0)
    model = mlp(width=8, depth=3, d_in=4, d_out=3)
    rt = paramfsm.shard(model)
    opt = torch.optim.AdamW(rt.shard_parameters(), lr=0.05)
    return model, rt, opt


def _step(model, opt, rank, step):
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * step + rank))
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _loaded(folder: Path) -> tuple[dict, dict]:
    """The model and optimizer state (one rank's shards) a fresh runtime loads from ``folder``."""
    model, rt, opt = _setup()
    ck.load(rt, folder, optimizer=opt)
    state = {name: {k: v.clone() for k, v in opt.state[shard].items()} for name, shard in rt.named_shard_parameters()}
    return rt.full_state_dict(), state


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        _equal(a[k], b[k]) if isinstance(a[k], dict) else torch.equal(a[k], b[k]) for k in a)


def staged_job(rank, world, folder):
    folder = Path(folder)
    model, rt, opt = _setup()
    _step(model, opt, rank, 0)
    ck.save(rt, folder / "sync", optimizer=opt)
    at_save = rt.full_state_dict()
    release = threading.Event()
    folders.fault_hook = lambda point: release.wait(60) if point == "writing" else None
    try:
        handle = ck.save(rt, folder / "async", optimizer=opt, async_save=True)
        held = not handle.done()
        for step in (1, 2):  # the loop goes on while the write is held
            _step(model, opt, rank, step)
        moved = not _equal(rt.full_state_dict(), at_save)
        release.set()
        handle.wait()
    finally:
        folders.fault_hook = None
    out = {"held": held, "moved": moved, "done": handle.done(), "staged_bytes": handle.staged_bytes,
           "shard_bytes": sum(s.numel() * s.element_size() for s in rt.shard_parameters())}
    sync, async_ = _loaded(folder / "sync"), _loaded(folder / "async")
    out["model equal"] = _equal(sync[0], async_[0]) and _equal(sync[0], at_save)
    out["optimizer equal"] = _equal(sync[1], async_[1])
    # A second save waits for the first: it returns with the first done.
    release.clear()
    first = ck.save(rt, folder / "first", async_save=True)
    ck.save(rt, folder / "second")
    out["first done by the second"] = first.done()
    first.wait()
    return out


def test_an_async_save_writes_the_state_at_the_call_while_training_goes_on(ranks2, tmp_path):
    for out in ranks2.run(staged_job, str(tmp_path)):
        assert out["held"] and out["moved"] and out["done"], out
        assert out["model equal"], "the async save does not hold the values at the call"
        assert out["optimizer equal"], "the async save's optimizer state differs from the sync save's"
        # one copy of the shards (without their padding) and of AdamW's two moments and step counters
        assert 2 * out["shard_bytes"] < out["staged_bytes"] <= 3 * out["shard_bytes"] + 1024, out
        assert out["first done by the second"], out


def failing_job(rank, world, folder):
    folder = Path(folder)
    model, rt, opt = _setup()
    ck.save(rt, folder / "ck")
    kept = rt.full_state_dict()
    _step(model, opt, rank, 0)

    def full_disk(point):
        if point == "data_written" and rank == 1:
            raise OSError(errno.ENOSPC, "No space left on device")
    folders.fault_hook = full_disk
    out = {}
    try:
        handle = ck.save(rt, folder / "ck", async_save=True)
        for _ in range(2):  # asked twice, it fails twice: it never disappears
            try:
                handle.wait()
                out.setdefault("wait", []).append(None)
            except ParamFSMError as exc:
                out.setdefault("wait", []).append(str(exc))
        ck.save(rt, folder / "ck", async_save=True)  # fails too; nobody waits for it
        try:
            ck.save(rt, folder / "other")
            out["next save"] = None
        except ParamFSMError as exc:
            out["next save"] = str(exc)
    finally:
        folders.fault_hook = None
    ck.save(rt, folder / "other")  # the failure was reported: saving works again
    out["listing"] = sorted(p.name for p in folder.iterdir())
    ck.load(rt, folder / "ck")
    loaded = rt.full_state_dict()
    out["previous kept"] = _equal(loaded, kept)
    return out


# Spawned ranks: each rank patches the process's checkpoint writer its own way.
def test_an_async_save_that_fails_raises_at_wait_and_else_at_the_next_save(suite_ranks2, tmp_path):
    path = tmp_path / "ck"
    for out in suite_ranks2.run(failing_job, str(tmp_path)):
        first, again = out["wait"]
        assert first is not None and first == again, out["wait"]
        assert first.startswith(f"paramfsm.checkpoint.save to '{path}' failed: rank 1: OSError: No space left on "
                                "device. "), first
        assert "was not replaced: it still holds the previous checkpoint" in first
        assert out["next save"] is not None and out["next save"].startswith(
            f"paramfsm.checkpoint.save to '{path}' failed: rank 1: OSError"), out["next save"]
        assert out["next save"].endswith("This save did not start; call it again to retry"), out["next save"]
        assert out["listing"] == ["ck", "other"] and out["previous kept"], out


def close_job(rank, world, folder):
    """``rt.memory()`` shows the staged copy while the save writes; ``rt.close()`` waits for the save."""
    folder = Path(folder)
    model, rt, opt = _setup()
    _step(model, opt, rank, 0)
    at_save = rt.full_state_dict()
    before = rt.memory()
    release = threading.Event()
    folders.fault_hook = lambda point: release.wait(60) if point == "writing" else None
    try:
        handle = ck.save(rt, folder / "ck", optimizer=opt, async_save=True)
        writing = rt.memory()
        timer = threading.Timer(0.5, release.set)
        timer.start()
        rt.close()  # returns only after the held write was released and committed
        done_at_close = handle.done()
        timer.join()
    finally:
        folders.fault_hook = None
    handle.wait()
    loaded, _ = _loaded(folder / "ck")
    return {"before": "checkpoint_staging" in before, "writing": writing["checkpoint_staging"],
            "staged": handle.staged_bytes, "shards": writing["shards"], "done at close": done_at_close,
            "loaded": _equal(loaded, at_save)}


def test_close_waits_for_an_async_save_and_memory_shows_its_staged_copy(ranks2, tmp_path):
    for result in ranks2.run(close_job, str(tmp_path)):
        assert not result["before"], "no asynchronous save yet: no staging kind"
        # the copy holds the shards and AdamW's two moments, like them: at least the shards' bytes
        assert result["writing"] == result["staged"] >= result["shards"] > 0, result
        assert result["done at close"] and result["loaded"], result
