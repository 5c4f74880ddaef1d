"""Models that read parameters outside their unit, on 2 gloo ranks, compared with plain torch.

A parent whose forward reads a child's weight (an output layer tied through
``F.linear(h, self.emb.weight)``) and ``nn.MultiheadAttention`` (which reads
``out_proj.weight`` itself) train like plain torch: the torch.nn modules that
read their children's parameters are one unit by default, and any other read
outside a unit is gathered on demand for the reading unit (see
:mod:`paramfsm.engine.schedule.on_demand`), with a one-time warning that names the fix.
Outside any forward or backward, ``NotGathered`` names the parameter touched.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from patterns_common import Pair, batch, reduces_by_task
from torch import nn

from paramfsm import NotGathered, State
from paramfsm.engine.schedule.on_demand import ReadOutsideUnit

VOCAB, SEQ = 12, 5


class TiedHead(nn.Module):
    """An embedding, a layer, and an output layer tied to the embedding through F.linear in the root."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, dim)
        self.lin = nn.Linear(dim, dim)

    def forward(self, tokens):
        return F.linear(torch.tanh(self.lin(self.emb(tokens))), self.emb.weight)


def tokens(step: int, world: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2 * world, SEQ), generator=torch.Generator().manual_seed(step))


def tied_head_job(rank, world, retain):
    torch.manual_seed(0)
    pair = Pair(TiedHead(), rank, world, retain=retain, min_unit_bytes=0)  # tiny: no merging, emb stays a unit
    model, ref, rt = pair.model, pair.ref.model, pair.rt
    reduces = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            tok = tokens(step, world)
            out, ref_out = model(pair.local(tok)), ref(tok)
            losses = [F.cross_entropy(out.reshape(-1, VOCAB), pair.local(tok).reshape(-1)), out.tanh().mean()]
            ref_losses = [F.cross_entropy(ref_out.reshape(-1, VOCAB), tok.reshape(-1)), ref_out.tanh().mean()]
            for i in range(2):  # two losses over one graph: the first backward keeps it
                pair.zero_grad()
                first = len(rt.trace)
                losses[i].backward(retain_graph=i == 0)
                ref_losses[i].backward(retain_graph=i == 0)
                reduces.append(reduces_by_task(rt.trace.records[first:], "emb.weight"))
                pair.check_grads(f"step {step} backward {i}")
            pair.step(f"step {step}")
    told = [str(w.message) for w in caught if issubclass(w.category, ReadOutsideUnit)]
    states = set(rt.states().values())
    units = [u.name for u in rt.record("emb.weight").units]
    try:
        F.linear(torch.ones(1, 8), model.emb.weight)
        outside = None
    except NotGathered as exc:
        outside = (exc.param, str(exc))
    report = pair.finish()
    report.update(told=told, states=states, units=units, outside=outside, reduces=reduces)
    return report


@pytest.mark.parametrize("retain", ["defer", "regather"])
def test_parent_reads_child_weight(ranks2, retain):
    """The root's F.linear over the embedding's weight is gathered on demand, once, and then borrowed:
    gradients and parameters equal plain torch through a retained two-loss backward, the weight's
    gradient is reduce-scattered once per backward, and everything is released at rest."""
    for report in ranks2.run(tied_head_job, retain):
        assert report["units"] == ["emb", "<root>"], report["units"]
        assert len(report["told"]) == 1, report["told"]
        assert "'emb.weight'" in report["told"][0] and "'<root>'" in report["told"][0], report["told"][0]
        assert "units=lambda name, module: name not in ('emb',)" in report["told"][0], report["told"][0]
        assert report["states"] == {State.NOT_AVAILABLE}, report["states"]
        assert all(list(r.values()) == [1] for r in report["reduces"]), report["reduces"]
        name, message = report["outside"]
        assert name == "emb.weight" and "linear" in message


class Attention(nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.layer = nn.TransformerEncoderLayer(dim, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.out = nn.Linear(dim, 3)

    def forward(self, x):
        a, _ = self.attn(x, x, x)
        return self.out(self.layer(a))


def attention_job(rank, world, units):
    torch.manual_seed(0)
    # min_unit_bytes=0: the modules are tiny, and the point is which ones are units before any merging.
    pair = Pair(Attention(), rank, world, **({"min_unit_bytes": 0} if units is None else {"units": units}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            (x,) = batch(step, world, 2, (SEQ, 8))
            out, ref_out = pair.model(pair.local(x)), pair.ref.model(x)
            pair.zero_grad()
            out.pow(2).mean().backward()
            ref_out.pow(2).mean().backward()
            pair.check_grads(f"step {step}")
            pair.step(f"step {step}")
    report = pair.finish()
    report["units"] = [u.name for u in pair.rt.units]
    report["told"] = sorted({str(w.message).split("'")[1] for w in caught if issubclass(w.category, ReadOutsideUnit)})
    return report


def own_parameters(name, module):
    return any(True for _ in module.parameters(recurse=False))


def test_attention_default_units(ranks2):
    """nn.MultiheadAttention and nn.TransformerEncoderLayer are one unit each by default: no read
    outside a unit, and the same numbers as plain torch."""
    report = ranks2.run(attention_job, None)[0]
    assert report["units"] == ["<root>", "attn", "layer", "out"], report["units"]
    assert report["told"] == []


def test_attention_children_as_units_gather_on_demand(ranks2):
    """With every module owning parameters a unit (attention's out_proj on its own), the parameters the
    attention reads itself are gathered on demand, named in the warning, and training equals plain torch."""
    report = ranks2.run(attention_job, own_parameters)[0]
    assert "attn.out_proj" in report["units"]
    assert report["told"] == ["attn.out_proj.bias", "attn.out_proj.weight", "layer.self_attn.out_proj.bias",
                              "layer.self_attn.out_proj.weight"], report["told"]
