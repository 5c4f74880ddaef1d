"""The model under verification and how a factory describes it.

A *factory* is a callable with no arguments, named on the command line as
``MODULE:FACTORY``. It returns either a :class:`Subject` or a tuple
``(model, make_batch, loss_fn)``:

``model``
    an ``nn.Module`` with floating-point parameters, called as
    ``model(inputs)``. It must be deterministic in training mode (no dropout)
    and must not couple the samples of a batch (no BatchNorm in training
    mode), because each rank sees a slice of the batch and the reference
    sees every slice.
``make_batch(generator, n)``
    returns ``(inputs, targets)``: tensors, or tuples of tensors, whose first
    dimension is ``n``, drawn from ``generator`` only (every rank must draw
    the same global batch).
``loss_fn(output, targets)``
    a scalar loss for one slice of the batch.

The factory runs once per rank after ``torch.manual_seed(seed)``, so the
parameters it creates are identical everywhere. It may build its parameters
randomly, but only from torch's global generator.

A factory that cannot be imported or called, or that returns something else,
raises :class:`FactoryError`: one line naming the factory, the exception and
the user's own source line, for ``paramfsm verify`` to print instead of a
traceback.
"""

from __future__ import annotations

import importlib
import sys
import sysconfig
import traceback
from pathlib import Path
from typing import Any, Callable

import attrs
import torch
from torch import nn


def sgd(params):
    """The default optimizer: element-wise, so the sharded and unsharded updates agree exactly."""
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


@attrs.frozen(slots=True)
class Subject:
    """A model with its batch maker and loss, plus how verification may use it.

    ``units``: the ``units=`` argument of :func:`paramfsm.shard`.
    ``min_unit_bytes``: its ``min_unit_bytes=`` argument (None: ``shard()``'s default, so that
    ``verify`` checks the configuration the user trains with). Each program also draws other unit
    choices (one unit per module, every module merged, ``by_size``: see
    :data:`paramfsm.verify.ops.UNIT_CHOICES`), since a verification model is small enough that the
    default may make it one unit, and lifetimes go wrong between units.
    ``checkpoint``: whether programs may run the whole model under
    ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``.
    ``create_graph``: whether programs may take gradient penalties
    (``torch.autograd.grad(..., create_graph=True)``).
    ``optimizer``: builds an element-wise optimizer from parameters.
    ``atol`` / ``rtol``: comparison tolerances (None: chosen from the parameter dtype).
    ``blocks``: names of the modules programs may run one by one under
    reentrant checkpointing (``checkpoint(block, x, use_reentrant=True)``);
    None: the children of the model's first ``nn.ModuleList``; ``()``: none.
    ``meta``: shard a second build of the model, made on the meta device
    (the factory called under ``torch.device("meta")``) and initialised with
    ``rt.init_weights(init)``; the reference is the eagerly built model
    initialised the same way by plain torch (:func:`for_sharding`).
    ``init``: the ``fn`` of ``init_weights`` (None: every ``reset_parameters()``).
    ``parts``: names of modules that split the parameters between optimizers, one each, built by
    ``optimizer`` over ``model.get_submodule(part).parameters()`` (a GAN's generator and discriminator; the
    last part is the critic of GAN iterations); programs then step and zero one part at a time. Empty: one
    optimizer over every parameter.
    ``offload``: the ``offload=`` argument of :func:`paramfsm.shard` for every program (a
    :class:`paramfsm.Offload` or a per-unit predicate); None: each program's drawn configuration chooses.
    """

    model: nn.Module
    make_batch: Callable[[torch.Generator, int], tuple]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    units: Any = None
    min_unit_bytes: int | None = None
    checkpoint: bool = True
    create_graph: bool = True
    optimizer: Callable = sgd
    atol: float | None = None
    rtol: float | None = None
    blocks: tuple[str, ...] | None = None
    meta: bool = False
    init: Callable | None = None
    parts: tuple[str, ...] = ()
    offload: Any = None

    def tolerances(self) -> tuple[float, float]:
        dtype = next(self.model.parameters()).dtype
        atol, rtol = {torch.float64: (1e-10, 1e-8), torch.float32: (1e-5, 1e-4)}.get(dtype, (1e-2, 1e-2))
        return (self.atol if self.atol is not None else atol), (self.rtol if self.rtol is not None else rtol)


class FactoryError(Exception):
    """The verify factory could not be imported or called, or returned no usable subject.

    ``where`` is the user's source line (``file:line``) the error came from, when one is known.
    """

    def __init__(self, factory, what: str, where: str | None = None):
        self.factory, self.what, self.where = factory, what, where
        super().__init__(f"{_name(factory)}: {what}" + (f" (at {where})" if where else ""))


def _name(factory) -> str:
    return factory if isinstance(factory, str) else getattr(factory, "__qualname__", repr(factory))


def as_subject(value) -> Subject:
    """Accept a Subject, a ``(model, make_batch, loss_fn)`` tuple or a dict of Subject fields; check them."""
    if isinstance(value, dict):
        value = Subject(**value)
    elif isinstance(value, (tuple, list)) and len(value) == 3:
        value = Subject(*value)
    if not isinstance(value, Subject):
        shape = f"a {len(value)}-tuple" if isinstance(value, (tuple, list)) else type(value).__name__
        raise TypeError("a verify factory must return a paramfsm.verify.Subject or a tuple "
                        f"(model, make_batch, loss_fn), not {shape}")
    if not isinstance(value.model, nn.Module):
        raise TypeError(f"the model must be a torch.nn.Module, not {type(value.model).__name__}")
    if not any(p.is_floating_point() for p in value.model.parameters()):
        raise TypeError(f"the model ({type(value.model).__name__}) has no floating-point parameters to shard")
    for field in ("make_batch", "loss_fn", "optimizer"):
        if not callable(getattr(value, field)):
            raise TypeError(f"{field} must be callable, not {type(getattr(value, field)).__name__}")
    return value


def resolve_factory(factory) -> Callable[[], Any]:
    """A factory callable from itself or from a ``"module:attribute"`` string."""
    if callable(factory):
        return factory
    module_name, sep, attr = str(factory).partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"expected MODULE:FACTORY (e.g. mypkg.models:make), not {factory!r}")
    target = importlib.import_module(module_name)
    for part in attr.split("."):
        target = getattr(target, part)
    if not callable(target):
        raise TypeError(f"{factory!r} is not callable")
    return target


def load_subject(factory, seed: int | None = None) -> Subject:
    """Call the factory (after ``torch.manual_seed(seed)`` when given) and return its Subject.

    Raises :class:`FactoryError` when the factory cannot be imported or called, or returns no usable subject.
    """
    if seed is not None:
        torch.manual_seed(seed)
    try:
        make = resolve_factory(factory)
    except Exception as exc:  # noqa: BLE001 - whatever the user's code raises is summarised in one line
        raise FactoryError(factory, describe(exc), user_frame(exc)) from exc
    try:
        return as_subject(make())
    except Exception as exc:  # noqa: BLE001
        raise FactoryError(factory, describe(exc), user_frame(exc) or _defined_at(make)) from exc


def for_sharding(subject: Subject, factory, seed: int) -> tuple[nn.Module | None, Subject]:
    """``(reference model, subject to shard)``: for ``Subject(meta=True)``, the eager model initialised by
    plain torch (after ``torch.manual_seed(seed)``) and the subject with a model built on meta; else
    ``(None, subject)``. Shard the second, then :func:`initialise` it."""
    if not subject.meta:
        return None, subject
    torch.manual_seed(seed)
    with torch.no_grad():
        if subject.init is None:
            for module in subject.model.modules():
                if callable(getattr(module, "reset_parameters", None)):
                    module.reset_parameters()
        else:
            subject.model.apply(subject.init)
    with torch.device("meta"):
        built = load_subject(factory)
    return subject.model, attrs.evolve(subject, model=built.model)


def initialise(rt, subject: Subject, seed: int) -> None:
    """``rt.init_weights(subject.init)`` after ``torch.manual_seed(seed)`` for ``Subject(meta=True)``."""
    if subject.meta:
        torch.manual_seed(seed)
        rt.init_weights(subject.init)


def _defined_at(fn) -> str | None:
    """``file:line`` where the user's factory function is defined (for errors in what it returned)."""
    code = getattr(fn, "__code__", None)
    if code is None or _library(code.co_filename):
        return None
    return f"{code.co_filename}:{code.co_firstlineno}"


def describe(exc: BaseException) -> str:
    """``Type: first line of the message`` (a SyntaxError without its own location, given separately)."""
    text = exc.msg if isinstance(exc, SyntaxError) and exc.msg else str(exc)
    lines = text.strip().splitlines()
    first = lines[0][:300] if lines else ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _library(filename: str) -> bool:
    """Whether a traceback frame is paramfsm's, the standard library's or an installed package's own."""
    if filename.startswith("<"):
        return True
    path = Path(filename).resolve()
    roots = [Path(__file__).resolve().parents[1]]
    roots += [Path(sysconfig.get_paths()[key]).resolve() for key in ("stdlib", "purelib", "platlib")]
    return any(path.is_relative_to(root) for root in roots)


def user_frame(exc: BaseException) -> str | None:
    """``file:line`` of the innermost frame of the user's own code that the error came from, if any."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{exc.filename}:{exc.lineno}" if exc.lineno else exc.filename
    frames = traceback.extract_tb(exc.__traceback__)
    own = [f for f in frames if not _library(f.filename)]
    frame = own[-1] if own else None
    return f"{frame.filename}:{frame.lineno}" if frame else None


def import_root(factory) -> str | None:
    """The ``sys.path`` folder the factory's module was imported from (None when it is an installed module).

    A reproduction script puts it on ``sys.path`` so that it runs wherever it is saved.
    """
    name = factory.partition(":")[0] if isinstance(factory, str) else getattr(factory, "__module__", "")
    module = sys.modules.get(name)
    file = getattr(module, "__file__", None)
    if not file or name == "__main__" or name.split(".")[0] == "paramfsm":
        return None
    root = Path(file).resolve().parent
    for _ in range(name.count(".") + (Path(file).name == "__init__.py")):
        root = root.parent
    return None if _library(str(root / "x.py")) else str(root)


def global_batch(subject: Subject, batch: int, seed: int, world: int, per_rank: int):
    """Global batch number ``batch``: identical on every rank, in the reference and in a reproduction."""
    return subject.make_batch(torch.Generator().manual_seed(seed * 1000 + batch), world * per_rank)


def split(tree, world: int) -> list:
    """The ``world`` slices of a batch (tensors or tuples of tensors) along the first dimension."""
    if isinstance(tree, torch.Tensor):
        return list(tree.chunk(world))
    if isinstance(tree, (tuple, list)):
        parts = [split(t, world) for t in tree]
        return [type(tree)(p[r] for p in parts) for r in range(world)]
    return [tree] * world


def first_tensor(tree) -> torch.Tensor:
    if isinstance(tree, torch.Tensor):
        return tree
    if isinstance(tree, (tuple, list)):
        return first_tensor(tree[0])
    if isinstance(tree, dict):
        return first_tensor(next(iter(tree.values())))
    raise TypeError(f"the model output holds no tensor: {type(tree).__name__}")
