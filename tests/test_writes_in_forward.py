"""A write to a gathered parameter inside forward is never dropped in silence.

A layer that clamps its own weight in place inside ``forward`` wrote only the gathered full copy, and the
release dropped it: ``rt.full_param`` still showed 0.377 where plain torch keeps 0.1, and training went on
with other numbers. Now the release finds the parameter's version moved and raises ``WriteToGathered``,
naming the parameter, its module and unit, the rank and the fix; after ``rt.reset()`` the loop trains on, and
the same write inside ``rt.gathered(writeback=True)`` reaches the shards and matches plain torch.
"""

from __future__ import annotations

import pytest
import torch
from patterns_common import Pair, batch
from torch import nn

import paramfsm
from paramfsm.engine.effects.lost_writes import WriteToGathered
from paramfsm.engine.storage.default_units import MIN_UNIT_BYTES


class Clamped(nn.Linear):
    """Clamps its own weight in place in forward (a constraint some models enforce this way)."""

    def forward(self, x):
        with torch.no_grad():
            self.weight.clamp_(-0.1, 0.1)
        return super().forward(x)


def clamp_job(rank, world, min_unit_bytes):
    torch.manual_seed(0)
    pair = Pair(nn.Sequential(Clamped(4, 8), nn.Tanh(), nn.Linear(8, 2)), rank, world, min_unit_bytes=min_unit_bytes)
    model, ref = pair.model, pair.ref.model
    (x,) = batch(0, world, 2, (4,))
    caught = None
    try:
        model(pair.local(x))
    except WriteToGathered as exc:
        caught = str(exc)
    pair.rt.reset()
    model[0].__class__ = nn.Linear  # the loop moves the constraint out of forward ...
    ref[0].__class__ = nn.Linear
    with pair.rt.gathered(model[0], writeback=True), torch.no_grad():  # ... to here, between iterations
        model[0].weight.clamp_(-0.1, 0.1)
    with torch.no_grad():
        ref[0].weight.clamp_(-0.1, 0.1)
    for step in range(2):
        (x,) = batch(step, world, 2, (4,))
        pair.zero_grad()
        model(pair.local(x)).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
        pair.check_grads(f"step {step}")
        pair.step(f"step {step}")
    return caught, pair.finish()


@pytest.mark.parametrize("min_unit_bytes,unit", [(MIN_UNIT_BYTES, "<root>"), (0, "0")],
                         ids=["default_units", "per_module"])
def test_a_write_to_a_weight_inside_forward_raises_and_the_gathered_write_trains_like_plain_torch(ranks2,
                                                                                                   min_unit_bytes,
                                                                                                   unit):
    for rank, (caught, report) in enumerate(ranks2.run(clamp_job, min_unit_bytes)):
        assert caught is not None, "the write inside forward was dropped with no error"
        for fact in ("parameter '0.weight'", "module '0'", f"unit '{unit}'", f"rank {rank}",
                     "rt.gathered(module, writeback=True)"):
            assert fact in caught, (fact, caught)
        assert report["checks"] == 4
    assert issubclass(WriteToGathered, paramfsm.ParamFSMError)
