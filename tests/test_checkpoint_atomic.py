"""Atomic saves at world 2: a rank killed anywhere in a save over a checkpoint leaves a checkpoint that loads.

Each case saves a checkpoint, trains a step, and saves again into the same
folder while :data:`paramfsm.checkpoint.folders.fault_hook` kills one rank
(``os._exit``) at a named point of the save. Its pool dies with it; a fresh
pool then loads the folder and must find exactly the previous values (killed
before the swap) or exactly the new ones (killed after it), never a mix or
an error, and the next save leaves no staging folder behind.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import paramfsm
import paramfsm.checkpoint as ck
from paramfsm.checkpoint import folders
from paramfsm.verify.launch import RankFailure, RankPool
from paramfsm.testing.models import mlp


def _trained(rank, world, steps):
    torch.manual_seed(0)
    model = mlp(width=8, depth=3, d_in=4, d_out=3)
    rt = paramfsm.shard(model)
    opt = torch.optim.SGD(rt.shard_parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(100 * step + rank))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, rt, opt


def save_then_die_job(rank, world, folder, point, victim, exchange):
    """Save step 1 to ``ck``, train to step 2, save again and die at ``point`` on rank ``victim``."""
    folder = Path(folder)
    model, rt, opt = _trained(rank, world, 1)
    ck.save(rt, folder / "ck", optimizer=opt)
    before = rt.full_state_dict()
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(7 + rank))
    model(x).pow(2).mean().backward()
    opt.step()
    after = rt.full_state_dict()
    if rank == 0:
        torch.save({"before": before, "after": after}, folder / "values.pt")
    folders.use_exchange = exchange
    folders.fault_hook = lambda reached: os._exit(17) if reached == point and rank == victim else None
    ck.save(rt, folder / "ck", optimizer=opt)
    return "saved"


def load_job(rank, world, folder):
    """Load ``ck`` into a fresh model; return it in full, then save over it and list what the parent holds."""
    folder = Path(folder)
    model, rt, opt = _trained(rank, world, 0)
    ck.load(rt, folder / "ck", optimizer=opt)
    loaded = rt.full_state_dict()
    ck.save(rt, folder / "ck", optimizer=opt)
    return loaded, sorted(p.name for p in folder.iterdir())


#: (point, rank killed there, exchange available, which values ``ck`` must hold after).
CASES = [
    ("prepared", 1, True, "before"),
    ("data_written", 1, True, "before"),
    ("data_written", 0, False, "before"),
    ("metadata", 0, True, "before"),
    ("written", 0, True, "before"),
    ("manifest_written", 0, True, "before"),
    ("retired", 0, False, "before"),
    ("committed", 0, True, "after"),
    ("committed", 0, False, "after"),
]


@pytest.mark.slow
@pytest.mark.parametrize("point, victim, exchange, holds", CASES,
                         ids=[f"{p}-rank{v}-{'exchange' if e else 'renames'}" for p, v, e, _ in CASES])
def test_a_rank_killed_during_a_save_leaves_a_checkpoint_that_loads_exactly(ranks2, tmp_path, point, victim,
                                                                            exchange, holds):
    with RankPool(2, timeout=120) as pool:
        with pytest.raises(RankFailure):
            pool.run(save_then_die_job, str(tmp_path), point, victim, exchange)
    values = torch.load(tmp_path / "values.pt")
    for loaded, listing in ranks2.run(load_job, str(tmp_path)):
        for key, want in values[holds].items():
            assert torch.equal(loaded[key], want), f"'{key}' after a kill at {point}: not the {holds} values"
        other = values["after" if holds == "before" else "before"]
        assert any(not torch.equal(loaded[key], other[key]) for key in other), "the two saves hold equal values"
        assert listing == ["ck", "values.pt"], f"the next save left {listing}"
