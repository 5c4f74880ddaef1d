"""Modules merged into a unit, called on their own: the unit's hooks run for the call.

[Note: a merged module called on its own is its unit's call]
Under the default units a small module is no unit: its parameters join the
nearest enclosing unit (``min_unit_bytes``, :mod:`paramfsm.engine.storage.default_units`),
the root at the latest. Inside its unit's forward that changes nothing: the
unit is gathered while its forward runs. But a merged module is also called
on its own, outside that forward: a reward or value head, an encoder run apart
from its decoder, ``model.get_input_embeddings()(ids)``. Its parameters are
then empty, and the call raised ``NotGathered``, where it worked when the
module was a unit of its own.

So each merged module that holds parameters of its unit (a *member*) carries
the unit's forward hooks too, guarded by a count of the unit's calls in
progress (:class:`Running`, the hooks' own bookkeeping, like the chain of
:mod:`paramfsm.engine.events.hooks`): while the unit's own forward (or another
member's call) runs, a member's hooks do nothing; otherwise the member's call
is a call of its unit, with the unit's ``PRE_FORWARD`` and ``POST_FORWARD`` and
the backward hooks on its inputs and outputs. The unit is gathered for the
call and released after it, in forward, under ``no_grad`` and inside another
unit's forward, and gathered again for the backward of the member's outputs,
exactly as the module's own unit was. Only units with members pay for the count (a dict
update per call), and a member's hooks return at once inside its unit.

[Note: members in backward]
A member called inside a backward pass is a checkpoint's recomputation (or a
hook's call) within the backward of its unit, which that backward already
gathered (its ``PRE_BACKWARD`` rides on the outputs of the unit's forward). It
is left to the unit, as before: a member's call there takes no hooks. Were it
its unit's call, a member that runs on some ranks only (an expert of a mixture,
recomputed one by one under reentrant checkpointing) would issue a gather on
those ranks alone. The backward of a member's own call on its own is covered by
the hooks that call registered on its outputs.

A unit's own forward recomputed inside backward is not counted either: non-reentrant
checkpointing stops a recomputation early by raising inside it, so its end never
comes, and the count it left would make every later call of a member on its own
(before the next root forward) look like a call inside its unit.

A member's call that raises emits no ``POST_FORWARD``, as a unit's does not:
what it gathered stays until ``rt.reset()`` or the next forward. A unit's own
forward that raises leaves it counted as running; the next root forward starts
the counts afresh.
"""

from __future__ import annotations

import sys
from functools import partial

from torch import nn

from paramfsm.engine.events import graph_task as gt
from paramfsm.engine.events.compile_guard import eager


class Running:
    """Calls in progress of each unit that has members, and the member whose call on its own is its unit's
    call now (if any)."""

    __slots__ = ("depth", "owner")

    def __init__(self):
        self.depth: dict = {}
        self.owner: dict = {}

    def reset(self) -> None:
        for unit in self.depth:
            self.depth[unit] = 0
        self.owner.clear()


def members(root: nn.Module, units) -> list[tuple[nn.Module, object]]:
    """``(module, unit)`` for each module that is no unit but holds parameters of its enclosing unit."""
    unit_of = {id(unit.module): unit for unit in units}
    owned = {unit: {id(rec.param) for rec in unit.records} for unit in units}
    found: list = []
    seen: set = set()

    def walk(module: nn.Module, unit) -> None:
        for child in module.children():
            if id(child) in seen:
                continue
            seen.add(id(child))
            inner = unit_of.get(id(child))
            if inner is not None:
                walk(child, inner)
                continue
            if unit is not None and any(id(p) in owned[unit] for p in child.parameters()):
                found.append((child, unit))
            walk(child, unit)

    seen.add(id(root))
    walk(root, unit_of.get(id(root)))
    return found


def counted(running: Running, unit, pre, post) -> tuple:
    """The unit's own pre- and post-forward hooks, counting its calls (for a unit with members)."""
    running.depth[unit] = 0
    return partial(_unit_pre, running, unit, pre), partial(_unit_post, running, unit, post)


def _unit_pre(running, unit, pre, module, args, kwargs):
    if gt.current_task() == gt.NO_TASK:  # a recomputation inside backward is not counted: [Note: members in ...]
        running.depth[unit] += 1
    return pre(module, args, kwargs)


def _unit_post(running, unit, post, module, args, output):
    if gt.current_task() == gt.NO_TASK and running.depth[unit]:
        running.depth[unit] -= 1
    return post(module, args, output)


def install(found, running: Running, hooks_of: dict) -> list:
    """Register each member's hooks (``hooks_of``: unit -> its counted pre- and post-forward hooks).

    [Note: a member's hooks are traced inside a compiled unit]
    The check that a member's unit is running is plain Python that Dynamo traces (it guards on the count), so a
    compiled unit (``torch.compile(block.forward)``, or the whole model) runs its members' calls inside its graph
    with no break. Only a member's call on its own takes the unit's hooks, which are opaque to Dynamo like every
    hook of a unit ([Note: hooks are opaque to Dynamo] in :mod:`paramfsm.engine.events.compile_guard`).
    """
    handles = []
    for module, unit in found:
        pre, post = hooks_of[unit]
        begin, end = eager(partial(_begin, running, unit, pre)), eager(partial(_end, running, unit, post))
        handles.append(module.register_forward_pre_hook(partial(_member_pre, running, unit, begin), with_kwargs=True))
        handles.append(module.register_forward_hook(partial(_member_post, running, unit, end), always_call=True))
    return handles


def _member_pre(running, unit, begin, module, args, kwargs):
    if running.depth[unit]:  # inside its unit's call: nothing to do
        return None
    return begin(module, args, kwargs)


def _member_post(running, unit, end, module, args, output=None):
    if running.owner.get(unit) is not module:  # not the member whose call is its unit's
        return None
    return end(module, args, output)


def _begin(running, unit, pre, module, args, kwargs):
    if gt.current_task() != gt.NO_TASK:  # a recomputation inside backward: [Note: members in backward]
        return None
    running.owner[unit] = module
    return pre(module, args, kwargs)


def _end(running, unit, post, module, args, output):
    running.owner[unit] = None
    if output is None and sys.exc_info()[1] is not None:  # the call raised: no POST_FORWARD, as for a unit
        running.depth[unit] -= 1
        return None
    return post(module, args, output)
