"""Backward graph tasks: gradient holds, recomputation, retained graphs.

:class:`GraphTasks` owns the running graph tasks and the queue of accumulated
gradients; the scheduler constructs it and dispatches the backward events to
it. It fetches through the prefetch, releases through the deferral, hands
kept forward holds over and asks the gradient routing to plan and send.

[Note: one backward = one graph task]
Pre-backward work happens in *every* graph task that reaches a unit: the
task id comes with each backward event, and the first event of a task
queues that task's final callback. Nothing is remembered "per process" or
"per forward", which is exactly the once-per-process bug this project exists
to make impossible.

[Note: the pending gradient is a holder]
Pre-backward takes, besides the unit's hold, one hold per parameter that
requires grad, released when autograd has accumulated that parameter's
gradient for the graph task (``GRAD_READY``) or at the task's end. So a
parameter stays gathered until its ``AccumulateGrad`` ran (which needs the
full tensor: the seed bug's "size of tensor a (0)" message), and a tied
parameter stays gathered between its uses instead of being re-gathered.

[Note: a forward recomputed inside backward belongs to its graph task]
Activation checkpointing re-runs forwards inside a backward, and the unit's
own backward follows right after. A recomputation therefore fetches like the
backward does: at the outermost graph task it follows the backward plan
(buckets and prefetch, recorded in the order the recomputation and the
backward fetch units), and its hold is kept until that unit's post-backward,
in whatever graph task it comes (reentrant checkpointing runs the unit's
backward in a nested task), so the backward finds the unit gathered: one
all-gather serves both. Non-reentrant ``torch.utils.checkpoint`` stops a
recomputation early (it raises inside the last saved-tensor hook it needs),
so a unit's post-forward may never come; that changes nothing here. Holds
of units whose post-backward never comes (no input requires grad) are
counted per graph task (``recomputing``) and released when it ends, like
``open``. A recomputation that finds a unit deferred uses the copy kept for
this backward, so its release defers the unit again (``redefer``).

[Note: what a recomputation defers]
Released inside a backward that keeps its graph, a parameter is deferred for
the next backward over that graph, which must then still be alive. Under
reentrant checkpointing the unit's backward runs in a nested task over the
recomputed graph, which that task frees, while the outer graph only keeps the
checkpoint's inputs (the next backward recomputes again). So a
recomputation's hold is released deferred only when the task that ran the
unit's backward keeps its graph as well, and a hold left at the end of a
task only when the unit still has a live graph.

[Note: reduce-scatters finish with the outermost backward]
A nested graph task (the backward that reentrant checkpointing runs inside
the outer one) does not complete the reduce-scatters: its gradients join the
outer backward's buckets, and everything is completed once, when the
outermost task ends. Nothing reads shard gradients in between.

[Note: accumulated gradients are stepped together]
``GRAD_READY`` comes once per parameter, from its post-accumulate-grad hook,
and a unit's parameters finish within one node's backward. So the event is
queued (``_ready``) and every queued parameter is stepped at once
(``grad_ready`` for all of them, then the releases of their gradient holds,
one table lookup each: see [Note: one lookup for a unit]) just before the
scheduler applies its next event of any other kind: the unit's post-backward,
the next unit's pre-backward, or the end of the graph task, which always
comes. Relative to every other event the order is unchanged, and so is each
parameter's own sequence of transitions; the gradient leaves the parameter
at most one event later. A parameter that is queued again, or one of
another graph task, drains the queue first, so each parameter is stepped
once per drain with the holders it really has.

[Note: an interrupted backward's queued gradients]
The end of a graph task does not come when the backward raises (in a user's
``autograd.Function``, in a checkpoint's recomputation): autograd runs no
final callback. Gradients queued then were accumulated into their full
parameters and never left them. When every parameter of the model is one
unit (small modules merged into the root), no other event follows inside
that backward, so the whole queue is still there. Recovery (``rt.reset()``,
or the next root forward finding the task unfinished) must neither step
them (they would be reduce-scattered into the shard gradients after the
user's ``zero_grad``) nor leave them on the parameters (the next backward
would add to them): it takes them off and drops them, like every other
gradient of the interrupted backward. So the scheduler does not drain the
queue before a root forward that finds a graph task unfinished.
"""

from __future__ import annotations

from paramfsm.core.spec import State
from paramfsm.engine.events import graph_task as gt
from paramfsm.engine.events.events import BACKWARD_END, Event, ForwardCall
from paramfsm.engine.schedule.plan import PassState


class GraphTasks:
    """Handlers of PRE_BACKWARD, POST_BACKWARD, GRAD_READY, BACKWARD_END, GRAPH_FREED and recomputation."""

    __slots__ = ("_ctx", "_emit", "_step", "_step_all", "_prefetch", "_deferral", "_holds", "_grads", "_done",
                 "tasks", "tasks_begun", "_ready", "_ready_task", "_ready_graph_task")

    def __init__(self, ctx, emit, step, step_all, ready: dict, *, prefetch, deferral, holds, grads, done):
        self._ctx, self._emit, self._step, self._step_all = ctx, emit, step, step_all
        self._prefetch, self._deferral, self._holds, self._grads = prefetch, deferral, holds, grads
        self._done = done  # called after the final (non-retained) outermost backward: flush and audit
        self.tasks: dict[int, TaskState] = {}
        self.tasks_begun = 0
        # Parameters whose GRAD_READY is queued (the scheduler's queue, which it has drained before it
        # applies an event of any other kind), and their task: [Note: accumulated gradients are stepped together].
        self._ready = ready
        self._ready_task = self._ready_graph_task = None

    # ------------------------------------------------------------ asked by the others
    def running(self) -> bool:
        """Whether a backward is in progress."""
        return bool(self.tasks)

    def last_open(self, task: int):
        """The last unit whose backward began in ``task`` and has not ended (the on-demand reader)."""
        ts = self.tasks.get(task)
        if ts is not None:
            for unit, count in reversed(ts.open.items()):
                if count > 0:
                    return unit
        return None

    def holds_on(self, unit) -> int:
        """How many holds the running backwards have on ``unit`` (pre-backward fetches and recomputations)."""
        return sum(ts.open.get(unit, 0) + ts.recomputing.get(unit, 0) for ts in self.tasks.values())

    def borrowed(self, task: int, unit, rec) -> None:
        """``unit`` borrowed ``rec`` on demand: if its backward began already, the gradient hold is taken now
        ([Note: the pending gradient is a holder])."""
        ts = self.tasks.get(task)
        if ts is not None and ts.open.get(unit, 0) > 0 and rec.requires_grad and rec not in ts.grad_holds:
            ts.grad_holds[rec] = None
            self._step(rec, "fetch")

    def grads_done(self, records) -> None:
        """Gradients of ``records`` went out (zero-filled) in the task in progress: release their holds."""
        ts = self.tasks.get(self._ctx.graph_task)
        if ts is None:
            return
        holds = ts.grad_holds
        self._deferral.release_records([rec for rec in records if holds.pop(rec, 0) is None], ts.keep_graph)

    # ------------------------------------------------------------ handlers
    def on_pre_backward(self, ev: Event) -> None:
        ts = self._begin_task(ev.graph_task, ev.keep_graph)
        if ev.call in ts.seen:
            return
        ts.seen.add(ev.call)
        unit = ev.unit
        ts.open[unit] = ts.open.get(unit, 0) + 1
        self._prefetch.fetch_backward(unit, ts.passes, ts.depth == 0)
        self._holds.hand_over(id(ev.call))  # the backward holds it now: see paramfsm.engine.schedule.holds
        holds = ts.grad_holds
        waiting = [rec for rec in unit.records if rec.requires_grad and rec not in holds]
        for rec in waiting:
            holds[rec] = None
        self._step_all(waiting, "fetch")
        self._grads.expect_grads(unit, ev.graph_task)

    def on_param_reached(self, ev: Event) -> None:
        """A parameter is about to accumulate its gradient in a graph task that may not have fetched its
        unit (see [Note: a backward that enters a unit from inside] in paramfsm.engine.events.hooks)."""
        if ev.record.state is State.NOT_AVAILABLE or ev.record.state is State.INFLIGHT:
            ev.call = ev.unit
            self.on_pre_backward(ev)

    def on_post_backward(self, ev: Event) -> None:
        ts = self._begin_task(ev.graph_task, ev.keep_graph)
        unit = ev.unit
        if ts.open.get(unit, 0) > 0:
            ts.open[unit] -= 1
            self._deferral.release(unit, ts.keep_graph)
        for owner in self.tasks.values():  # the recomputation's holds end with the unit's backward
            count = owner.recomputing.pop(unit, 0)
            # Deferred only when this backward keeps its graph too: see [Note: what a recomputation defers].
            keep = (owner.keep_graph and ts.keep_graph) or unit in owner.redefer
            for _ in range(count):
                self._deferral.release(unit, keep)

    def recompute(self, ev: Event) -> None:
        """A unit's forward re-run inside backward (activation checkpointing)."""
        ts = self._begin_task(ev.graph_task, gt.keeps_graph())
        unit = ev.unit
        ts.recomputing[unit] = ts.recomputing.get(unit, 0) + 1
        if self._deferral.defers() and all(rec.state is State.DEFERRED_RELEASE for rec in unit.records):
            ts.redefer.add(unit)
        self._prefetch.fetch_backward(unit, ts.passes, ts.depth == 0)

    def on_grad_ready(self, ev: Event) -> None:
        """Queue a parameter whose gradient autograd accumulated: see [Note: accumulated gradients are
        stepped together]."""
        ts = self._begin_task(ev.graph_task, ev.keep_graph)
        ready = self._ready
        if ready and (ts is not self._ready_task or ev.record in ready):
            self.drain_ready()
        ready[ev.record] = None
        self._ready_task, self._ready_graph_task = ts, ev.graph_task

    def drain_ready(self) -> None:
        """Step every queued ``GRAD_READY``: ``grad_ready`` (its gradient leaves for the reduce bucket),
        then the release of its gradient hold."""
        records, ts = tuple(self._ready), self._ready_task
        self._ready.clear()
        self._ready_task = None  # it holds the task's forward calls, which must be free to be collected
        ctx = self._ctx
        current, ctx.graph_task = ctx.graph_task, self._ready_graph_task
        self._step_all(records, self._grads.grad_event())
        holds = ts.grad_holds
        self._deferral.release_records([rec for rec in records if holds.pop(rec, 0) is None], ts.keep_graph)
        ctx.graph_task = current

    def on_backward_end(self, ev: Event) -> None:
        ts = self.tasks.pop(ev.graph_task, None)
        if ts is None:
            return
        self._grads.close_task(ev.graph_task)  # [Note: a unit's gradients go out in the unit's order]
        release = self._deferral.release
        for held in (ts.open, ts.recomputing):
            for unit, count in reversed(list(held.items())):
                for _ in range(count):
                    keep = ts.keep_graph and (held is ts.open or unit.live_graphs > 0)
                    release(unit, keep or (held is ts.recomputing and unit in ts.redefer))
        for rec in ts.grad_holds:
            self._deferral.release_one(rec, ts.keep_graph)
        if not self.tasks:  # [Note: reduce-scatters finish with the outermost backward]
            self._grads.sync_kept()
        if ts.depth == 0:
            self._prefetch.end_backward(ts.passes)
        if not ts.keep_graph:
            self._consume(ts)
        if not self.tasks and not ts.keep_graph:
            self._done()

    def _consume(self, ts: TaskState) -> None:
        """A backward that did not keep its graph freed the saved tensors of every forward call it
        reached: those calls can retain nothing any more, even while the user holds their outputs."""
        for call in ts.seen:
            if type(call) is ForwardCall and call.live:
                call.live = False  # counted out now: its collection reports nothing
                call.unit.live_graphs -= 1

    def on_graph_freed(self, ev: Event) -> None:
        unit = ev.unit
        self._holds.hand_over(ev.call)  # no backward came: see paramfsm.engine.schedule.holds
        unit.live_graphs -= 1
        if unit.live_graphs > 0:
            return
        for rec in unit.records:
            if rec.state is State.DEFERRED_RELEASE:
                retained = any(u.live_graphs > 0 for u in rec.units)
                self._step(rec, "graph_freed", retained=retained)

    def _begin_task(self, task: int, keep_graph: bool) -> TaskState:
        ts = self.tasks.get(task)
        if ts is None:
            ts = self.tasks[task] = TaskState(keep_graph, len(self.tasks))
            self.tasks_begun += 1
            emit = self._emit
            gt.queue_final_callback(lambda: emit(Event(BACKWARD_END, graph_task=task)))
        return ts

    def reset(self) -> None:
        """Forget every task and queued gradient (the recovery after an interrupted backward).

        A queued gradient still sits on its full parameter, where autograd accumulated it: it is
        taken off, or the next backward would add to it (see [Note: an interrupted backward's
        queued gradients]).
        """
        self.tasks.clear()
        self._grads.drop(tuple(self._ready))
        self.clear_ready()

    def clear_ready(self) -> None:
        self._ready.clear()
        self._ready_task = None


class TaskState:
    """Bookkeeping of one running backward graph task."""

    __slots__ = ("keep_graph", "depth", "open", "recomputing", "redefer", "seen", "passes", "grad_holds")

    def __init__(self, keep_graph: bool, depth: int):
        self.keep_graph = keep_graph
        self.depth = depth  # tasks already running when this one began (0: not nested)
        self.open: dict = {}  # unit -> pre-backward fetches not yet released
        self.recomputing: dict = {}  # unit -> forwards recomputed in this task, not yet ended
        self.redefer: set = set()  # units a recomputation found deferred (released back to deferral)
        self.seen: set = set()  # forward calls whose pre-backward already ran in this task
        self.passes = PassState()
        self.grad_holds: dict = {}  # record -> None: parameters whose gradient is still to come
