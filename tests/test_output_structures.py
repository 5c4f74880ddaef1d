"""Whatever structure a unit returns, its backward finds its parameters gathered: 2 gloo ranks against plain torch.

A unit's forward hook hooks the autograd nodes of the tensors in its output, so
its parameters are gathered before its backward runs. These cases once missed
them and crashed in backward with a raw shape error: a dataclass (a leaf to
``torch.utils._pytree``), an ``OrderedDict`` subclass nobody registered, and a
returned view that the caller modified in place (the in-place op moves the view
onto a new node, so the hooked one never runs). Each case compares the loss,
the full gradients and the parameters after an optimizer step with plain torch
over the global batch; a structure the hooks cannot look inside raises
``UnsupportedOutput`` at the forward, naming the module and the type.
"""

from __future__ import annotations

import collections
import dataclasses
import types
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from patterns_common import Pair, batch
from torch import nn

from paramfsm import ParamFSMError, State, UnsupportedOutput

DIM, PER_RANK = 6, 2


@dataclasses.dataclass
class Out:
    h: torch.Tensor
    aux: Optional[torch.Tensor] = None


@dataclasses.dataclass(frozen=True)
class Inner:
    h: torch.Tensor
    scale: float


@dataclasses.dataclass(frozen=True)
class Frozen:
    tag: str
    count: int
    inner: Inner
    missing: Optional[torch.Tensor]
    info: types.SimpleNamespace  # an object holding no tensor of the graph: nothing to hook, nothing to refuse


Pair2 = collections.namedtuple("Pair2", "h aux")


class Typed(NamedTuple):
    h: torch.Tensor
    step: int


class Outputs(collections.OrderedDict):
    """An OrderedDict subclass registered nowhere, like a Hugging Face ModelOutput without its registration."""


class Holder:
    """An arbitrary object holding an output tensor in an attribute: the hooks cannot look inside it."""

    def __init__(self, h):
        self.h = h


def _model_output(b, h, x):
    from transformers.modeling_outputs import BaseModelOutput

    return BaseModelOutput(last_hidden_state=h, hidden_states=(x, h))


def _add_in_place(o, y):
    o += y
    return o


def _add_to_view(o, y):
    h = o.view(o.shape)
    h += y
    return h


def _add_transposed(o, y):
    o += y.t()
    return o.t()


def _add_to_field(o, y):
    o.h += y
    return o.h + o.aux


#: case -> (how a Block packs its result h (given itself and its input x), how the caller unpacks it with the
#: target y)
PACKS = {
    "dataclass": (lambda b, h, x: Out(h, h * 2), lambda o, y: o.h + o.aux),
    "frozen_dataclass": (lambda b, h, x: Frozen("t", 3, Inner(h, 0.5), None, types.SimpleNamespace(n=1, name="x")),
                         lambda o, y: o.inner.h * o.inner.scale),
    "namedtuple": (lambda b, h, x: Pair2(h, h.sin()), lambda o, y: o.h * o.aux),
    "typed_namedtuple": (lambda b, h, x: Typed(h, 4), lambda o, y: o.h * o.step),
    "nested": (lambda b, h, x: {"a": [h, (1, "s", None)], "b": (Out(x @ b.w),), "c": {"d": [Pair2(h, None)]}},
               lambda o, y: o["a"][0] + o["b"][0].h + o["c"]["d"][0].h),
    "model_output": (_model_output, lambda o, y: o.last_hidden_state + o.hidden_states[1]),
    "ordered_dict_subclass": (lambda b, h, x: Outputs(h=h, aux=h.exp()), lambda o, y: o["h"] - o["aux"]),
    "view_in_place": (lambda b, h, x: h.unsqueeze(0).squeeze(0), _add_in_place),
    "reshaped_view_in_place": (lambda b, h, x: h.view(-1, DIM), _add_in_place),
    "transposed_view_in_place": (lambda b, h, x: h.t(), _add_transposed),
    "view_of_output_in_place": (lambda b, h, x: h, _add_to_view),
    "dataclass_view_in_place": (lambda b, h, x: Out(h.view(-1, DIM), h * 3), _add_to_field),
    "aux_never_reaches_loss": (lambda b, h, x: Out(h, h.square()), lambda o, y: o.h),
    "untraversable": (lambda b, h, x: Holder(h), lambda o, y: o.h),
}


class Block(nn.Module):
    """Owns a weight itself (so it is a unit) besides a Linear (a unit of its own); ``pack`` shapes its output."""

    def __init__(self, pack):
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.w = nn.Parameter(torch.randn(DIM, DIM) / DIM ** 0.5)
        self.pack = pack

    def forward(self, x):
        return self.pack(self, torch.tanh(self.lin(x)) @ self.w, x)


class Net(nn.Module):
    """inp -> Block -> head; the Block's input is the inp unit's output (a chain of units)."""

    def __init__(self, case):
        super().__init__()
        pack, self.unpack = PACKS[case]
        self.inp, self.block, self.head = nn.Linear(DIM, DIM), Block(pack), nn.Linear(DIM, DIM)

    def forward(self, x, y):
        return self.head(self.unpack(self.block(self.inp(x)), y))


class ViewBlock(nn.Module):
    """A unit returning a view of what it computed; ``x + bias`` saves nothing, so its input may change later."""

    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(DIM))

    def forward(self, x):
        return (x + self.bias).view(-1, DIM)


class ViewChain(nn.Module):
    """Units returning views, one after the other, with in-place ops between them and after them."""

    def __init__(self, when):
        super().__init__()
        self.inp = nn.Linear(DIM, DIM)
        self.blocks = nn.ModuleList(ViewBlock() for _ in range(3))
        self.when = when

    def forward(self, x, y):
        h = self.inp(x)
        if self.when == "between":
            for block in self.blocks:
                h = block(h)
                h += y
            return h
        a = self.blocks[0](h)
        b = self.blocks[1](a)  # the second unit's post-backward rides on the first one's hook
        a += y  # the first unit's output view moves onto a new node after the second unit consumed it
        c = self.blocks[2](b)
        c *= 2
        return a + c


class FrozenViewBlock(ViewBlock):
    """A :class:`ViewBlock` with a frozen weight its backward needs (for the gradient of its input)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(DIM, DIM) / DIM ** 0.5, requires_grad=False)

    def forward(self, x):
        return (x @ self.w + self.bias).view(-1, DIM)


class Reused(nn.Module):
    """One unit returning a view, called twice in a chain.

    Its output view and that view's base both run in each backward; the second call's post-backward rides on
    the first call's hook and must come once, or the frozen weight (held by the unit alone, with no gradient
    to wait for) is released under the first call's backward.
    """

    def __init__(self):
        super().__init__()
        self.inp, self.block = nn.Linear(DIM, DIM), FrozenViewBlock()

    def forward(self, x, y):
        h = self.block(self.block(self.inp(x)))
        h += y
        return h


class Unused(nn.Module):
    """A unit called in the forward whose output never reaches the loss."""

    def __init__(self):
        super().__init__()
        self.inp, self.side, self.head = nn.Linear(DIM, DIM), Block(PACKS["dataclass"][0]), nn.Linear(DIM, DIM)

    def forward(self, x, y):
        h = self.inp(x)
        self.side(h)
        return self.head(h)


def _build(case):
    torch.manual_seed(0)
    if case.startswith("chain_"):
        return ViewChain(case[len("chain_"):])
    if case == "unit_never_reaches_loss":
        return Unused()
    if case == "reused_view_unit":
        return Reused()
    return Net(case)


def _global_loss(loss, world):
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total / world


def _train(pair, case, steps=2):
    """Forward, backward and step on both sides; losses, gradients and parameters must agree."""
    world = pair.world
    for step in range(steps):
        x, y = batch(step, world, PER_RANK, (DIM,), (DIM,))
        pair.zero_grad()
        loss = F.mse_loss(pair.model(pair.local(x), pair.local(y)), pair.local(y))
        ref_loss = F.mse_loss(pair.ref.model(x, y), y)
        loss.backward()
        ref_loss.backward()
        got = _global_loss(loss, world)
        assert torch.allclose(got, ref_loss, atol=1e-6), f"{case} step {step}: loss {got} != {ref_loss}"
        pair.check_grads(f"{case} step {step}")
        pair.step(f"{case} step {step}")
        pair.assert_states(State.NOT_AVAILABLE, what=f"{case} step {step}")
    pair.finish()


def cases_job(rank, world, cases):
    """Run every case; a failure is reported by name so one run shows all of them."""
    failures = {}
    for case in cases:
        pair = Pair(_build(case), rank, world)
        try:
            _train(pair, case)
        except Exception as exc:  # noqa: BLE001 - reported to the test, which fails on it
            failures[case] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
            pair.rt.detach()
    return failures


def _run(ranks2, cases):
    for rank, failures in enumerate(ranks2.run(cases_job, cases)):
        assert failures == {}, f"rank {rank}: {failures}"


def test_dataclass_outputs_train_like_plain_torch(ranks2):
    """A dataclass, and a frozen one nesting another with ints, strings, None and a plain object beside it."""
    _run(ranks2, ["dataclass", "frozen_dataclass"])


def test_container_outputs_train_like_plain_torch(ranks2):
    """Namedtuples, nested lists/tuples/dicts holding a dataclass, a ModelOutput and an OrderedDict subclass."""
    _run(ranks2, ["namedtuple", "typed_namedtuple", "nested", "model_output", "ordered_dict_subclass"])


def test_in_place_ops_on_output_views_train_like_plain_torch(ranks2):
    """A unit returning a view (squeeze, view, transpose, in a dataclass) that the caller modifies in place,
    an in-place op on a view of a plain output, and views along a chain of units (one unit twice)."""
    _run(ranks2, ["view_in_place", "reshaped_view_in_place", "transposed_view_in_place", "view_of_output_in_place",
                  "dataclass_view_in_place", "chain_between", "chain_after_consumed", "reused_view_unit"])


def test_outputs_that_never_reach_the_loss(ranks2):
    """A dataclass field no loss uses, and a whole unit's output no loss uses."""
    _run(ranks2, ["aux_never_reaches_loss", "unit_never_reaches_loss"])


def retained_job(rank, world):
    """Two losses over one dataclass output, the first backward keeping the graph."""
    pair = Pair(_build("dataclass"), rank, world)
    for step in range(2):
        x, y = batch(step, world, PER_RANK, (DIM,), (DIM,))
        pair.zero_grad()
        sides = []
        for model, xs, ys in ((pair.model, pair.local(x), pair.local(y)), (pair.ref.model, x, y)):
            out = model.block(model.inp(xs))
            sides.append((F.mse_loss(model.head(out.h), ys), out.aux.square().mean()))
        (l1, l2), (r1, r2) = sides
        l1.backward(retain_graph=True)
        r1.backward(retain_graph=True)
        assert torch.allclose(_global_loss(l1, world), r1, atol=1e-6)
        pair.check_grads(f"step {step} first loss")
        pair.assert_states(State.NOT_AVAILABLE, State.DEFERRED_RELEASE, what=f"step {step} between")
        l2.backward()
        r2.backward()
        assert torch.allclose(_global_loss(l2, world), r2, atol=1e-6)
        pair.check_grads(f"step {step} both losses")
        pair.step(f"step {step}")
        pair.assert_states(State.NOT_AVAILABLE, what=f"step {step} after")
    return pair.finish()


def test_retained_graph_two_losses_over_a_dataclass_output(ranks2):
    for report in ranks2.run(retained_job):
        assert report["checks"] == 6


def untraversable_job(rank, world):
    """The forward raises, the unit is released, and the next forward with a plain output trains."""
    pair = Pair(_build("untraversable"), rank, world)
    x, y = batch(0, world, PER_RANK, (DIM,), (DIM,))
    try:
        pair.model(pair.local(x), pair.local(y))
    except ParamFSMError as exc:
        raised = (type(exc).__name__, str(exc), exc.module, exc.type_name)
    else:
        pair.rt.detach()
        return None, None
    states = set(pair.rt.states().values())
    for model in (pair.model, pair.ref.model):
        model.block.pack, model.unpack = PACKS["dataclass"]
    pair.zero_grad()
    F.mse_loss(pair.model(pair.local(x), pair.local(y)), pair.local(y)).backward()
    F.mse_loss(pair.ref.model(x, y), y).backward()
    pair.check_grads("after the refused forward")
    pair.rt.close()
    return raised, states


def test_an_untraversable_output_raises_at_the_forward(ranks2):
    for raised, states in ranks2.run(untraversable_job):
        assert raised is not None, "the forward returned an object holding graph tensors without raising"
        name, message, module, type_name = raised
        assert name == UnsupportedOutput.__name__
        assert (module, type_name) == ("block", "Holder")
        assert "'block'" in message and "Holder" in message and "dataclass" in message
        assert "torch.utils._pytree" in message
        assert states == {State.NOT_AVAILABLE}
