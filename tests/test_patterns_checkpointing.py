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
from patterns_common import ranks2  # noqa: F401 - the fixture: every test here runs under both unit choices
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
    """input -> two checkpointed blocks (each several units) -> head; ``reentrant=None``: no checkpointing."""

    def __init__(self, reentrant: bool | None, frozen: bool, dim: int = 8):
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
            x = blk(x) if self.reentrant is None else cp.checkpoint(blk, x, use_reentrant=self.reentrant)
        return self.head(x)


def checkpoint_job(rank, world, reentrant, frozen, retain, n_losses, steps=2):
    torch.manual_seed(0)
    pair = Pair(CheckpointedNet(reentrant, frozen), rank, world, retain=retain)
    model, ref = pair.model, pair.ref.model
    if frozen:
        assert not pair.rt.record("blocks.0.0.base.weight").requires_grad
    deferred_seen, kept_seen = [], []
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
                kept_seen.append(sorted(n for n, s in pair.rt.states().items() if s is State.DEFERRED_RELEASE))
                pair.assert_states(State.DEFERRED_RELEASE, State.NOT_AVAILABLE, what="after a retained backward")
            else:
                pair.assert_states(State.NOT_AVAILABLE, what="after the final backward")
            pair.check_grads(f"step {step} backward {i}")
        pair.step(f"step {step}")
    report = pair.finish()
    report["deferred_seen"], report["kept_seen"] = deferred_seen, kept_seen
    report["names"] = sorted(n for n, _ in model.named_parameters())
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
    # What a retained backward keeps for the next one over the same graph. Non-reentrant checkpointing
    # recomputes from the retained graph's saved-tensor hooks, so every unit stays deferred. Reentrant
    # checkpointing recomputes the blocks in a nested backward of its own (a graph task that keeps no
    # graph), and the next backward recomputes them again: only the units outside the blocks stay.
    names = report["names"]
    outside = [n for n in names if not n.startswith("blocks.")]
    if ranks2.choice == "default_units":  # the whole model is one unit: a retained backward keeps all of it
        outside = names
    kept = [] if retain == "regather" else outside if reentrant else names
    assert report["kept_seen"] == [kept, kept], (report["kept_seen"], kept)


def communication_job(rank, world, reentrant, steps=4):
    """Collectives per step once plans are recorded (the last two steps), with grads checked every step."""
    torch.manual_seed(0)
    pair = Pair(CheckpointedNet(reentrant, False, dim=16), rank, world, bucket_bytes=2048)
    model, ref = pair.model, pair.ref.model
    counts = []
    for step in range(steps):
        x, = batch(step, world, 2, (4,))
        pair.zero_grad()
        model(pair.local(x)).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
        pair.check_grads(f"step {step}")
        pair.step(f"step {step}")
        counts.append(pair.rt.counters)
    pair.finish()
    return {k: (counts[-1][k] - counts[-3][k]) / 2 for k in ("all_gathers", "reduce_scatters")}


def test_recomputation_gathers_and_reduces_no_more_than_without_checkpointing(ranks2):
    """A recomputed unit is gathered once for its recomputation and its backward together, on the
    backward plan's buckets; reentrant checkpointing's nested backward completes no reduce-scatter."""
    plain = ranks2.run(communication_job, None)[0]
    assert plain["all_gathers"] > 2 and plain["reduce_scatters"] >= 1, plain
    for reentrant in (False, True):
        assert ranks2.run(communication_job, reentrant)[0] == plain, f"reentrant={reentrant}"
