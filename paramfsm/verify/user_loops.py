"""What the user-loop ops do, in one place for paramfsm, the plain-torch reference and saved reproductions.

The runner (:mod:`paramfsm.verify.runner`), the mirror
(:mod:`paramfsm.verify.mirror`) and the lines of a reproduction script call
the same functions here, so an op means the same on both sides by
construction:

* :func:`record_inputs`: the inputs each module gets during one forward
  (the saved activations a :class:`~paramfsm.verify.ops.SubForward` runs a
  unit on again);
* :func:`detached`, :func:`in_place_on_view`: a sub-forward's variations;
* :func:`tensors` and :func:`tree_loss`: the floating-point tensors of any
  output container (a plain dataclass, a namedtuple, nested dicts, lists and
  tuples) and the losses built from them;
* :func:`write`: the in-place write of a :class:`~paramfsm.verify.ops.GatheredWrite`;
* :func:`chosen`: the output a :class:`~paramfsm.verify.ops.RankLoss` reads on a rank (or rank slice);
* :func:`interrupt`: the backward an :class:`~paramfsm.verify.ops.Interrupted` op breaks off;
* :func:`parameter_sources`: which parameters a saved activation depends on
  (the probe's input to the normaliser's staleness tracking).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn

import paramfsm.optim
from paramfsm.verify.verdicts import Failed

#: The in-place op a SubForward with ``view=True`` applies to a view of the unit's output.
VIEW_OFFSET = 0.5
#: ``GatheredWrite.variant`` -> the write: 0 ``p.mul_(0.5)``, 1 ``p.add_(0.01)``, 2 (``RANK_WRITE``) the first
#: element plus a value that differs by rank.
WRITES = ("mul_(0.5)", "add_(0.01)", "view(-1)[:1].add_(0.01 * (rank + 1))")
#: The name of the module an :class:`~paramfsm.verify.ops.Attach` adds.
ATTACHED = "attached"


@contextlib.contextmanager
def record_inputs(model: nn.Module):
    """Within the block, every module's first ``(args, kwargs)`` of the forward, by qualified name (yielded)."""
    saved: dict = {}
    handles = []

    def hook_for(name):
        def hook(module, args, kwargs):
            saved.setdefault(name, (args, kwargs))
        return hook

    try:
        for name, module in model.named_modules():
            if name:
                handles.append(module.register_forward_pre_hook(hook_for(name), with_kwargs=True))
        yield saved
    finally:
        for handle in handles:
            handle.remove()


def _map(fn, tree):
    """``tree`` with ``fn`` applied to every tensor, through tuples, lists, dicts, namedtuples and dataclasses."""
    if isinstance(tree, torch.Tensor):
        return fn(tree)
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):
        return type(tree)(*(_map(fn, t) for t in tree))
    if isinstance(tree, (tuple, list)):
        return type(tree)(_map(fn, t) for t in tree)
    if isinstance(tree, dict):
        return type(tree)((k, _map(fn, v)) for k, v in tree.items())
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        return dataclasses.replace(tree, **{f.name: _map(fn, getattr(tree, f.name))
                                            for f in dataclasses.fields(tree) if f.init})
    return tree


def tensors(tree) -> list[torch.Tensor]:
    """Every floating-point tensor of an output, in order (dataclass fields, namedtuple and dict entries...)."""
    found: list[torch.Tensor] = []
    _map(lambda t: found.append(t) if t.is_floating_point() else None, tree)
    return found


def detached(saved):
    """Saved ``(args, kwargs)`` with every tensor detached (the new graph starts at the unit)."""
    return _map(lambda t: t.detach(), saved)


def in_place_on_view(out) -> None:
    """``h = out[...]; h += 0.5`` on the unit's first floating-point output (an in-place op on a view)."""
    view = tensors(out)[0][...]
    view += VIEW_OFFSET


def sub_forward(module: nn.Module, saved, detach: bool, view: bool):
    """The unit run again on saved inputs (see :class:`~paramfsm.verify.ops.SubForward`)."""
    args, kwargs = detached(saved) if detach else saved
    out = module(*args, **kwargs)
    if view:
        in_place_on_view(out)
    return out


def tree_loss(variant: int, out) -> torch.Tensor:
    """Loss variant 3 (sum of mean squares) or 4 (sum of mean tanh) over an output's floating-point tensors."""
    parts = [t.float().pow(2).mean() if variant == 3 else t.float().tanh().mean() for t in tensors(out)]
    return torch.stack(parts).sum()


def write(param: torch.Tensor, variant: int, rank: int = 0) -> None:
    """The in-place write of a GatheredWrite on rank ``rank`` (call it under ``torch.no_grad()``)."""
    if variant == 0:
        param.mul_(0.5)
    elif variant == 1:
        param.add_(0.01)
    else:
        param.view(-1)[:1].add_(0.01 * (rank + 1))


def attach(model: nn.Module, module: str) -> None:
    """An :class:`~paramfsm.verify.ops.Attach`: a module with its parameters in a child, added to ``module``."""
    model.get_submodule(module).add_module(ATTACHED, nn.Sequential(nn.Linear(2, 2)))


def attach_and_run(model: nn.Module, op, x) -> None:
    """An :class:`~paramfsm.verify.ops.Attach` on the sharded model: attach, then a forward of ``x`` that every
    rank must refuse."""
    attach(model, op.module)
    with torch.no_grad():
        model(x)
    not_refused(op)


def not_refused(op) -> None:
    """Raise: ``op`` (a rank-differing gathered write, an attached module's forward) ran on, where every rank
    had to refuse it."""
    what = (f"the ranks wrote different values to '{op.param}' inside rt.gathered(writeback=True), and no rank "
            "raised" if hasattr(op, "param") else
            f"a module with nested parameters was attached to '{op.module}' ("": the root) after "
            "shard(), and the next forward raised no ModelChanged")
    raise Failed("refusal", [what])


def chosen(outs: tuple, rank: int):
    """The entry of ``outs`` a RankLoss reads on rank ``rank`` (plain torch: on rank slice ``rank``)."""
    return outs[rank % len(outs)]


def parameter_sources(tree, names: dict) -> set[str]:
    """The parameters (``id -> name`` in ``names``) whose values a tensor of ``tree`` was computed from."""
    found: set[str] = set()
    seen: set = set()
    stack = [t.grad_fn for t in tensors(tree) if t.grad_fn is not None]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)
        if variable is not None and id(variable) in names:
            found.add(names[id(variable)])
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return found


def view_backward_works(module: nn.Module, saved) -> bool:
    """Whether plain torch can backward through an in-place op on a view of the module's output (not when
    the op that made it saved its output for backward: tanh, softmax, ...)."""
    try:
        out = sub_forward(module, saved, detach=True, view=True)
        loss = tree_loss(3, out)
        if loss.requires_grad:
            loss.backward()
    except RuntimeError:
        return False
    finally:
        module.zero_grad(set_to_none=True)
    return True


class Interruption(RuntimeError):
    """What :class:`Refused` raises in backward: the exception an :class:`~paramfsm.verify.ops.Interrupted` op
    catches."""


class Refused(torch.autograd.Function):
    """The identity, whose backward raises :class:`Interruption` (a user's Function refusing a gradient)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        raise Interruption("a custom autograd.Function raised in backward (an Interrupted op)")


def interrupt(model: nn.Module, module: str, inputs) -> None:
    """The forward and the raising backward of an :class:`~paramfsm.verify.ops.Interrupted` op: ``module``'s
    outputs go through :class:`Refused`; the :class:`Interruption` is caught (the loop then recovers)."""
    def refuse(_module, _args, out):
        return _map(lambda t: Refused.apply(t) if t.requires_grad else t, out)

    handle = model.get_submodule(module).register_forward_hook(refuse)
    try:
        loss = tree_loss(3, model(inputs))
    finally:
        handle.remove()
    try:
        loss.backward()
    except Interruption:
        pass


#: ``decay_lr``'s factor per step.
HOOK_DECAY = 0.9


@contextlib.contextmanager
def write_in_forward(model: nn.Module):
    """Within the block, the next forward of the module owning ``model``'s first parameter halves that parameter
    in place, under ``no_grad``, before computing (once: see :data:`paramfsm.verify.ops.WRITE_MODE`)."""
    name, param = next(iter(model.named_parameters()))
    owner = model.get_submodule(name.rpartition(".")[0])
    fired = []

    def halve(module, args):
        if not fired:
            fired.append(True)
            with torch.no_grad():
                param.mul_(0.5)

    handle = owner.register_forward_pre_hook(halve)
    try:
        yield
    finally:
        handle.remove()


def make_optimizer(subject, config):
    """The optimizer factory of a program: the subject's, Adafactor, or the subject's through a subclass
    (``Config.optimizer``)."""
    if config.optimizer == "adafactor":
        return lambda params: torch.optim.Adafactor(params, lr=0.01)
    if config.optimizer == "subclass":
        return lambda params: through_super(subject.optimizer(params))
    return subject.optimizer


_SUBCLASSES: dict = {}


def through_super(built):
    """The optimizer ``built`` as an instance of a subclass whose ``step`` calls its parent's through
    ``super()`` (a check or a log around the update), built after ``built``: torch has then wrapped both
    classes' ``step`` with its hooks, and the parent's runs inside the subclass's. The subclass is declared
    element-wise (``paramfsm.optim.elementwise``), as a user of such a wrapper declares it."""
    parent = type(built)
    cls = _SUBCLASSES.get(parent)
    if cls is None:
        class Wrapped(parent):
            def step(self, closure=None):
                return super().step(closure)
        Wrapped.__name__ = Wrapped.__qualname__ = f"Wrapped{parent.__name__}"
        cls = _SUBCLASSES[parent] = paramfsm.optim.elementwise(Wrapped)
    return cls(built.param_groups, **built.defaults)


def decay_lr(optimizer, args, kwargs) -> None:
    """A step pre-hook (``Config.step_hooks``): every group's learning rate times :data:`HOOK_DECAY`, once per
    ``step()``, before the update, as in plain torch."""
    for group in optimizer.param_groups:
        group["lr"] *= HOOK_DECAY


def optimizers(subject, model: nn.Module, everything, config) -> list:
    """One optimizer per part of ``Subject(parts=...)``, over the part's parameters; else one over ``everything``;
    built and hooked as ``config`` says."""
    make = make_optimizer(subject, config)
    opts = [make(model.get_submodule(part).parameters()) for part in subject.parts] or [make(everything)]
    if config.step_hooks:
        for opt in opts:
            opt.register_step_pre_hook(decay_lr)
    return opts
