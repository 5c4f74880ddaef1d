"""The scheduler: the one place that turns hook events into FSM steps and effects.

Hooks (``paramfsm.engine.hooks``) only emit :class:`Event` objects. The scheduler
queues them (FIFO), applies each to the parameters of its unit through
:func:`paramfsm.core.fsm.step`, and hands the returned effects to the
:class:`~paramfsm.engine.executor.Executor`. Policy lives here and only here:
prefetch order and buckets (:mod:`paramfsm.engine.plan`), the retain policy, the
deferred-bytes bound, per-graph-task bookkeeping, and the leak audit.

The backward handlers live in :mod:`paramfsm.engine.backward`.

[Note: flushing deferred parameters at a new forward]
A new root forward (outside backward) flushes every deferred parameter: a
new iteration begins, and a copy kept for an older retained graph would hold
memory for a backward that rarely comes. Staleness is not the reason: a
write to a shard (an optimizer step, a load) drops the copies gathered before
it wherever it happens (:mod:`paramfsm.engine.shard_writes`), also between two
forwards of a submodule that never reach the root. Every rank runs the same
forwards, so the flush is rank-consistent. It only costs a re-gather for a
backward over an older retained graph, which is correct (deferral is an
optimisation).
"""

from __future__ import annotations

import logging
from collections import deque
from functools import partial

from paramfsm.core.fsm import StepContext, step, step_many
from paramfsm.core.machine import CrossCheckedStep
from paramfsm.core.spec import State
from paramfsm.engine import graph_task as gt
from paramfsm.engine import partitioned
from paramfsm.engine.backward import BackwardHandlers
from paramfsm.engine.events import (
    BACKWARD_END, DEMAND, FLUSH, FORWARD_BEGIN, FORWARD_END, FORWARD_FAILED, GRAD_READY, GRAPH_FREED, POST_BACKWARD,
    PARAM_REACHED, POST_FORWARD, PRE_BACKWARD, PRE_FORWARD, SHARDS_WRITTEN, WRITTEN_BACK, Event, TaskState,
)
from paramfsm.engine.grad_order import GradOrder
from paramfsm.engine.on_demand import OnDemandHandlers
from paramfsm.engine.plan import PassState, Plan
from paramfsm.engine.shard_writes import ShardWrites, copy_into_shards

log = logging.getLogger(__name__)


class Scheduler(BackwardHandlers, OnDemandHandlers, GradOrder):
    """Applies events to parameter lifetimes; see the module docstring."""

    def __init__(self, table, units, records, executor, *, rank: int, retain: str, prefetch: int,
                 max_deferred_bytes, bucket_bytes: int, trace=None, strict: bool = False):
        self.table, self.units, self.records, self.executor = table, units, records, executor
        self._records = set(records)
        self.ctx = StepContext(rank, trace)
        self.defer_allowed = retain == "defer"
        self.prefetch = prefetch
        self.max_deferred_bytes = max_deferred_bytes
        self.strict = strict
        checked = CrossCheckedStep(table.spec, step, step_many) if strict else None
        self._stepper = checked if strict else step
        self._stepper_many = checked.many if strict else step_many
        self.deferred: dict = {}  # record -> None, oldest first
        self.deferred_bytes = 0
        self.peak_deferred_bytes = 0
        self.tasks: dict[int, TaskState] = {}
        self.forward = PassState()
        self.forward_open = False
        self.fwd_plan = Plan((), units, bucket_bytes)
        self.bwd_plan = Plan((), units, bucket_bytes)
        # One rank gathers nothing over the wire: buckets and prefetch would only add steps.
        self.planning = executor.world > 1
        self.held_outside: dict = {}  # unit -> holds taken by rt.gathered
        self.running: list = []  # (unit, graph task) of the forwards in progress: paramfsm.engine.on_demand
        self.warned: set = set()  # (parameter, reading unit) reads outside a unit already warned about
        # Gradients sent in each unit's order (paramfsm.engine.grad_order): staged ones, per-task plans,
        # and each parameter's AccumulateGrad node.
        self.staged_grads: dict = {}
        self.grad_plans: dict = {}
        self.grad_nodes: dict = {}
        self.zero_filled: dict = {}  # unit -> parameters sent as zeros in this backward
        # reshard_after_forward: units whose forward hold is kept for their backward, and those holds
        # (id of the forward call -> unit); see [Note: a forward's hold kept for its backward].
        self.keep_after_forward: frozenset = frozenset()
        self.forward_holds: dict = {}
        self.tasks_begun = 0
        self.last_audit: list = []
        self.closed = False
        # The flight recorder's ``failed(exc, reason)`` (paramfsm.engine.flight), and the training step
        # given by rt.set_step (None: count root forwards); both set by the runtime.
        self.on_failure = self.pinned_step = None
        self._queue: deque = deque()
        self._draining = False
        self._gather_batch: list = []
        # Parameters whose GRAD_READY is queued, and their task: [Note: accumulated gradients are stepped together].
        self._ready: dict = {}
        self._ready_task = self._ready_graph_task = None
        # Effect -> what runs it, for a sequence of records.
        self._effects = {
            "start_gather": self._gather_batch.extend,
            "unpack": executor.install,
            "discard_gather": executor.discard,
            "free": executor.free,
            "defer": self._defer_all,
            "undefer": self._undefer_all,
            "reduce_grad": self.take_grads,
            "keep_grad": executor.unsynced.keep,
            "sync_grad": executor.unsynced.sync,
            "write_back": partial(copy_into_shards, executor.rank),
        }
        writes = ShardWrites(self._step, self.release_kept)
        # Off under rt.no_sync(): gradients are kept, not reduce-scattered (paramfsm.engine.grad_sync).
        self.sync_grads = True
        self._handlers = {
            FORWARD_BEGIN: self._on_forward_begin, FORWARD_END: self._on_forward_end,
            PRE_FORWARD: self.enter_forward, POST_FORWARD: self.leave_forward,
            PRE_BACKWARD: self._on_pre_backward, POST_BACKWARD: self._on_post_backward,
            GRAD_READY: self._on_grad_ready, BACKWARD_END: self._on_backward_end,
            GRAPH_FREED: self._on_graph_freed, FLUSH: lambda ev: self.flush(),
            FORWARD_FAILED: self._on_forward_failed, DEMAND: self._on_demand,
            SHARDS_WRITTEN: writes.written, WRITTEN_BACK: writes.written_back,
            PARAM_REACHED: self._on_param_reached,
        }

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
            queue, handlers, ctx, ready = self._queue, self._handlers, self.ctx, self._ready
            if ready and event.kind is not GRAD_READY:
                self.drain_ready()
            ctx.graph_task = event.graph_task
            handlers[event.kind](event)
            while queue:
                ev = queue.popleft()
                if ready and ev.kind is not GRAD_READY:
                    self.drain_ready()
                ctx.graph_task = ev.graph_task
                handlers[ev.kind](ev)
        except BaseException as exc:
            self._queue.clear()
            self._ready.clear()
            self._ready_task = None
            if isinstance(exc, Exception):
                self.report_failure(exc)
            raise
        finally:
            self._draining = False

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

    def _issue(self) -> None:
        """Issue one all-gather for every record that asked for start_gather in this decision."""
        batch = self._gather_batch
        if batch:
            records = tuple(batch)
            batch.clear()
            self.executor.start_gather(records)

    def _wait(self, unit) -> None:
        """Make every INFLIGHT parameter of ``unit`` arrive (waiting for its whole bucket)."""
        for rec in unit.records:
            if rec.state is State.INFLIGHT:
                gather = rec.pending
                self.executor.wait_gather(gather)
                members = gather.records
                for member in members:
                    if member.state is not State.INFLIGHT or member.pending is not gather:
                        members = [m for m in members if m.state is State.INFLIGHT and m.pending is gather]
                        break
                self._step_all(members, "arrive")

    def fetch(self, unit, plan: Plan | None, passes: PassState | None) -> None:
        """Fetch ``unit`` for a holder: gather it (with its bucket) if needed, wait, prefetch ahead.

        Without a plan (first pass, recomputation inside backward, rt.gathered)
        the unit is gathered alone and nothing is prefetched.
        """
        self._step_all(unit.records, "fetch")
        bucket = plan.bucket_index(unit) if plan is not None else None
        # [Note: a bucket is issued by its first fetch]
        # Whether or not this unit itself needed a gather: a unit with nothing to gather (the root
        # holding no parameters of its own, a unit kept from its forward) still opens its bucket, and
        # _prefetch_ahead below marks the bucket issued. Prefetching the rest only when this unit
        # gathered left every other unit of the bucket to gather alone: one all-gather per unit.
        if bucket is not None and bucket not in passes.issued:
            passes.issued.add(bucket)
            for other in plan.buckets[bucket]:
                if other is not unit:
                    self._step_all(other.records, "prefetch")
        self._issue()
        self._wait(unit)
        if passes is not None:
            passes.order.append(unit.index)
            if bucket is not None:
                self._prefetch_ahead(bucket, plan, passes)

    def _prefetch_ahead(self, bucket: int, plan: Plan, passes: PassState) -> None:
        """Issue the gathers of the next ``prefetch`` buckets (one collective each) not issued yet."""
        passes.issued.add(bucket)
        for ahead in range(bucket + 1, min(bucket + 1 + self.prefetch, len(plan.buckets))):
            if ahead in passes.issued:
                continue
            passes.issued.add(ahead)
            for other in plan.buckets[ahead]:
                self._step_all(other.records, "prefetch")
            self._issue()

    def release(self, unit, keep_graph: bool) -> None:
        self._step_all(unit.records, "release", keep_graph and self.defer_allowed)

    def release_forward_holds(self) -> None:
        """Release every forward hold kept for a backward (see [Note: a forward's hold kept for its backward])."""
        holds, self.forward_holds = self.forward_holds, {}
        for unit in holds.values():
            self.release(unit, False)

    def release_kept(self, units) -> None:
        """Release the forward holds kept for a backward of any of ``units`` (their shards are written)."""
        if self.forward_holds:
            for call, unit in list(self.forward_holds.items()):
                if unit in units:
                    del self.forward_holds[call]
                    self.release(unit, False)

    def _abandon(self, plan: Plan, passes: PassState) -> None:
        """Drop prefetched parameters nobody fetched in a pass that ended."""
        for bucket in passes.issued:
            for unit in plan.buckets[bucket]:
                for rec in unit.records:
                    if rec.state is State.INFLIGHT or (rec.state is State.AVAILABLE and rec.holds == 0):
                        self._step(rec, "abandon")

    # ---------------------------------------------------------------- deferral
    def _defer_all(self, records) -> None:
        for rec in records:
            self._defer(rec)

    def _undefer_all(self, records) -> None:
        for rec in records:
            self._undefer(rec)

    def _defer(self, rec) -> None:
        self.deferred[rec] = None
        self.deferred_bytes += rec.nbytes
        bound = self.max_deferred_bytes
        if bound is not None:
            while self.deferred_bytes > bound and self.deferred:
                self._step(next(iter(self.deferred)), "flush")
        self.peak_deferred_bytes = max(self.peak_deferred_bytes, self.deferred_bytes)

    def _undefer(self, rec) -> None:
        if self.deferred.pop(rec, 0) is None:
            self.deferred_bytes -= rec.nbytes

    def shards_written(self, records, changed, why: str) -> None:
        """The shards of ``records`` are about to be written by ``why`` (``changed``: the ones whose values
        change); see :mod:`paramfsm.engine.shard_writes`."""
        self.emit(Event(SHARDS_WRITTEN, records=records, changed=changed, why=why))

    def write_back(self, records) -> None:
        """Write the held full copies of ``records`` back into their shards (``rt.gathered(writeback=True)``)."""
        self.emit(Event(WRITTEN_BACK, records=records))

    def request_flush(self) -> None:
        """rt.flush(): queued like any event, so it never interleaves with a step in progress."""
        self.emit(Event(FLUSH))

    def flush(self) -> None:
        """Return every deferred parameter (rt.flush(), a new forward, the final backward)."""
        for rec in list(self.deferred):
            self._step(rec, "flush")

    # ---------------------------------------------------------------- handlers
    def _on_forward_begin(self, ev: Event) -> None:
        if ev.graph_task != gt.NO_TASK:
            return  # a forward recomputed inside backward (activation checkpointing)
        if self.forward_open or self.tasks:
            self.recover("the previous forward or backward did not finish (an exception?)")
        if partitioned.REQUIRES_GRAD_CHANGED:
            partitioned.apply_requires_grad_changes(self._records, self.emit)
        self.flush()
        if self.forward_holds:
            self.release_forward_holds()
        self.ctx.step = self.pinned_step if self.pinned_step is not None else self.ctx.step + 1
        self.forward = PassState()
        self.forward_open = True
        self.running.clear()

    def _on_forward_end(self, ev: Event) -> None:
        if ev.graph_task != gt.NO_TASK or not self.forward_open:
            return
        self.forward_open = False
        self._abandon(self.fwd_plan, self.forward)
        self.fwd_plan = self.fwd_plan.updated(self.forward.order)

    def _on_forward_failed(self, ev: Event) -> None:
        """A root forward raised. Inside backward that is how non-reentrant checkpointing stops a
        recomputation early (see paramfsm.engine.backward), not a failure."""
        if ev.graph_task == gt.NO_TASK:
            self.report_failure(None, "forward-exception")

    def _on_pre_forward(self, ev: Event) -> None:
        if ev.graph_task != gt.NO_TASK:
            self._recompute(ev)
            return
        planned = self.forward_open and self.planning
        self.fetch(ev.unit, self.fwd_plan if planned else None, self.forward if planned else None)

    def _on_post_forward(self, ev: Event) -> None:
        call = ev.call
        if call is not None:
            ev.unit.live_graphs += 1
        if ev.graph_task == gt.NO_TASK:
            if call is not None and ev.unit in self.keep_after_forward:
                self.forward_holds[id(call)] = ev.unit  # [Note: a forward's hold kept for its backward]
            else:
                self.release(ev.unit, False)
        # A recomputation keeps its hold until the unit's backward: see [Note: a forward recomputed ...].

    # ---------------------------------------------------------------- called by the runtime
    def hold(self, unit) -> None:
        """Fetch a unit for use outside forward/backward (rt.gathered).

        Deferred copies and units a forward kept for its backward are returned
        first, so the block holds the unit alone and its end releases it.
        """
        if self.forward_holds:
            self.release_forward_holds()
        self.held_outside[unit] = self.held_outside.get(unit, 0) + 1
        for rec in unit.records:
            if rec.state is State.DEFERRED_RELEASE:
                self._step(rec, "flush")
        self.fetch(unit, None, None)

    def unhold(self, unit) -> None:
        self.held_outside[unit] -= 1
        if not self.held_outside[unit]:
            del self.held_outside[unit]
        self.release(unit, False)

    def recover(self, why: str) -> None:
        """Return every parameter to NOT_AVAILABLE after an interrupted forward or backward."""
        log.warning("paramfsm: resetting gathered parameters on rank %d: %s", self.ctx.rank, why)
        self.report_failure(None, "interrupted")
        self._queue.clear()
        self._ready.clear()
        self._ready_task = None
        self.tasks.clear()
        self.forward_open = False
        self.forward_holds.clear()
        self.executor.abort_reduces()
        for rec in self.records:
            self._step(rec, "reset")
        self.held_outside.clear()
        self.running.clear()
        self.staged_grads.clear()
        self.grad_plans.clear()
        self.zero_filled.clear()
