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
"""

from __future__ import annotations

import importlib
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
    ``checkpoint``: whether programs may run the whole model under
    ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``.
    ``create_graph``: whether programs may take gradient penalties
    (``torch.autograd.grad(..., create_graph=True)``).
    ``optimizer``: builds an element-wise optimizer from parameters.
    ``atol`` / ``rtol``: comparison tolerances (None: chosen from the parameter dtype).
    """

    model: nn.Module
    make_batch: Callable[[torch.Generator, int], tuple]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    units: Any = None
    checkpoint: bool = True
    create_graph: bool = True
    optimizer: Callable = sgd
    atol: float | None = None
    rtol: float | None = None

    def tolerances(self) -> tuple[float, float]:
        dtype = next(self.model.parameters()).dtype
        atol, rtol = {torch.float64: (1e-10, 1e-8), torch.float32: (1e-5, 1e-4)}.get(dtype, (1e-2, 1e-2))
        return (self.atol if self.atol is not None else atol), (self.rtol if self.rtol is not None else rtol)


def as_subject(value) -> Subject:
    """Accept a Subject, a ``(model, make_batch, loss_fn)`` tuple or a dict of Subject fields."""
    if isinstance(value, Subject):
        return value
    if isinstance(value, dict):
        return Subject(**value)
    if isinstance(value, (tuple, list)) and len(value) == 3:
        return Subject(*value)
    raise TypeError("a verify factory must return a paramfsm.testing.Subject or a tuple "
                    f"(model, make_batch, loss_fn), not {type(value).__name__}")


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
    """Call the factory (after ``torch.manual_seed(seed)`` when given) and return its Subject."""
    if seed is not None:
        torch.manual_seed(seed)
    return as_subject(resolve_factory(factory)())


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
