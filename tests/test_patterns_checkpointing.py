"""Activation checkpointing (``torch.utils.checkpoint``) on 2 gloo ranks, compared with plain torch.

Both implementations re-run forwards inside backward: non-reentrant
checkpointing recomputes from a saved-tensor hook and stops the
recomputation early (so the last recomputed unit never sees its
post-forward); reentrant checkpointing runs a nested backward (a second
graph task) over the recomputed graph. Covered: frozen (requires_grad=False)
parameters inside the checkpointed block (LoRA style) and the two-loss
retained-graph pattern through checkpointed blocks, under both retain
policies.
"""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint as cp
from patterns_common import Pair, batch
from torch import nn

from paramfsm import State


class LoRALinear(nn.Module):
    """A frozen base Linear plus a trainable low-rank update."""

    def __init__(self, dim: int, rank: int = 2):
        super().__init__()
        self.base = nn.Linear(dim, dim)
        self.base.requires_grad_(False)
        self.down = nn.Linear(dim, rank, bias=False)
        self.up = nn.Linear(rank, dim, bias=False)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


class CheckpointedNet(nn.Module):
    """input -> two checkpointed blocks (each several units) -> head."""

    def __init__(self, reentrant: bool, frozen: bool, dim: int = 8):
        super().__init__()
        self.reentrant = reentrant
        self.inp = nn.Linear(4, dim)

        def block():
            first = LoRALinear(dim) if frozen else nn.Linear(dim, dim)
            return nn.Sequential(first, nn.Tanh(), nn.Linear(dim, dim), nn.LayerNorm(dim))

        self.blocks = nn.ModuleList([block(), block()])
        self.head = nn.Linear(dim, 3)

    def forward(self, x):
        x = self.inp(x)
        for blk in self.blocks:
            x = cp.checkpoint(blk, x, use_reentrant=self.reentrant)
        return self.head(x)


def checkpoint_job(rank, world, reentrant, frozen, retain, n_losses, steps=2):
    torch.manual_seed(0)
    pair = Pair(CheckpointedNet(reentrant, frozen), rank, world, retain=retain)
    model, ref = pair.model, pair.ref.model
    if frozen:
        assert not pair.rt.record("blocks.0.0.base.weight").requires_grad
    deferred_seen = []
    for step in range(steps):
        x, y = batch(step, world, 2, (4,), (3,))
        out, ref_out = model(pair.local(x)), ref(x)
        losses = [torch.nn.functional.mse_loss(out, pair.local(y)), (out ** 2).mean()][:n_losses]
        ref_losses = [torch.nn.functional.mse_loss(ref_out, y), (ref_out ** 2).mean()][:n_losses]
        for i, (loss, ref_loss) in enumerate(zip(losses, ref_losses)):
            keep = i < n_losses - 1
            pair.zero_grad()
            loss.backward(retain_graph=keep)
            ref_loss.backward(retain_graph=keep)
            if keep:
                deferred_seen.append(pair.rt.deferred_bytes)
                pair.assert_states(State.DEFERRED_RELEASE, State.NOT_AVAILABLE, what="after a retained backward")
            else:
                pair.assert_states(State.NOT_AVAILABLE, what="after the final backward")
            pair.check_grads(f"step {step} backward {i}")
        pair.step(f"step {step}")
    report = pair.finish()
    report["deferred_seen"] = deferred_seen
    return report


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "frozen_lora"])
def test_checkpoint_one_loss(ranks2, reentrant, frozen):
    report = ranks2.run(checkpoint_job, reentrant, frozen, "defer", 1)[0]
    assert report["checks"] == 4


@pytest.mark.parametrize("retain", ["defer", "regather"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpoint_two_losses_retained_graph(ranks2, reentrant, retain):
    report = ranks2.run(checkpoint_job, reentrant, True, retain, 2)[0]
    assert report["checks"] == 6
    if retain == "defer":
        assert all(b > 0 for b in report["deferred_seen"]), report["deferred_seen"]
    else:
        assert report["deferred_seen"] == [0, 0]
