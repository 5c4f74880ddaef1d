"""Reads outside a unit (:mod:`paramfsm.engine.schedule.on_demand`) on one rank in the test process.

A forward that reads another unit's parameter gets it gathered on demand and credited to the
innermost unit running (not the root around it), with one ``ReadOutsideUnit`` warning per
parameter and reader that points at the reading line and names the ``units=`` that avoids it.
The reading unit then holds the parameter: it is released with that unit, training equals
plain torch, and outside any forward or backward the read is ``NotGathered`` again.
"""

from __future__ import annotations

import copy
import os
import warnings

import pytest
import reading_models
import torch
import torch.nn.functional as F
from one_rank import one_rank  # noqa: F401  (fixture)
from reading_models import DIM, READ_LINE, Block, Reader
from torch import nn

import paramfsm
from paramfsm import NotGathered, State
from paramfsm.engine.schedule.on_demand import ReadOutsideUnit, suggest_units
from paramfsm.engine.storage.units import owner_unit, select_unit_modules

OWN = "any(True for _ in module.parameters(recurse=False))"
#: Mutation testing calls every mutated function through a trampoline, frames that ``stacklevel`` does not
#: count: where a warning points is checked in plain test runs only.
PLAIN_RUN = "MUTANT_UNDER_TEST" not in os.environ


def _batch(step: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(step))


def _train(model, ref, rt, steps: int = 2):
    """SGD steps of the sharded model and of plain torch; the largest gradient and parameter differences."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    grad_err = param_err = 0.0
    for step in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        model(_batch(step)).pow(2).mean().backward()
        ref(_batch(step)).pow(2).mean().backward()
        for name, p in ref.named_parameters():
            grad_err = max(grad_err, (rt.full_grad(name) - p.grad).abs().max().item())
        opt.step()
        ref_opt.step()
        assert set(rt.states().values()) == {State.NOT_AVAILABLE}, rt.states()
    for name, p in ref.named_parameters():
        param_err = max(param_err, (rt.full_param(name) - p).abs().max().item())
    return grad_err, param_err


def _told(caught) -> list:
    return [w for w in caught if issubclass(w.category, ReadOutsideUnit)]


def test_a_read_is_credited_to_the_innermost_running_unit(one_rank):
    torch.manual_seed(0)
    model = Reader()
    ref = copy.deepcopy(model)
    rt = paramfsm.shard(model, min_unit_bytes=0)
    at_out = []
    model.out.register_forward_pre_hook(lambda module, args: at_out.append(rt.state("block.proj.weight")))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grad_err, param_err = _train(model, ref, rt)
    told = _told(caught)
    assert [str(w.message).split("'")[1] for w in told] == ["block.proj.weight", "block.proj.bias"], "once each"
    assert str(told[0].message) == (
        "parameter 'block.proj.weight' (unit 'block.proj') was read by the forward or backward of unit 'block' "
        "outside its own unit; paramfsm gathered it on demand (one extra all-gather, once) and gathers it with "
        "'block' from now on. Faster and simpler: make them one unit, e.g. paramfsm.shard(model, "
        f"units=lambda name, module: name not in ('block.proj',) and {OWN}) "
        "(written for the default units; adapt it to yours).")
    if PLAIN_RUN:
        at = {(w.filename, w.lineno) for w in told}
        assert at == {(reading_models.__file__, READ_LINE)}, f"it points at the reading line: {at}"
    assert [u.name for u in rt.record("block.proj.weight").units] == ["block.proj", "block"]
    block = next(u for u in rt.units if u.name == "block")
    assert [r.name for r in block.records] == ["block.gain", "block.proj.weight", "block.proj.bias"]
    assert block.nbytes == (DIM + DIM * DIM + DIM) * 4, "the borrowed parameters count in its size"
    assert at_out == [State.NOT_AVAILABLE] * 2, "released with the unit that read it"
    assert grad_err <= 1e-6 and param_err <= 1e-6, (grad_err, param_err)
    rt.close()


class TiedHead(nn.Module):
    """An output layer tied to the embedding through ``F.linear`` in the root's own forward."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(12, DIM)
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, tokens):
        return F.linear(torch.tanh(self.lin(self.emb(tokens))), self.emb.weight)


class KeywordBlock(Block):
    """Reads its child's weight and bias as keyword arguments."""

    def forward(self, x):
        return torch.tanh(F.linear(x, weight=self.proj.weight, bias=self.proj.bias)) * self.gain


def test_a_read_passing_the_parameters_by_keyword_is_gathered_on_demand(one_rank):
    torch.manual_seed(0)
    model = Reader()
    model.block = KeywordBlock()
    ref = copy.deepcopy(model)
    rt = paramfsm.shard(model, min_unit_bytes=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grad_err, param_err = _train(model, ref, rt)
    assert len(_told(caught)) == 2 and grad_err <= 1e-6 and param_err <= 1e-6, (grad_err, param_err)
    rt.close()


def test_the_root_reading_a_tied_weight_trains_like_plain_torch_and_outside_a_forward_it_is_not_gathered(one_rank):
    torch.manual_seed(0)
    model = TiedHead()
    ref = copy.deepcopy(model)
    rt = paramfsm.shard(model, min_unit_bytes=0)
    tokens = [torch.randint(0, 12, (2, 5), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for tok in tokens:
            for m, o in ((model, opt), (ref, ref_opt)):
                o.zero_grad()
                F.cross_entropy(m(tok).reshape(-1, 12), tok.reshape(-1)).backward()
                o.step()
            assert set(rt.states().values()) == {State.NOT_AVAILABLE}
    told = [str(w.message) for w in _told(caught)]
    assert len(told) == 1 and "parameter 'emb.weight' (unit 'emb') was read by the forward or backward of " \
        "unit '<root>' outside its own unit" in told[0], told
    assert f"units=lambda name, module: name not in ('emb',) and {OWN})" in told[0], told[0]
    assert [u.name for u in rt.record("emb.weight").units] == ["emb", "<root>"]
    assert (rt.full_param("emb.weight") - ref.emb.weight).abs().max().item() <= 1e-6
    with pytest.raises(NotGathered) as info:
        F.linear(torch.ones(1, DIM), model.emb.weight)
    assert (info.value.param, info.value.op) == ("emb.weight", "linear")
    rt.close()


class ScaleInBackward(torch.autograd.Function):
    """Identity forward; backward scales by the sum of another module's parameter, read right there."""

    @staticmethod
    def forward(ctx, x, other):
        ctx.other = other
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.other.scale.detach().sum(), None


class Scaler(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.tensor([0.5, 1.5]))

    def forward(self, x):
        return x * self.scale.sum()


class Mid(nn.Module):
    """Its backward is open while the function's backward runs: ``gain``'s gradient comes after."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.0, 4))

    def forward(self, x, scaler):
        return ScaleInBackward.apply(x * self.gain, scaler)


class BackwardReader(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.scaler = Scaler()
        self.mid = Mid()
        self.last = nn.Linear(4, 2)

    def forward(self, x):
        return self.last(self.mid(self.first(self.scaler(x)), self.scaler))


def test_a_read_in_backward_is_credited_to_the_unit_whose_backward_runs(one_rank):
    """No forward runs in backward: the reader is the unit whose backward began last and has not ended."""
    torch.manual_seed(0)
    model = BackwardReader()
    ref = copy.deepcopy(model)
    rt = paramfsm.shard(model, units=[nn.Linear, Scaler, Mid])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        grad_err, param_err = _train(model, ref, rt)
    told = [str(w.message) for w in _told(caught)]
    assert len(told) == 1 and "'scaler.scale' (unit 'scaler') was read by the forward or backward of unit " \
        "'mid'" in told[0], told
    assert grad_err <= 1e-6 and param_err <= 1e-6, (grad_err, param_err)
    rt.close()


@pytest.mark.parametrize("owner, reader, expected", [
    ("emb", "", f"lambda name, module: name not in ('emb',) and {OWN}"),
    ("a.b.c", "", f"lambda name, module: name not in ('a', 'a.b', 'a.b.c') and {OWN}"),
    ("block.proj", "block", f"lambda name, module: name not in ('block.proj',) and {OWN}"),
    ("a.b.c", "a", f"lambda name, module: name not in ('a.b', 'a.b.c') and {OWN}"),
    ("enc.x.w", "enc.y", f"lambda name, module: name == 'enc' or (not name.startswith('enc.') and {OWN})"),
    ("a.b.x", "a.b.y", f"lambda name, module: name == 'a.b' or (not name.startswith('a.b.') and {OWN})"),
    ("ab", "a", "lambda name, module: name == ''"),
    ("x", "y", "lambda name, module: name == ''"),
])
def test_the_suggested_units_name_the_modules_between_owner_and_reader(owner, reader, expected):
    assert suggest_units(owner, reader) == expected


def test_under_the_suggested_units_the_reader_owns_the_parameter():
    """The reader's unit, or for siblings the nearest module enclosing both, gathers the parameter."""
    for owner, reader, param, unit in (("block.proj", "block", "block.proj.weight", "block"),
                                       ("block.proj", "", "block.proj.bias", ""), ("inp", "out", "inp.weight", "")):
        chosen = select_unit_modules(Reader(), eval(suggest_units(owner, reader)))
        assert owner_unit(param, chosen) == unit, (owner, reader, list(chosen))
        assert "out" in chosen or reader == "out", "other modules owning parameters stay units"


def test_after_a_forward_that_raised_a_read_outside_is_not_gathered(one_rank):
    """The failed forward runs no unit any more: reading a parameter then raises ``NotGathered`` (it was
    gathered on demand for the root, which the runtime still took as running, and left gathered), and the
    next forward trains like plain torch."""
    torch.manual_seed(0)
    model = Reader()
    ref = copy.deepcopy(model)
    rt = paramfsm.shard(model, min_unit_bytes=0)

    def fail(module, args, out):
        raise RuntimeError("the block's output is refused")

    handle = model.block.register_forward_hook(fail)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(RuntimeError, match="refused"):
            model(_batch(0))
        handle.remove()
        with pytest.raises(NotGathered) as info:
            F.linear(torch.ones(1, DIM), model.block.proj.weight)
        assert info.value.param == "block.proj.weight"
        assert set(rt.states().values()) == {State.NOT_AVAILABLE}
        grad_err, param_err = _train(model, ref, rt)
    assert grad_err <= 1e-6 and param_err <= 1e-6, (grad_err, param_err)
    rt.close()
