"""A backward that reaches different units on different ranks raises RankDesync on every rank at once.

A loss that reads a different output on each rank (rank-dependent branching in the loss) makes one rank's
backward reach a unit the other's does not, so that rank issues a reduce-scatter the other never does. When the
other rank's next collective was paramfsm's, the rank check caught it; when it was the user's own (a logged loss
all-reduced) both waited until the collective timeout. Each backward now ends with a small tagged agreement
(see [Note: a backward that reached other units on other ranks] in ``paramfsm.engine.effects.gathers``).
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

import paramfsm
from paramfsm.errors import CollectiveTimeout, RankDesync


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 4)
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        return self.a(x), self.b(x)


def job(rank, world):
    torch.manual_seed(0)
    model = TwoHeads()
    rt = paramfsm.shard(model, min_unit_bytes=0, bucket_bytes=0, collective_timeout=60)
    out_a, out_b = model(torch.randn(4, 8))
    # Rank 0's backward reaches unit 'a' last, after every reduce-scatter rank 1 issues.
    loss = (out_a.pow(2).mean() if rank == 0 else 0) + out_b.pow(2).mean()
    start = time.monotonic()
    try:
        loss.backward()
        dist.all_reduce(loss.detach().clone())  # the user's own collective next
    except (RankDesync, CollectiveTimeout) as exc:
        outcome = type(exc).__name__, str(exc)
    else:
        outcome = None, ""
    elapsed = time.monotonic() - start
    rt.detach()
    return outcome, elapsed


def test_a_rank_dependent_backward_raises_rank_desync_on_every_rank_within_the_backward(ranks2):
    for rank, ((kind, message), elapsed) in enumerate(ranks2.run(job, timeout=120)):
        assert kind == "RankDesync", (rank, kind, message)
        assert elapsed < 30, (rank, elapsed)
        assert f"rank {rank}" in message or "rank" in message, message
