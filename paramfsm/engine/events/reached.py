"""The parameters of a unit that calls other units, hooked where a backward reaches them.

[Note: a backward that enters a unit from inside]
A unit's pre-backward rides on its outputs' nodes, so a backward that
reaches the unit's computation without passing through them would find its
parameters empty. That happens when a unit calls other units and an
activation from inside its forward is used again later: the input of
``model.blocks[0]`` saved during a root forward that added the root's own
``pos`` to it, then ``model.blocks[0](saved)`` and a backward, which reaches
``pos`` through the saved input alone. So the parameters of a unit that calls
other units have a pre-hook on their ``AccumulateGrad`` node, which runs
before the gradient is accumulated and emits ``PARAM_REACHED``; the scheduler
fetches the unit for that graph task only when it is not gathered already,
which is the ordinary case, and releases it at the task's end. Only those
units pay for the hook (one Python call per parameter per backward), since
the activations inside a unit that calls no other unit are out of reach of
the module hooks a user would capture them with.
"""

from __future__ import annotations

from functools import partial

from torch.autograd.graph import get_gradient_edge

from paramfsm.engine.events import graph_task as gt
from paramfsm.engine.events.events import PARAM_REACHED, Event


class _NodeHook:
    """A pre-hook on a parameter's ``AccumulateGrad`` node, which it keeps alive (autograd holds it weakly)."""

    __slots__ = ("node", "handle")

    def __init__(self, node, hook):
        self.node, self.handle = node, node.register_prehook(hook)

    def remove(self) -> None:
        self.handle.remove()


def parents(units) -> dict:
    """The units that call other units, each with its parameters (see [Note: a backward that enters a unit
    from inside]); frozen ones too, since a parameter can be unfrozen after ``shard()``."""
    modules = {id(unit.module) for unit in units}
    out, seen = {}, set()
    for unit in units:
        if any(id(m) in modules for m in unit.module.modules() if m is not unit.module):
            records = [rec for rec in unit.records if id(rec) not in seen]
            seen.update(id(rec) for rec in records)
            if records:
                out[unit] = records
    return out


def watch(emit, unit, chain) -> None:
    """Hook the ``AccumulateGrad`` of the parent unit's parameters, once, while they are gathered: the node
    records the parameter's shape when it is made, so it must be made from the full parameter.

    A parameter that requires no gradient now (frozen, at ``shard()`` or since) has no ``AccumulateGrad``
    node: it waits for a forward in which it requires one.
    """
    frozen = []
    for rec in chain.reached.pop(unit):
        if not rec.param.requires_grad:
            frozen.append(rec)
            continue
        node = get_gradient_edge(rec.param).node
        chain.handles.append(_NodeHook(node, partial(_on_reached, emit, unit, rec)))
    if frozen:
        chain.reached[unit] = frozen


def _on_reached(emit, unit, record, grad_outputs):
    emit(Event(PARAM_REACHED, unit, gt.backward_task(), gt.keeps_graph(), record))
