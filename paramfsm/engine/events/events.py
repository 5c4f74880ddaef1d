"""The vocabulary between hooks and the scheduler: event kinds, events and forward calls.

Hooks create :class:`Event` objects and hand them to ``Scheduler.emit``; they
decide nothing. This module has no behaviour of its own, so both sides can
import it without importing each other.
"""

from __future__ import annotations

from paramfsm.engine.events import graph_task as gt

FORWARD_BEGIN, FORWARD_END, FORWARD_FAILED = "forward_begin", "forward_end", "forward_failed"
PRE_FORWARD, POST_FORWARD = "pre_forward", "post_forward"
PRE_BACKWARD, POST_BACKWARD = "pre_backward", "post_backward"
GRAD_READY, BACKWARD_END, GRAPH_FREED = "grad_ready", "backward_end", "graph_freed"
FLUSH = "flush"
DEMAND = "demand"  # a parameter read outside its unit (paramfsm.engine.schedule.on_demand)
# Shards written from elsewhere (an optimizer step, a load, init), and a write-back from rt.gathered:
# the event carries the records (paramfsm.engine.schedule.shard_writes).
SHARDS_WRITTEN, WRITTEN_BACK = "shards_written", "written_back"
# A parameter of a unit that calls other units is about to accumulate a gradient (paramfsm.engine.events.hooks).
PARAM_REACHED = "param_reached"


class Event:
    """What a hook saw: its kind, the unit (or record), the graph task and whether it keeps its graph.

    ``records``: the parameters a shard write names (``SHARDS_WRITTEN``, ``WRITTEN_BACK``),
    ``changed`` the parameters among them whose values it changes, and ``why`` what wrote them,
    for error messages (see :mod:`paramfsm.engine.schedule.shard_writes`).
    """

    __slots__ = ("kind", "unit", "graph_task", "keep_graph", "record", "call", "records", "changed", "why")

    def __init__(self, kind, unit=None, graph_task=gt.NO_TASK, keep_graph=False, record=None, call=None,
                 records=(), changed=(), why=""):
        self.kind, self.unit, self.graph_task, self.keep_graph = kind, unit, graph_task, keep_graph
        self.record, self.call, self.records, self.changed, self.why = record, call, records, changed, why

    def __repr__(self) -> str:
        target = self.unit.name if self.unit is not None else getattr(self.record, "name", "")
        return f"<Event {self.kind} {target} task={self.graph_task} keep_graph={self.keep_graph}>"


class ForwardCall:
    """One forward call of a unit whose outputs joined an autograd graph.

    It is referenced only by the gradient hooks on those outputs (and the
    post-backward node), so it lives exactly as long as the graph does.
    ``after`` lists the units whose post-backward rides on the same hooks (see
    [Note: a chain of units shares one hook] in :mod:`paramfsm.engine.events.hooks`).
    ``live`` is cleared by the scheduler when a backward that did not keep its
    graph consumed the call: its collection then has nothing left to report.
    """

    __slots__ = ("unit", "emit", "after", "live")

    def __init__(self, unit, emit):
        self.unit, self.emit = unit, emit
        self.after = None
        self.live = True

    def __del__(self):
        if not self.live:
            return
        try:
            self.emit(Event(GRAPH_FREED, self.unit, call=id(self)))
        except Exception:  # noqa: BLE001 - a finaliser must not raise (e.g. at interpreter exit)
            pass
