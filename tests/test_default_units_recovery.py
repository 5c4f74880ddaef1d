"""Recovery from an exception inside backward when the whole model is one unit (the default units merge it).

The backward raises inside a user's ``autograd.Function`` or inside an activation checkpoint's
recomputation; the loop calls ``opt.zero_grad(set_to_none=True)`` (and ``rt.reset()``, or lets the next
forward recover by itself) and trains on. The next iterations must match plain torch: the gradients the
interrupted backward had already accumulated into full parameters (queued, with no other event of the
merged unit after them) must be dropped, neither left for the next backward to add to nor reduce-scattered
after the user's ``zero_grad``.
"""

from __future__ import annotations

import pytest
import torch
from patterns_common import Pair, batch
from torch import nn
from torch.utils.checkpoint import checkpoint

from paramfsm.engine.storage.default_units import MIN_UNIT_BYTES

FAIL = {"where": None}


class Doubled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        if FAIL["where"] == "function":
            raise RuntimeError("refused in a custom backward")
        return grad * 2


class Block(nn.Module):
    """A frozen layer, tanh and a trainable layer, run under activation checkpointing."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(8, 8).requires_grad_(False)
        self.trained = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if FAIL["where"] == "recompute" and self.calls > 1:  # the recomputation inside backward
            raise RuntimeError("refused in a recomputation")
        return self.trained(torch.tanh(self.frozen(x)))


class Net(nn.Module):
    def __init__(self, reentrant: bool):
        super().__init__()
        self.inp, self.block, self.head = nn.Linear(4, 8), Block(), nn.Linear(8, 3)
        self.reentrant = reentrant

    def forward(self, x):
        self.block.calls = 0
        h = checkpoint(self.block, self.inp(x), use_reentrant=self.reentrant)
        return self.head(Doubled.apply(h))


def recovery_job(rank, world, where, reentrant, reset):
    torch.manual_seed(0)
    pair = Pair(Net(reentrant), rank, world, min_unit_bytes=MIN_UNIT_BYTES)  # ranks inherit the suite's 0
    assert len(pair.rt.units) == 1, pair.rt.describe_units()  # the default merges the model into the root
    model, ref = pair.model, pair.ref.model
    for step in range(4):
        x, y = batch(step, world, 2, (4,), (3,))
        FAIL["where"] = where if step == 1 else None
        try:
            ((model(pair.local(x)) - pair.local(y)) ** 2).mean().backward()
        except RuntimeError as exc:
            assert step == 1 and "refused" in str(exc), exc
            if reset:
                pair.rt.reset()
            pair.zero_grad()
            continue
        FAIL["where"] = None
        ((ref(x) - y) ** 2).mean().backward()
        pair.check_grads(f"step {step}")
        pair.step(f"step {step}")
        pair.zero_grad()
    return pair.finish()


@pytest.mark.parametrize("reset", [True, False], ids=["reset", "next_forward"])
@pytest.mark.parametrize("where,reentrant", [("function", False), ("recompute", False), ("recompute", True)],
                         ids=["in_a_function", "in_a_recomputation", "in_a_reentrant_recomputation"])
def test_an_interrupted_backward_of_a_merged_unit_leaves_nothing_behind(ranks2, where, reentrant, reset):
    report = ranks2.run(recovery_job, where, reentrant, reset)[0]
    assert report["checks"] == 6  # three iterations after the failed one, gradients and parameters each
