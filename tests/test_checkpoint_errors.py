"""Checkpoint errors at world 2: every rank raises the same ParamFSMError, and nothing is changed.

A checkpoint of another model is refused before anything is read into the
shards, naming the first differing key with both shapes. A save that fails
(a full disk on one rank, a folder that cannot be made) names the path,
leaves the previous checkpoint loadable, and training goes on.
"""

from __future__ import annotations

import errno
from pathlib import Path

import pytest
import torch
from torch import nn

import paramfsm
import paramfsm.checkpoint as ck
from paramfsm.checkpoint import folders
from paramfsm.errors import ParamFSMError


@pytest.fixture(scope="module")
def ranks2(in_process2):
    """This file's two ranks are threads of the test process (``gloo_ranks.py``), where ``make mutate`` sees
    them; a test that needs processes of its own asks for ``suite_ranks2``."""
    return in_process2


def _net(shape_of_first=(8, 4), seed=0) -> nn.Module:
    torch.manual_seed(seed)
    out_features, in_features = shape_of_first
    return nn.Sequential(nn.Linear(in_features, out_features), nn.ReLU(), nn.Linear(out_features, 3))


def _step(model, opt, rank):
    x = torch.randn(2, model[0].in_features, generator=torch.Generator().manual_seed(rank))
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _attempt(fn) -> str | None:
    try:
        fn()
    except ParamFSMError as exc:
        return str(exc)
    return None


def mismatch_job(rank, world, folder):
    folder = Path(folder)
    saved = _net((8, 4))
    rt = paramfsm.shard(saved)
    ck.save(rt, folder / "ck")
    out = {}
    for name, shape in (("wider", (6, 4)), ("transposed", (4, 8))):  # (4, 8) has (8, 4)'s numel
        other = _net(shape, seed=1)
        rt_other = paramfsm.shard(other)
        before = rt_other.full_state_dict()
        out[name] = _attempt(lambda: ck.load(rt_other, folder / "ck"))  # noqa: B023
        after = rt_other.full_state_dict()
        out[f"{name} unchanged"] = all(torch.equal(before[k], after[k]) for k in before)
        other(torch.randn(2, other[0].in_features))  # runs: no values guard, as nothing was written
    bigger = nn.Sequential(*_net((8, 4)), nn.Linear(3, 3))
    out["extra key"] = _attempt(lambda: ck.load(paramfsm.shard(bigger), folder / "ck"))
    out["no optimizer"] = _attempt(lambda: ck.load(rt, folder / "ck", optimizer=torch.optim.SGD(
        rt.shard_parameters(), lr=0.1, momentum=0.9)))
    return out


def test_a_checkpoint_of_another_model_is_refused_on_every_rank_naming_the_key(ranks2, tmp_path):
    outs = ranks2.run(mismatch_job, str(tmp_path))
    assert outs[0] == outs[1], "every rank raises the same error"
    out = outs[0]
    assert out["wider"].startswith("paramfsm.checkpoint.load: '0.weight' has shape (8, 4) in '")
    assert "but shape (6, 4) in this model" in out["wider"] and out["wider"].endswith("(rank 0)")
    assert "'0.weight' has shape (8, 4) in '" in out["transposed"], out["transposed"]
    assert "but shape (4, 8) in this model" in out["transposed"]
    assert out["wider unchanged"] and out["transposed unchanged"]
    assert "holds '3.weight', which this model does not have" not in out["extra key"]
    assert "has no '3.weight' (this model's shape (3, 3))" in out["extra key"], out["extra key"]
    assert "was saved without optimizer state" in out["no optimizer"]


def disk_full_job(rank, world, folder):
    """Save, then a save that fails writing on rank 1 (ENOSPC); the previous checkpoint loads, training goes on."""
    folder = Path(folder)
    model = _net()
    rt = paramfsm.shard(model)
    opt = torch.optim.SGD(rt.shard_parameters(), lr=0.1, momentum=0.9)
    _step(model, opt, rank)
    ck.save(rt, folder / "ck", optimizer=opt)
    kept = rt.full_state_dict()
    _step(model, opt, rank)

    def full_disk(point):
        if point == "data_written" and rank == 1:
            raise OSError(errno.ENOSPC, "No space left on device", str(folder / "data"))
    folders.fault_hook = full_disk
    try:
        error = _attempt(lambda: ck.save(rt, folder / "ck", optimizer=opt))
    finally:
        folders.fault_hook = None
    listing = sorted(p.name for p in folder.iterdir())
    _step(model, opt, rank)  # training continues
    ck.load(rt, folder / "ck", optimizer=opt)
    loaded = rt.full_state_dict()
    return error, listing, all(torch.equal(kept[k], loaded[k]) for k in kept)


# Spawned ranks: each rank patches the process's checkpoint writer its own way.
def test_a_full_disk_during_a_save_raises_on_every_rank_and_keeps_the_previous_checkpoint(suite_ranks2, tmp_path):
    for error, listing, kept in suite_ranks2.run(disk_full_job, str(tmp_path)):
        assert error is not None, "the failed save raised nothing"
        assert error.startswith(f"paramfsm.checkpoint.save to '{tmp_path / 'ck'}' failed: rank 1: OSError: No "
                                "space left on device"), error
        assert "was not replaced: it still holds the previous checkpoint" in error
        assert listing == ["ck"], f"the failed save left {listing}"
        assert kept, "the previous checkpoint did not load exactly"


def unwritable_job(rank, world, folder):
    folder = Path(folder)
    (folder / "a-file").write_text("") if rank == 0 else None
    rt = paramfsm.shard(_net())
    return _attempt(lambda: ck.save(rt, folder / "a-file" / "ck"))


def test_a_folder_that_cannot_be_made_raises_on_every_rank_naming_the_path(ranks2, tmp_path):
    for error in ranks2.run(unwritable_job, str(tmp_path)):
        assert error is not None
        assert error.startswith(f"paramfsm.checkpoint.save: cannot create a folder beside "
                                f"'{tmp_path / 'a-file' / 'ck'}' (File exists); nothing was written. What to "
                                f"do: check that '{tmp_path / 'a-file'}' is a writable folder with free space"), error
        assert error.endswith("(rank 0)")
