"""Higher-order gradients: a unit's backward recorded with ``create_graph=True`` is itself a graph.

With ``create_graph=True`` (``torch.autograd.grad(..., create_graph=True)``
for a gradient penalty, or ``backward(create_graph=True)``) autograd records
the unit's backward computation as new graph nodes, and some of them save the
unit's parameters (a leaf is saved by reference, so such a node reads
whatever ``param.data`` is when it runs). A later backward through a
gradient penalty runs those nodes, possibly long after the parameters were
released, and before any node of the original forward graph that would
fetch them.

[Note: where a later backward enters a unit's recorded backward]
Gradient enters the recorded computation only through what it produced:
the gradients of the unit's inputs (handed on by the post-backward hooks)
and the gradients of its parameters (seen by a tensor hook on each
parameter). While grad mode is on inside backward, which is exactly
``create_graph=True``, those tensors are passed through
:class:`SecondOrderEntry`, an identity whose backward emits ``PRE_BACKWARD``
for the unit before any node of the recorded computation runs. The call
identity of that event is the unit itself, so a graph task fetches a unit
once for its recorded computations; the hold is released when the task ends.

Hooks only emit events here too; the scheduler decides what a fetch means.
"""

from __future__ import annotations

import torch

from paramfsm.engine.events import graph_task as gt
from paramfsm.engine.events.events import PRE_BACKWARD, Event


class SecondOrderEntry(torch.autograd.Function):
    """Identity on gradients produced by units' backward; its backward fetches those units."""

    @staticmethod
    def forward(ctx, emit, units, *tensors):
        ctx.emit, ctx.units = emit, units
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        task, keep = gt.backward_task(), gt.keeps_graph()
        for unit in ctx.units:
            ctx.emit(Event(PRE_BACKWARD, unit, task, keep, call=unit))
        return (None, None, *grads)


def enter(emit, units, grads):
    """``grads`` with every tensor that is part of a graph routed through :class:`SecondOrderEntry`.

    Returns None when nothing needs routing (the usual first-order backward),
    which hooks read as "keep the gradients as they are".
    """
    positions = [i for i, g in enumerate(grads) if isinstance(g, torch.Tensor) and g.requires_grad]
    if not positions:
        return None
    routed = SecondOrderEntry.apply(emit, units, *(grads[i] for i in positions))
    out = list(grads)
    for i, tensor in zip(positions, routed):
        out[i] = tensor
    return tuple(out)


def on_param_grad(emit, units, grad):
    """Tensor hook on a parameter: route its gradient when it is being recorded (create_graph)."""
    if not torch.is_grad_enabled() or not grad.requires_grad:
        return None
    return SecondOrderEntry.apply(emit, units, grad)[0]
