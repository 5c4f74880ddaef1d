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
:mod:`paramfsm.engine.schedule.on_demand`) keep the direct path: their gradient is
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

from paramfsm.engine.effects.grad_flags import staged

#: ``torch._C._will_engine_execute_node`` (private; re-check on every torch version): None if absent.
_WILL_EXECUTE = getattr(torch._C, "_will_engine_execute_node", None)



class GradRouting:
    """Where each gradient goes and when: staged in its unit's order, zero-filled, kept, synchronised.

    It owns the staged gradients, the per-task plans of expected gradients,
    each parameter's ``AccumulateGrad`` node, the parameters zero-filled in
    this backward and the sync switch (off under ``rt.no_sync()``). It asks
    the graph tasks for the gradient holds of the task in progress.
    """

    __slots__ = ("_executor", "_units", "_step_all", "_hand_back", "_graph", "sync", "staged_grads", "grad_plans",
                 "grad_nodes", "zero_filled")

    def __init__(self, executor, units, step_all, hand_back):
        self._executor, self._units, self._step_all = executor, units, step_all
        # After every executor call that can complete a reduce-scatter: its reduced shards, handed back under
        # gradient offload, are added into the shard gradients (Scheduler.hand_back).
        self._hand_back = hand_back
        self._graph = None  # the graph tasks (paramfsm.engine.schedule.backward), set by the scheduler
        # Off under rt.no_sync(): gradients are kept, not reduce-scattered (paramfsm.engine.effects.grad_sync).
        self.sync = True
        self.staged_grads: dict = {}
        self.grad_plans: dict = {}
        self.grad_nodes: dict = {}
        self.zero_filled: dict = {}  # unit -> parameters sent as zeros in this backward

    def backward_running(self) -> bool:
        """Whether a backward is in progress (a kept gradient is synchronised only between backward passes)."""
        return self._graph.running()

    def attach(self, graph) -> None:
        """The graph tasks it asks (constructed after it, since they call it too)."""
        self._graph = graph

    def grad_event(self) -> str:
        """What an accumulated gradient does: leave for the reduce bucket, or stay kept (``rt.no_sync()``)."""
        return "grad_ready" if self.sync else "grad_kept"

    def expect_grads(self, unit, task: int) -> None:
        """A unit's pre-backward: which of its parameters this backward reaches (once per task).

        Under rt.no_sync nothing is sent, so nothing is planned: gradients are kept where they are, and
        the first backward with sync on sends each unit in its order, kept sums folded in; the unit is
        remembered until then (see [Note: ranks synchronise the same parameters] in grad_sync).
        """
        if self._executor.local:
            return
        reached = self._executor.unsynced.reached
        if not self.sync:
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
        executor = self._executor
        if executor.local:
            executor.take_grad(records)
            self._hand_back()
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
            self._hand_back()
        for unit, plan in closing:
            if plan.get(unit) is not None:
                self._close(unit, plan)

    def close_task(self, task: int) -> None:
        """The end of a graph task: close, in model order, what is still open; at the end of the
        outermost one, send what came late (see [Note: late gradients])."""
        if self._executor.local:
            return
        plan = self.grad_plans.pop(task, None)
        if plan:
            for unit in self._units:
                if plan.get(unit) is not None:
                    self._close(unit, plan)
        if self.backward_running():
            return
        grads, filled = self.staged_grads, self.zero_filled
        if grads:
            late = {rec.units[0] for rec in grads}
            for unit in self._units:
                if unit in late:
                    gone = filled.get(unit, ())
                    self._executor.take_ordered([(rec, grads.pop(rec, None)) for rec in unit.records
                                                 if rec in grads or rec in gone])
            self._hand_back()
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
            self._executor.take_ordered(out)
            self._hand_back()
        if missing:
            self._graph.grads_done(missing)

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

    def sync_kept(self, force: bool = False) -> None:
        """Complete the reduce-scatters, first issuing those of the gradients kept under rt.no_sync that
        this backward did not fold in (when sync is on, or ``force``: rt.sync_gradients()); so K
        micro-batches cost one reduce-scatter per bucket."""
        unsynced = self._executor.unsynced
        if (force or self.sync) and (unsynced or unsynced.reached):
            self._step_all(unsynced.due(), "grad_sync")
            unsynced.reached.clear()
        self._executor.finish_reduces()
        self._hand_back()
        device = next((rec.shard.device for unit in self._units for rec in unit.records), None)
        if device is not None:  # [Note: a backward that reached other units on other ranks]
            self._executor.agree_backward_end(device)

    def drop(self, records) -> None:
        """Take the gradients of an interrupted backward off these full parameters, unused (see [Note: an
        interrupted backward's queued gradients] in paramfsm.engine.schedule.backward)."""
        for rec in records:
            self._executor.detach_grad(rec)

    def reset(self) -> None:
        self.staged_grads.clear()
        self.grad_plans.clear()
        self.zero_filled.clear()
