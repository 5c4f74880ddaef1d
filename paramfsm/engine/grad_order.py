"""Gradients missing on some ranks: every rank reduce-scatters the same parameters in the same order.

Every rank must issue reduce-scatters of the same sizes over the same
parameters, or gloo aborts the process ("Received data size doesn't match")
and NCCL may hang. Autograd hands gradients over in the order its graph
dictates, so two ranks whose graphs differ *inside* a unit (a mixture of
experts made one unit, any data-dependent branch within a unit) hand over
different parameters, in different orders: an expert that got no tokens on
rank 1 has no gradient there at all.

[Note: a unit's gradients go out in the unit's order]
A parameter that belongs to one unit only has its gradient *staged* when
autograd accumulated it (the ``reduce_grad`` effect of ``grad_ready``), not
put into the reduce bucket at once. At the unit's first pre-backward in a
graph task, the scheduler asks autograd which of the unit's parameters this
backward will reach (``torch._C._will_engine_execute_node`` on each one's
``AccumulateGrad`` node, the check FSDP uses): those are *expected*, the
others are *missing* on this rank. When the last expected gradient is
staged (at once when none is expected), the unit is *closed*: every
parameter of the unit goes to the bucket in the unit's own order, the
staged gradient, or, for a missing one, zeros (``grad_ready`` is stepped for
it all the same, so the trace shows it took part). Units close in the order
their backward finishes, which the ranks agree on whenever they agree on
which units run; inside a unit the graphs may differ. Whatever is still
open at the end of the graph task (an expected gradient never came)
closes then, in model order. A backward that captures gradients
(``torch.autograd.grad``) accumulates into no parameter on any rank, so
nothing counts as missing there (torch refuses the question for a captured
leaf, which is how it is told).
Parameters of several units (tied, or borrowed by
:mod:`paramfsm.engine.on_demand`) keep the direct path: their gradient is
complete after their last use, which the ranks agree on at unit level. When
the private check is missing, every parameter counts as expected.

[Note: late gradients]
Reentrant activation checkpointing inside a unit accumulates the gradients
of the checkpointed part in a nested graph task: those parameters are not in
the outer backward's graph, so at the unit's pre-backward they count as
missing (zeros go out, flagged as no gradient) and their real gradients
arrive after the unit closed. They are sent at the end of the outermost
backward, unit by unit in model order, each unit with every parameter it
zero-filled in this backward (the late gradient, or zeros again), so ranks
on which different parameters came late still send the same sizes.

[Note: a gradient no rank produced stays None]
Plain torch leaves ``.grad`` None for a parameter that no part of the loss
reached, and optimizers skip such parameters (no weight decay, no momentum).
A packed reduce bucket therefore carries one more small "parameter": per
destination rank, one flag per parameter of the bucket saying whether this
rank had a gradient; its reduce-scattered sum tells every rank, in the same
collective, whether *any* rank had one. Only then is the reduced shard added
to the shard gradient, so a parameter no rank produced a gradient for keeps
``shard.grad`` None exactly as plain torch would. A gradient of
``bucket_bytes`` or more is reduce-scattered in a bucket of its own, and a
flagged one takes its flag along (a packed copy instead of the in-place
input): zeros in its shard gradient would make a stateful optimizer step a
parameter plain torch leaves alone (momentum, weight decay).
"""

from __future__ import annotations

import torch
from torch.autograd.graph import get_gradient_edge

#: ``torch._C._will_engine_execute_node`` (private; re-check on every torch version): None if absent.
_WILL_EXECUTE = getattr(torch._C, "_will_engine_execute_node", None)


def staged(rec) -> bool:
    """Whether ``rec``'s gradient goes out in its unit's order (it belongs to one unit only)."""
    return len(rec.units) == 1


class GradOrder:
    """The scheduler's part: stage single-unit gradients, close units in their order, zero-fill."""

    def expect_grads(self, unit, task: int) -> None:
        """A unit's pre-backward: which of its parameters this backward reaches (once per task).

        Under rt.no_sync nothing is sent, so nothing is planned: gradients are kept where they are, and
        the first backward with sync on sends each unit in its order, kept sums folded in; the unit is
        remembered until then (see [Note: ranks synchronise the same parameters] in grad_sync).
        """
        if self.executor.local:
            return
        reached = self.executor.unsynced.reached
        if not self.sync_grads:
            reached[unit] = None
            return
        reached.pop(unit, None)
        plan = self.grad_plans.get(task)
        if plan is None:
            plan = self.grad_plans[task] = {}
        if unit in plan:
            return
        expected, missing, capturing = set(), [], False
        for rec in unit.records:
            if staged(rec) and rec.requires_grad and rec not in self.staged_grads:
                reach = self._will_reach(rec)
                capturing = capturing or reach is None
                (expected.add(rec) if reach is not False else missing.append(rec))
        # torch.autograd.grad accumulates into no parameter, on any rank: nothing is missing then
        plan[unit] = (expected, [] if capturing else missing)
        if not expected:
            self._close(unit, plan)

    def take_grads(self, records) -> None:
        """The ``reduce_grad`` effect: stage single-unit gradients; others go to the bucket directly."""
        executor = self.executor
        if executor.local:
            executor.take_grad(records)
            return
        direct, closing = [], []
        for rec in records:
            if not staged(rec):
                direct.append(rec)
                continue
            self.staged_grads[rec] = executor.detach_grad(rec)
            for plan in self.grad_plans.values():
                entry = plan.get(rec.units[0])
                if entry is not None and rec in entry[0]:
                    entry[0].discard(rec)
                    if not entry[0]:
                        closing.append((rec.units[0], plan))
        if direct:
            executor.take_grad(direct)
        for unit, plan in closing:
            if plan.get(unit) is not None:
                self._close(unit, plan)

    def close_task(self, task: int) -> None:
        """The end of a graph task: close, in model order, what is still open; at the end of the
        outermost one, send what came late (see [Note: late gradients])."""
        if self.executor.local:
            return
        plan = self.grad_plans.pop(task, None)
        if plan:
            for unit in self.units:
                if plan.get(unit) is not None:
                    self._close(unit, plan)
        if self.tasks:
            return
        grads, filled = self.staged_grads, self.zero_filled
        if grads:
            late = {rec.units[0] for rec in grads}
            for unit in self.units:
                if unit in late:
                    gone = filled.get(unit, ())
                    self.executor.take_ordered([(rec, grads.pop(rec, None)) for rec in unit.records
                                                if rec in grads or rec in gone])
        filled.clear()

    def _close(self, unit, plan) -> None:
        """Send ``unit``'s gradients in its order: staged ones, zeros for the missing ones."""
        _, missing = plan[unit]
        plan[unit] = None
        missing = [rec for rec in missing if rec not in self.staged_grads]  # some came late, before this
        if missing:
            self._step_all(missing, "grad_ready")  # stages None: zeros go out, flagged as no gradient here
            self.zero_filled.setdefault(unit, set()).update(missing)
        grads = self.staged_grads
        out = [(rec, grads.pop(rec)) for rec in unit.records if rec in grads]
        if out:
            self.executor.take_ordered(out)
        if missing:
            ts = self.tasks.get(self.ctx.graph_task)
            holds = ts.grad_holds if ts is not None else {}
            done = [rec for rec in missing if holds.pop(rec, 0) is None]
            self._step_all(done, "release", ts is not None and ts.keep_graph and self.defer_allowed)

    def _will_reach(self, rec) -> bool | None:
        """Whether this backward accumulates a gradient into ``rec``: True (or when torch cannot say),
        False, or None when the backward captures it (``torch.autograd.grad``: nothing is accumulated)."""
        node = self.grad_nodes.get(rec)
        if node is None:
            node = self.grad_nodes[rec] = get_gradient_edge(rec.param).node
        try:
            return bool(_WILL_EXECUTE(node)) if _WILL_EXECUTE is not None else True
        except RuntimeError:  # torch refuses the question for a leaf that autograd.grad captures
            return None


class Flags:
    """The extra "parameter" of a packed reduce bucket: whether each rank had each gradient
    (see [Note: a gradient no rank produced stays None])."""

    __slots__ = ("records", "numel", "unit")

    def __init__(self, records, world: int):
        self.records = records
        self.numel = world * len(records)
        self.unit = records[0].unit


def add_flags(pending: list, had: dict, world: int) -> list:
    """``pending`` (record, gradient) pairs, plus the flags of those in ``had`` (popped from it)."""
    flagged = [rec for rec, _ in pending if rec in had]
    if not flagged:
        return pending
    values = [1.0 if had.pop(rec) else 0.0 for rec in flagged]
    device = pending[0][1].device
    return pending + [(Flags(flagged, world), torch.tensor(values, device=device).repeat(world))]


def without_unproduced(records, pieces) -> list:
    """(record, reduced shard) pairs to accumulate: a flagged parameter no rank had a gradient for is left out."""
    if not records or type(records[-1]) is not Flags:
        return list(zip(records, pieces))
    flags, pieces = records[-1], list(pieces)
    nobody = {rec for rec, any_rank in zip(flags.records, (pieces[-1] != 0).tolist()) if not any_rank}
    return [(rec, piece) for rec, piece in zip(records[:-1], pieces[:-1]) if rec not in nobody]
