"""Gradients missing on some ranks, on 2 gloo ranks, compared with plain torch on the global batch.

A mixture of experts made one unit (``units=[MoE]``), with data-dependent
routing: one expert gets tokens on rank 0 only, one on no rank at all. Every
rank reduce-scatters the unit's parameters in the unit's order, zeros for
the ones it has no gradient for (see :mod:`paramfsm.engine.schedule.grad_order`), so
the ranks stay paired and the result is plain torch's: the expert no rank
used keeps ``grad`` None.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from patterns_common import Pair, batch
from torch import nn

import paramfsm
from paramfsm import RankDesync

EXPERTS, DIM = 4, 8


class MoE(nn.Module):
    """A router and a ModuleList of experts; each token goes to the expert its id picks."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(EXPERTS))

    def forward(self, x, ids):
        gate = F.softmax(self.router(x), dim=-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            rows = (ids == i).nonzero().squeeze(-1)
            if rows.numel():  # data-dependent: an expert without tokens is not run at all
                out = out.index_add(0, rows, expert(x[rows]) * gate[rows, i:i + 1])
        return out


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, DIM)
        self.moe = MoE()
        self.out = nn.Linear(DIM, 2)

    def forward(self, x, ids):
        return self.out(torch.tanh(self.moe(self.inp(x), ids)))


def routing(step: int) -> torch.Tensor:
    """Expert ids of the global batch (4 rows per rank): expert 2 only in rank 0's rows, expert 3 nowhere."""
    first = [0, 1, 2, 2] if step % 2 == 0 else [2, 0, 0, 1]
    return torch.tensor(first + [1, 0, 1, 0])


def moe_job(rank, world):
    torch.manual_seed(0)
    pair = Pair(Net(), rank, world, units=[MoE])
    unused = []
    for step in range(3):
        (x,) = batch(step, world, 4, (4,))
        ids = routing(step)
        out, ref_out = pair.model(pair.local(x), pair.local(ids)), pair.ref.model(x, ids)
        pair.zero_grad()
        out.pow(2).mean().backward()
        ref_out.pow(2).mean().backward()
        pair.check_grads(f"step {step}")
        unused.append((pair.rt.full_grad("moe.experts.3.weight"), pair.ref.model.moe.experts[3].weight.grad))
        pair.step(f"step {step}")
    report = pair.finish()
    report["unused"] = unused
    report["units"] = [u.name for u in pair.rt.units]
    return report


def test_moe_one_unit_trains_like_plain_torch(ranks2):
    """Expert 2 has tokens on rank 0 only: both ranks still send its gradient (zeros on rank 1) and
    gradients and parameters equal plain torch; expert 3, used by no rank, keeps grad None."""
    for report in ranks2.run(moe_job):
        assert report["units"] == ["<root>", "moe"], report["units"]
        assert all(got is None and want is None for got, want in report["unused"]), report["unused"]
        assert report["checks"] == 6


def moe_no_sync_job(rank, world):
    """Two micro-batches per step, the first under rt.no_sync(): the ranks keep different sets of expert
    gradients (expert 2 only on rank 0), and the synchronising backward still pairs every unit's
    reduce-scatter, the kept sums folded in."""
    torch.manual_seed(0)
    pair = Pair(Net(), rank, world, units=[MoE])
    rt = pair.rt
    for step in range(2):
        pair.zero_grad()
        for micro in range(2):
            (x,) = batch(10 * step + micro, world, 4, (4,))
            ids = routing(step + micro)
            out, ref_out = pair.model(pair.local(x), pair.local(ids)), pair.ref.model(x, ids)
            if micro == 0:
                with rt.no_sync():
                    out.pow(2).mean().backward()
            else:
                out.pow(2).mean().backward()
            ref_out.pow(2).mean().backward()
        pair.check_grads(f"step {step}, two micro-batches")
        pair.step(f"step {step}")
    return pair.finish()


def test_moe_accumulated_under_no_sync_trains_like_plain_torch(ranks2):
    for report in ranks2.run(moe_no_sync_job):
        assert report["checks"] == 4, report


def skipped_expert_job(rank, world):
    torch.manual_seed(0)
    model = Net()
    paramfsm.shard(model, debug=True)  # default units: every expert its own unit
    (x,) = batch(0, world, 4, (4,))
    try:
        model(x[4 * rank:4 * rank + 4], routing(0)[4 * rank:4 * rank + 4]).pow(2).mean().backward()
    except RankDesync as exc:
        return str(exc)
    return "no error"


def test_expert_skipped_across_units_names_the_module_to_merge(ranks2):
    """With every expert its own unit, an expert run on rank 0 only desyncs the ranks' gathers:
    RankDesync on every rank, whose advice names the mixture-of-experts module to make one unit."""
    for message in ranks2.run(skipped_expert_job, timeout=60):
        assert "rank desync" in message, message
        assert "probably 'moe'" in message and "units=lambda name, module: name == 'moe'" in message, message


class CheckpointedMLP(nn.Module):
    """One unit whose layers run under reentrant activation checkpointing, beside a gate that does not:
    the layers' gradients are accumulated by the nested backward the checkpoint runs, after the unit's
    own backward began (see [Note: late gradients] in paramfsm.engine.schedule.grad_order)."""

    def __init__(self):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM))
        self.gate = nn.Linear(DIM, DIM)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(self.mlp, x, use_reentrant=True)
        return h * torch.sigmoid(self.gate(x))


class CheckpointedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, DIM)
        self.block = CheckpointedMLP()
        self.out = nn.Linear(DIM, 2)

    def forward(self, x):
        return self.out(torch.tanh(self.block(self.inp(x))))


def reentrant_inside_unit_job(rank, world, bucket_bytes):
    torch.manual_seed(0)
    options = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
    pair = Pair(CheckpointedNet(), rank, world, units=[CheckpointedMLP], **options)
    grads = []
    for step in range(2):
        (x,) = batch(step, world, 2, (4,))
        pair.zero_grad()
        pair.model(pair.local(x)).pow(2).mean().backward()
        pair.ref.model(x).pow(2).mean().backward()
        grads.append({f"block.{name}": (pair.rt.full_grad(f"block.{name}"), p.grad)
                      for name, p in pair.ref.model.block.mlp.named_parameters(prefix="mlp")})
        pair.check_grads(f"step {step}")
        pair.step(f"step {step}")
    report = pair.finish()
    report["units"] = [u.name for u in pair.rt.units]
    report["grads"] = grads
    return report


# None (the default bucket_bytes): the zero-filled and the late gradient of a checkpointed parameter meet in
# one pending reduce bucket; 256: they go out in separate buckets.
@pytest.mark.parametrize("bucket_bytes", [256, None])
def test_reentrant_checkpointing_inside_a_unit_keeps_its_gradients(ranks2, bucket_bytes):
    """``torch.utils.checkpoint.checkpoint(..., use_reentrant=True)`` inside one unit: the checkpointed
    layers' gradients arrive in a nested backward, after the unit counted them missing, and still reach
    ``rt.full_grad`` and the step exactly as in plain torch (not zeros)."""
    for report in ranks2.run(reentrant_inside_unit_job, bucket_bytes):
        assert report["units"] == ["<root>", "block"], report["units"]
        for step in report["grads"]:
            for name, (got, want) in step.items():
                assert got is not None and want.abs().max() > 0, name
                assert torch.allclose(got, want, atol=1e-6, rtol=1e-5), (name, (got - want).abs().max())
        assert report["checks"] == 4, report
