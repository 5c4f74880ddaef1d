"""The scheduler: the one place that turns hook events into FSM steps and effects.

Hooks (``paramfsm.engine.events.hooks``) only emit :class:`Event` objects. The scheduler
queues them (FIFO), applies each to the parameters of its unit through
:func:`paramfsm.core.fsm.step`, and hands the returned effects to the
:class:`~paramfsm.engine.effects.executor.Executor`. Policy lives here and only here:
prefetch order and buckets (:mod:`paramfsm.engine.schedule.plan`), the retain policy, the
deferred-bytes bound, per-graph-task bookkeeping, and the leak audit.

The backward handlers live in :mod:`paramfsm.engine.schedule.backward`.

[Note: flushing deferred parameters at a new forward]
A new root forward (outside backward) flushes every deferred parameter: a
new iteration begins, and a copy kept for an older retained graph would hold
memory for a backward that rarely comes. Staleness is not the reason: a
write to a shard (an optimizer step, a load) drops the copies gathered before
it wherever it happens (:mod:`paramfsm.engine.schedule.shard_writes`), also between two
forwards of a submodule that never reach the root. Every rank runs the same
forwards, so the flush is rank-consistent. It only costs a re-gather for a
backward over an older retained graph, which is correct (deferral is an
optimisation).
"""

from __future__ import annotations

import logging
from collections import deque
from contextlib import nullcontext
from functools import partial

from paramfsm.core.fsm import StepContext, step, step_many
from paramfsm.core.machine import CrossCheckedStep
from paramfsm.core.spec import State
from paramfsm.engine.effects import lost_writes
from paramfsm.engine.effects.write_back import copy_into_shards
from paramfsm.engine.events import graph_task as gt
from paramfsm.engine.events.events import (
    BACKWARD_END, DEMAND, FLUSH, FORWARD_BEGIN, FORWARD_END, FORWARD_FAILED, GRAD_READY, GRAPH_FREED, PARAM_REACHED,
    POST_BACKWARD, POST_FORWARD, PRE_BACKWARD, PRE_FORWARD, SHARDS_WRITTEN, WRITTEN_BACK, Event,
)
from paramfsm.engine.schedule.audit import LeakAudit
from paramfsm.engine.schedule.backward import GraphTasks
from paramfsm.engine.schedule.deferral import Deferral
from paramfsm.engine.schedule.freezing import apply_requires_grad_changes
from paramfsm.engine.schedule.grad_order import GradRouting
from paramfsm.engine.schedule.holds import ForwardHolds
from paramfsm.engine.schedule.on_demand import OnDemand
from paramfsm.engine.schedule.prefetch import Prefetch
from paramfsm.engine.schedule.shard_writes import ShardWrites
from paramfsm.engine.storage import partitioned

log = logging.getLogger(__name__)


class Scheduler:
    """Applies events to parameter lifetimes; see the module docstring."""

    def __init__(self, table, units, records, executor, *, ctx: StepContext, retain: str, prefetch: int,
                 max_deferred_bytes, bucket_bytes: int, strict: bool = False, on_failure=None,
                 keep_after_forward: frozenset = frozenset(), offload=None):
        """``ctx`` is shared with the executor (and an offload plan's residency); ``on_failure`` is the flight
        recorder's ``failed(exc, reason)`` (:mod:`paramfsm.engine.schedule.flight`); ``keep_after_forward``
        the units not resharded after forward (:mod:`paramfsm.engine.schedule.reshard`); ``offload`` the
        offload plan whose residency the schedule drives (``paramfsm.shard(offload=...)``), or None."""
        self.table, self.units, self.records, self.executor = table, units, records, executor
        self._records = set(records)
        self.ctx = ctx
        checked = CrossCheckedStep(table.spec, step, step_many) if strict else None
        self._stepper = checked if strict else step
        self._stepper_many = checked.many if strict else step_many
        self.closed = False
        self.on_failure = on_failure
        self._queue: deque = deque()
        # Parameters whose GRAD_READY is queued: the graph tasks fill it, and it is drained before any event of
        # another kind is applied ([Note: accumulated gradients are stepped together] in backward.py).
        self._ready: dict = {}
        self._draining = False
        self._recovering = False  # recover() frees what was written too ([Note: a write to a gathered parameter])
        step_one, step_all = self._step, self._step_all
        self.prefetch = Prefetch(step_one, step_all, executor, units, prefetch=prefetch, bucket_bytes=bucket_bytes)
        self.deferral = Deferral(step_one, step_all, allowed=retain == "defer", bound=max_deferred_bytes)
        self.holds = ForwardHolds(self.deferral.release, keep_after_forward)
        self.grads = GradRouting(executor, units, step_all, self.hand_back)
        self.audit = LeakAudit(records, self.ctx, self.holds.held_units, self.report_failure, strict=strict)
        self.graph = GraphTasks(self.ctx, self.emit, step_one, step_all, self._ready, prefetch=self.prefetch,
                                deferral=self.deferral, holds=self.holds, grads=self.grads,
                                done=self._after_final_backward)
        self.grads.attach(self.graph)
        self.on_demand = OnDemand(self._records, self._accepting, self.emit, step_one, self.prefetch, self.holds)
        self.on_demand.attach(self.graph)
        writes = ShardWrites(step_one, self.holds.release_kept)
        # Offloaded shards and optimizer state (paramfsm.engine.schedule.residency), or None; the plan
        # (tiers, which units offload what) is the facade's (paramfsm.sharding.offload).
        self.offload_plan = offload
        self.residency = offload.residency if offload is not None else None
        if offload is not None and offload.grads is not None:
            executor.hand_back_reduced()
        # The count of each phase's peak memory once rt.reset_peak_memory() turned it on (paramfsm.sharding.memory), or None.
        self.peaks = None
        self._effects = self._effect_runners()
        graph = self.graph
        self._handlers = {
            FORWARD_BEGIN: self._on_forward_begin, FORWARD_END: self._on_forward_end,
            PRE_FORWARD: self.enter_forward, POST_FORWARD: self.leave_forward,
            PRE_BACKWARD: graph.on_pre_backward, POST_BACKWARD: graph.on_post_backward,
            GRAD_READY: graph.on_grad_ready, BACKWARD_END: graph.on_backward_end,
            GRAPH_FREED: graph.on_graph_freed, FLUSH: lambda ev: self.deferral.flush(),
            FORWARD_FAILED: self._on_forward_failed, DEMAND: self.on_demand.demanded,
            SHARDS_WRITTEN: writes.written, WRITTEN_BACK: writes.written_back,
            PARAM_REACHED: graph.on_param_reached,
        }

    def _effect_runners(self) -> dict:
        """Effect name (as the spec writes it) -> what runs it, for a sequence of records.

        Two kinds of effect, as DESIGN §2 names them. Data effects move or free tensors and run in
        :mod:`paramfsm.engine.effects` (``unpack``, ``discard_gather``, ``free``, ``keep_grad``,
        ``sync_grad``, ``write_back``). Schedule effects decide what happens next and are run by the
        schedule component that owns that decision: ``start_gather`` by prefetch (which plans the
        bucket and issues it), ``defer`` and ``undefer`` by deferral, ``reduce_grad`` by the gradient
        routing (which orders gradients into buckets before the executor reduces them). So the schedule
        runs its own effects, and the executor is reached only through the data effects and those
        components.
        """
        executor = self.executor
        runners = {
            "start_gather": self.prefetch.start_gather,
            "unpack": lost_writes.noting(executor.install),
            "discard_gather": executor.discard,
            "free": lost_writes.checked(executor.free, lambda: self._recovering, executor.rank),
            "defer": self.deferral.defer_all,
            "undefer": self.deferral.undefer_all,
            "reduce_grad": self.grads.take_grads,
            "keep_grad": executor.unsynced.keep,
            "sync_grad": self._then_hand_back(executor.unsynced.sync),
            "write_back": lost_writes.noting(partial(copy_into_shards, executor.rank)),
        }
        if self.residency is not None:
            runners["start_gather"] = self.residency.gathering(runners["start_gather"])
            runners["unpack"] = self.residency.gathered(runners["unpack"])
            runners["discard_gather"] = self.residency.gathered(runners["discard_gather"])
            runners["write_back"] = self.residency.writing(runners["write_back"])
        return runners

    def hand_back(self) -> None:
        """Add the reduced gradient shards the executor handed back (offloaded shard gradients only) into
        the shard gradients, paging them in and out around it (``GradPaging.accumulate``). Called after
        every executor call that can complete a reduce-scatter, so the additions keep their order."""
        executor = self.executor
        if executor.completions:
            self.offload_plan.grads.accumulate(executor.take_completed())

    def _then_hand_back(self, effect):
        """``effect``, then :meth:`hand_back`: an effect that may complete a reduce-scatter (``sync_grad``)."""
        def run(records):
            effect(records)
            self.hand_back()
        return run

    # ------------------------------------------------------------------ queue
    def emit(self, event: Event) -> None:
        """Queue an event and, unless already draining, apply every queued event in order."""
        if self._draining:
            self._queue.append(event)
            return
        if self.closed:
            return
        self._draining = True
        try:
            queue, handlers, ctx, graph, ready = self._queue, self._handlers, self.ctx, self.graph, self._ready
            if ready and event.kind is not GRAD_READY and not self._interrupted(event):
                graph.drain_ready()
            ctx.graph_task = event.graph_task
            handlers[event.kind](event)
            while queue:
                ev = queue.popleft()
                if ready and ev.kind is not GRAD_READY and not self._interrupted(ev):
                    graph.drain_ready()
                ctx.graph_task = ev.graph_task
                handlers[ev.kind](ev)
        except BaseException as exc:
            self._queue.clear()
            self.graph.clear_ready()
            if isinstance(exc, Exception):
                self.report_failure(exc)
            raise
        finally:
            self._draining = False

    def _interrupted(self, event: Event) -> bool:
        """A root forward that finds a backward unfinished: its queued gradients are dropped, not stepped
        (see [Note: an interrupted backward's queued gradients] in paramfsm.engine.schedule.backward)."""
        return event.kind is FORWARD_BEGIN and event.graph_task == gt.NO_TASK and self.graph.running()

    def _accepting(self) -> bool:
        """Whether an event from outside the queue (an on-demand read) may be applied now."""
        return not (self.closed or self._draining)

    def report_failure(self, exc: BaseException | None, reason: str | None = None):
        """Hand a failure to the flight recorder (it dumps the trace); returns the dump's path or None."""
        if self.on_failure is None:
            return None
        return self.on_failure(exc, reason)

    # ------------------------------------------------------------------ steps
    def _step(self, rec, event: str, keep_graph: bool = False, retained: bool = False) -> None:
        effects = self._stepper(self.table, rec, event, self.ctx, keep_graph, retained)
        if effects:
            run, records = self._effects, (rec,)
            for effect in effects:
                run[effect](records)

    def _step_all(self, records, event: str, keep_graph: bool = False, retained: bool = False) -> None:
        """``_step`` for every record of a unit: one table lookup when they share their situation
        (see [Note: one lookup for a unit] in paramfsm.core.fsm), else one record at a time.

        Every record moves before the effects run, each effect for every record in turn.
        """
        if not records:
            return
        effects = self._stepper_many(self.table, records, event, self.ctx, keep_graph, retained)
        if effects is None:
            for rec in records:
                self._step(rec, event, keep_graph, retained)
        elif effects:
            run = self._effects
            for effect in effects:
                run[effect](records)

    # ---------------------------------------------------------------- the root forward
    def _on_forward_begin(self, ev: Event) -> None:
        if ev.graph_task != gt.NO_TASK:
            return  # a forward recomputed inside backward (activation checkpointing)
        if self.prefetch.in_forward() or self.graph.running():
            self.recover("the previous forward or backward did not finish (an exception?)")
        if partitioned.REQUIRES_GRAD_CHANGED:
            apply_requires_grad_changes(self._records, self.emit)
        self.deferral.flush()
        self.holds.release_all()
        if self.residency is not None:
            self.residency.settle()
        ctx = self.ctx
        ctx.step = ctx.pinned if ctx.pinned is not None else ctx.step + 1
        self.prefetch.begin_forward()
        self.on_demand.reset()

    def _on_forward_end(self, ev: Event) -> None:
        if ev.graph_task == gt.NO_TASK:
            self.prefetch.end_forward()

    def _on_forward_failed(self, ev: Event) -> None:
        """A root forward raised. Inside backward that is how non-reentrant checkpointing stops a
        recomputation early (see paramfsm.engine.schedule.backward), not a failure."""
        if ev.graph_task == gt.NO_TASK:
            self.on_demand.reset()  # no unit runs any more: a read from now on is NotGathered, not gathered
            self.report_failure(None, "forward-exception")

    def enter_forward(self, ev: Event) -> None:
        """``PRE_FORWARD``: note the unit as running (for on-demand reads), then fetch it."""
        self.on_demand.entered(ev.unit, ev.graph_task)
        self._on_pre_forward(ev)

    def leave_forward(self, ev: Event) -> None:
        """``POST_FORWARD``: the unit no longer runs; release it."""
        self.on_demand.left(ev.unit, ev.graph_task)
        self._on_post_forward(ev)

    def _on_pre_forward(self, ev: Event) -> None:
        if ev.graph_task != gt.NO_TASK:
            self.graph.recompute(ev)
            return
        self.prefetch.fetch_forward(ev.unit)

    def _on_post_forward(self, ev: Event) -> None:
        call = ev.call
        if call is not None:
            ev.unit.live_graphs += 1
        if ev.graph_task == gt.NO_TASK and not self.holds.after_forward(ev.unit, call):
            self.deferral.release(ev.unit, False)
        # A recomputation keeps its hold until the unit's backward: see [Note: a forward recomputed ...].

    def _after_final_backward(self) -> None:
        """The outermost backward that did not keep its graph ended: flush deferred copies, audit leaks."""
        self.deferral.flush()
        self.audit.run()

    # ---------------------------------------------------------------- called by the runtime
    def hold(self, unit) -> None:
        """Fetch a unit for use outside forward/backward (rt.gathered).

        Deferred copies and units a forward kept for its backward are returned
        first, so the block holds the unit alone and its end releases it.
        """
        self.holds.take_outside(unit)
        for rec in unit.records:
            if rec.state is State.DEFERRED_RELEASE:
                self._step(rec, "flush")
        self.prefetch.fetch(unit, None, None)

    def unhold(self, unit) -> None:
        self.holds.drop_outside(unit)

    def release_forward_holds(self) -> None:
        """Release every forward hold kept for a backward (a load or a save reads or writes the shards)."""
        self.holds.release_all()

    def watch(self, kind: str, fn):
        """Call ``fn(event)`` before each event of ``kind`` is applied (an observer: it must not emit); returns
        the function that stops it. Nothing is added to events of other kinds."""
        handler = self._handlers[kind]

        def watched(event):
            fn(event)
            handler(event)
        self._handlers[kind] = watched

        def stop():
            self._handlers[kind] = handler
        return stop

    def shards_written(self, records, changed, why: str, *, paging: bool = True) -> None:
        """The shards of ``records`` are about to be written by ``why`` (``changed``: the ones whose values
        change); see :mod:`paramfsm.engine.schedule.shard_writes`. Offloaded shards among ``changed`` are
        paged in and kept resident until the next root forward or optimizer step (``paging=False``: the
        caller, an optimizer stepping unit by unit, pages them itself)."""
        self.emit(Event(SHARDS_WRITTEN, records=records, changed=changed, why=why))
        if paging and self.residency is not None:
            self.residency.writing_shards(changed)

    def shard_scope(self, records, *, write: bool):
        """The shards of ``records`` resident for the block under offload, released after it (see [Note:
        streaming through the tier] in paramfsm.engine.schedule.residency); nothing to do without offload."""
        return self.residency.using(records, write=write) if self.residency is not None else nullcontext()

    def state_scope(self, optimizer, records, *, write: bool):
        """:meth:`shard_scope` for the optimizer state ``optimizer`` keeps for ``records``."""
        if self.residency is None:
            return nullcontext()
        return self.residency.using_state(optimizer, records, write=write)

    def write_back(self, records) -> None:
        """Write the held full copies of ``records`` back into their shards (``rt.gathered(writeback=True)``)."""
        self.emit(Event(WRITTEN_BACK, records=records))

    def close(self) -> None:
        """Stop applying events: the runtime let go of its model (``rt.close()``, ``rt.detach()``)."""
        self.closed = True

    def request_flush(self) -> None:
        """rt.flush(): queued like any event, so it never interleaves with a step in progress."""
        self.emit(Event(FLUSH))

    def recover(self, why: str) -> None:
        """Return every parameter to NOT_AVAILABLE after an interrupted forward or backward."""
        log.warning("paramfsm: resetting gathered parameters on rank %d: %s", self.ctx.rank, why)
        self.report_failure(None, "interrupted")
        self._recovering = True  # what the interrupted iteration wrote is dropped: [Note: a write to a gathered ...]
        try:
            self._recover()
        finally:
            self._recovering = False

    def _recover(self) -> None:
        self._queue.clear()
        self.graph.reset()
        self.prefetch.reset()
        self.holds.reset()
        try:  # reduced before the failure: added, as they would have been without one
            self.hand_back()
        except Exception:  # noqa: BLE001 - recovery goes on; the failure that led here is the one raised
            self.executor.take_completed()
        self.executor.abort_reduces()
        for rec in self.records:
            self._step(rec, "reset")
        self.on_demand.reset()
        self.grads.reset()
