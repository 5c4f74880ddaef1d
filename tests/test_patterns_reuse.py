"""Parameter and module reuse on 2 gloo ranks, compared with plain torch.

Tied weights (one Parameter in two units), one module called several times
in a forward (ALBERT style), unused parameters and conditional branches
(the same on all ranks), module inputs that do not require grad, and a unit
whose output never reaches the loss.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from patterns_common import Pair, batch, gathers_by_task, reduces_by_task, tokens
from patterns_common import ranks2  # noqa: F401 - the fixture: every test here runs under both unit choices
from torch import nn

from paramfsm import State
from paramfsm.testing.models import TinyTransformer

VOCAB, SEQ = 32, 8


def tied_job(rank, world, retain):
    torch.manual_seed(0)
    pair = Pair(TinyTransformer(vocab=VOCAB, dim=16, depth=2, seq=SEQ, tied=True), rank, world, retain=retain)
    rt, model, ref = pair.rt, pair.model, pair.ref.model
    assert model.head.weight is model.embed.weight
    owners = [u.name for u in rt.record("embed.weight").units]
    assert owners == (["embed", "head"] if len(rt.units) > 1 else ["<root>"]), owners  # the default: one unit
    per_backward = []
    for step in range(2):
        tok, tgt = tokens(step, world, 2, SEQ, VOCAB), tokens(step, world, 2, SEQ, VOCAB, seed=1)
        out, ref_out = model(pair.local(tok)), ref(tok)
        losses = [F.cross_entropy(out.reshape(-1, VOCAB), pair.local(tgt).reshape(-1)), out.tanh().mean()]
        ref_losses = [F.cross_entropy(ref_out.reshape(-1, VOCAB), tgt.reshape(-1)), ref_out.tanh().mean()]
        for i in range(2):
            pair.zero_grad()
            first = len(rt.trace)
            losses[i].backward(retain_graph=i == 0)
            ref_losses[i].backward(retain_graph=i == 0)
            records = rt.trace.records[first:]
            tied = [r for r in records if r.param == "embed.weight"]
            reduced_at = [k for k, r in enumerate(tied) if "reduce_grad" in r.effects]
            freed_at = [k for k, r in enumerate(tied) if "free" in r.effects]
            # released only after its last holder: nothing frees it before its one reduce-scatter
            assert len(reduced_at) == 1 and all(k > reduced_at[0] for k in freed_at), \
                [(r.event, r.src, r.dst, r.effects) for r in tied]
            per_backward.append((reduces_by_task(records, "embed.weight"),
                                 gathers_by_task(records, "embed.weight")))
            pair.check_grads(f"step {step} backward {i}")
        pair.step(f"step {step}")
    report = pair.finish()
    report["per_backward"] = per_backward
    return report


@pytest.mark.parametrize("retain", ["defer", "regather"])
def test_tied_weights_one_reduce_per_backward(ranks2, retain):
    report = ranks2.run(tied_job, retain)[0]
    for reduces, gathers in report["per_backward"]:
        assert list(reduces.values()) == [1], reduces
        assert all(count <= 1 for count in gathers.values()), gathers
    if retain == "defer" and ranks2.choice == "per_module":
        assert [g for _, g in report["per_backward"][1::2]] == [{}, {}]


class Looped(nn.Module):
    """One shared layer applied several times (ALBERT style), plus a layer used twice in a row."""

    def __init__(self, dim: int = 8, times: int = 3):
        super().__init__()
        self.inp = nn.Linear(4, dim)
        self.shared = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.out = nn.Linear(dim, 3)
        self.times = times

    def forward(self, x):
        h = self.inp(x)
        for _ in range(self.times):
            h = self.norm(torch.tanh(self.shared(h)) + h)
        return self.out(h)


def looped_job(rank, world, retain):
    torch.manual_seed(0)
    pair = Pair(Looped(), rank, world, retain=retain)
    model, ref = pair.model, pair.ref.model
    for step in range(3):
        x, = batch(step, world, 2, (4,))
        out, ref_out = model(pair.local(x)), ref(x)
        for i, (loss, ref_loss) in enumerate([(out.pow(2).mean(), ref_out.pow(2).mean()),
                                             (out.sin().mean(), ref_out.sin().mean())]):
            pair.zero_grad()
            loss.backward(retain_graph=i == 0)
            ref_loss.backward(retain_graph=i == 0)
            pair.check_grads(f"step {step} backward {i}")
        pair.step(f"step {step}")
    return pair.finish()


@pytest.mark.parametrize("retain", ["defer", "regather"])
def test_module_called_several_times(ranks2, retain):
    assert ranks2.run(looped_job, retain)[0]["checks"] == 9


class Branchy(nn.Module):
    """Conditional branches, an unused parameter, a unit fed only constants, a unit whose output is dropped."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.inp = nn.Linear(4, dim)
        self.left = nn.Linear(dim, dim)
        self.right = nn.Linear(dim, dim)
        self.unused = nn.Parameter(torch.randn(dim))  # owned by the root unit, never used
        self.const = nn.Linear(2, dim)  # its input never requires grad
        self.probe = nn.Linear(dim, 1)  # its output is computed and thrown away
        self.out = nn.Linear(dim, 3)

    def forward(self, x, branch: str):
        h = torch.tanh(self.inp(x))
        h = self.left(h) if branch == "left" else self.right(h)
        h = h + self.const(torch.ones(x.shape[0], 2))
        self.probe(h)
        return self.out(h)


def branch_job(rank, world, retain):
    torch.manual_seed(0)
    pair = Pair(Branchy(), rank, world, retain=retain)
    model, ref = pair.model, pair.ref.model
    for step, branch in enumerate(["left", "right", "left", "left"]):
        x, = batch(step, world, 2, (4,))
        pair.zero_grad()
        out, ref_out = model(pair.local(x), branch), ref(x, branch)
        out.pow(2).mean().backward()
        ref_out.pow(2).mean().backward()
        pair.assert_states(State.NOT_AVAILABLE, what=f"after backward at step {step}")
        grads = pair.ref.grads()
        assert grads["unused"] is None and grads["probe.weight"] is None
        assert pair.rt.full_grad("unused") is None and pair.rt.full_grad("probe.weight") is None
        assert (grads["right.weight"] is None) == (branch == "left")
        pair.check_grads(f"step {step} ({branch})")
        pair.step(f"step {step}")
    return pair.finish()


@pytest.mark.parametrize("retain", ["defer", "regather"])
def test_unused_parameters_and_branches(ranks2, retain):
    assert ranks2.run(branch_job, retain)[0]["checks"] == 8
