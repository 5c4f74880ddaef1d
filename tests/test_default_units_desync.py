"""One rank runs a module the other does not, inside one merged unit: data-parallel semantics, not RankDesync.

Under per-module units a loss that reads another head on each rank is a desync (each rank's backward
reaches another unit, and every rank raises ``RankDesync``: ``tests/test_rank_desync_default.py``). Under the
default units both heads merge into the root, so every rank's backward reaches the same unit: the unit's
gradients go out in its order, zeros for the parameters a rank did not reach ([Note: a unit's gradients go out
in the unit's order]). That outcome must be the data-parallel one: each parameter's gradient is the average
over ranks of each rank's own gradient, which plain torch computes as the mean of the ranks' losses, each on
its slice through its own head.
"""

from __future__ import annotations

import torch
from patterns_common import Pair, batch
from torch import nn

from paramfsm.engine.storage.default_units import MIN_UNIT_BYTES


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(6, 12), nn.Tanh())
        self.heads = nn.ModuleList([nn.Linear(12, 3), nn.Linear(12, 3)])

    def forward(self, x):
        return self.trunk(x)


def per_rank_head_job(rank, world):
    torch.manual_seed(0)
    pair = Pair(TwoHeads(), rank, world, min_unit_bytes=MIN_UNIT_BYTES)
    assert len(pair.rt.units) == 1, pair.rt.describe_units()
    model, ref = pair.model, pair.ref.model
    for step in range(3):
        (x,) = batch(step, world, 2, (6,))
        pair.zero_grad()
        model.heads[rank % 2](model(pair.local(x))).pow(2).mean().backward()
        slices = x.chunk(world)
        (sum(ref.heads[r % 2](ref(slices[r])).pow(2).mean() for r in range(world)) / world).backward()
        pair.check_grads(f"step {step}")
        pair.step(f"step {step}")
    return pair.finish()


def test_a_head_per_rank_inside_one_unit_trains_with_data_parallel_semantics(ranks2):
    assert ranks2.run(per_rank_head_job)[0]["checks"] == 6
