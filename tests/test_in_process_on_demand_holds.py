"""How long a parameter gathered on demand stays gathered (:mod:`paramfsm.engine.schedule.on_demand`), on one rank.

The reading unit borrows the parameter with one hold per holder it has when it reads it: its
running forwards, ``rt.gathered`` blocks and open backwards. So the parameter is released exactly
when the reading unit is: still gathered while a ``with rt.gathered(reader)`` block holds the
reader, free once the block ends. Read in backward, it also keeps the gradient hold until its own
gradient has accumulated, so it is not released and gathered again in between.
"""

from __future__ import annotations

import copy
import warnings

import torch
from one_rank import one_rank  # noqa: F401  (fixture)
from test_in_process_on_demand import BackwardReader, Scaler, _batch, _train
from torch import nn

import paramfsm
from paramfsm import State

SCALE = "scaler.scale"


class SiblingReader(nn.Module):
    """A unit of its own (it owns ``gain``) whose forward reads a sibling's ``scale``, passed in."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 4))

    def forward(self, x, peer):
        return torch.tanh(x * self.gain) * peer.scale.sum()


class Wrap(nn.Module):
    """A unit around the reader: three units run (root, wrap, reader) when the read happens."""

    def __init__(self):
        super().__init__()
        self.shift = nn.Parameter(torch.full((4,), 0.25))
        self.reader = SiblingReader()

    def forward(self, x, peer):
        return self.reader(x, peer) + self.shift


class Nested(nn.Module):
    def __init__(self):
        super().__init__()
        self.scaler = Scaler()
        self.wrap = Wrap()

    def forward(self, x):
        return self.wrap(self.scaler(x), self.scaler)


def test_a_parameter_read_inside_a_gathered_reader_stays_gathered_until_the_block_ends(one_rank):
    """The reader runs inside ``rt.gathered(reader)``, nested in two other units: it holds the parameter
    twice (its forward and the block), once per enclosing unit would be too many or too few."""
    torch.manual_seed(0)
    model = Nested()
    ref = copy.deepcopy(model)
    rt = paramfsm.shard(model, units=[Scaler, Wrap, SiblingReader])
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with rt.gathered(model.wrap.reader, writeback=False):
            out = model(x)
            inside = rt.state(SCALE)
        after = rt.state(SCALE)
        assert torch.allclose(out, ref(x), atol=1e-6)
        assert (inside, after) == (State.AVAILABLE, State.NOT_AVAILABLE), "held with the reader, freed with it"
        grad_err, param_err = _train(model, ref, rt)
    assert grad_err <= 1e-6 and param_err <= 1e-6, (grad_err, param_err)
    rt.close()


def test_a_parameter_read_in_a_backward_inside_a_gathered_reader_stays_gathered_until_the_block_ends(one_rank):
    """Read in ``mid``'s backward while ``rt.gathered(mid)`` holds it: the open backward and the block are
    two holders, so the parameter outlives the backward and is freed when the block ends."""
    torch.manual_seed(0)
    model = BackwardReader()
    ref = copy.deepcopy(model)
    rt = paramfsm.shard(model, units=[nn.Linear, Scaler, type(model.mid)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = model(_batch(0)).pow(2).mean()
        with rt.gathered(model.mid, writeback=False):
            loss.backward()
            inside = rt.state(SCALE)
        after = rt.state(SCALE)
        ref(_batch(0)).pow(2).mean().backward()
    assert (inside, after) == (State.AVAILABLE, State.NOT_AVAILABLE)
    for name, p in ref.named_parameters():
        assert torch.allclose(rt.full_grad(name), p.grad, atol=1e-6), name
    rt.close()


class Probe(torch.autograd.Function):
    """Identity; its backward reports the parameter's state between ``mid``'s backward and ``first``'s."""

    @staticmethod
    def forward(ctx, x, report):
        ctx.report = report
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.report()
        return grad, None


class ProbedReader(BackwardReader):
    def __init__(self, report):
        super().__init__()
        self.report = report

    def forward(self, x):
        return self.last(self.mid(Probe.apply(self.first(self.scaler(x)), self.report), self.scaler))


def test_a_parameter_read_in_backward_stays_gathered_until_its_own_gradient(one_rank):
    """``mid``'s backward reads ``scaler.scale``, whose gradient comes later (``scaler`` ran first): the read
    takes the gradient hold, so between the two backwards it is not released and gathered again."""
    seen = []
    torch.manual_seed(0)
    model = ProbedReader(lambda: seen.append(rt.state(SCALE)))
    ref = BackwardReader()
    ref.load_state_dict(model.state_dict())
    rt = paramfsm.shard(model, units=[nn.Linear, Scaler, type(model.mid)])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        grad_err, param_err = _train(model, ref, rt)
    assert seen == [State.AVAILABLE, State.AVAILABLE], "the first backward (the read) and the next alike"
    assert grad_err <= 1e-6 and param_err <= 1e-6, (grad_err, param_err)
    rt.close()
