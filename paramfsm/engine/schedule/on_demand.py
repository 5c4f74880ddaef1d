"""Parameters read outside their unit: gathered on demand, then borrowed by the unit that read them.

A module's forward may read a parameter of another unit directly: an output
layer tied through ``F.linear(h, self.emb.weight)``, a block that reads a
child's weight instead of calling the child. The parameter is empty there
(its unit is not running), so its placeholder (:mod:`paramfsm.engine.storage.placeholder`)
asks :meth:`OnDemand.demand` for it before it would raise ``NotGathered``.

[Note: a read outside the unit is a dynamic tie]
The scheduler finds the *reading unit*: the innermost unit whose forward is
running in the current graph task (a root forward, or a recomputation inside
backward), else the unit whose backward most recently began in that task.
The parameter is then treated exactly like a tied weight that the reading
unit had owned from the start: the reading unit borrows its record (the
record joins ``unit.records`` and the unit joins ``record.units``), and the
``demand`` event of the spec gathers it at once with one hold per holder the
reading unit has at that moment (so every later release of the unit, which
now releases the record too, is matched). From then on the reading unit's
fetch, release, pre-backward and post-backward include it, so:

* its backward finds the weight gathered (pre-backward fetches it), and its
  gradient is reduce-scattered exactly once per backward, after its last use
  (the gradient hold of [Note: the pending gradient is a holder] is taken once
  per parameter, whichever unit takes it first);
* it is released with the unit that read it, and freed when its last holder
  lets go.

Every rank runs the same forward, so every rank discovers the read at the
same point and issues the same extra all-gather: the collectives stay
paired. The discovery costs one all-gather, once; later passes gather the
parameter with the reading unit's bucket. Outside any forward or backward
there is no reading unit, and ``NotGathered`` is raised as before.

[Note: on-demand gathers never mask a lifetime bug]
A unit is noted as running when its ``PRE_FORWARD`` arrives, before the
scheduler fetches it (``enter_forward`` wraps the fetch), so a parameter
found empty while *its own* unit runs (its fetch went wrong) is not
gathered on demand: ``NotGathered`` says so, as it always did.
"""

from __future__ import annotations

import logging
import warnings

from paramfsm.core.spec import State
from paramfsm.engine.events import graph_task as gt
from paramfsm.engine.events.events import DEMAND, Event
from paramfsm.engine.storage import partitioned

log = logging.getLogger(__name__)


#: The states in which a read outside the unit borrows the parameter: empty (its guard asks: gathered now) or
#: kept gathered for its unit's backward (its watching class asks: nothing to gather; see [Note: a read of a kept
#: parameter outside its unit] in paramfsm.engine.storage.placeholder).
_READABLE = (State.NOT_AVAILABLE, State.INFLIGHT, State.AVAILABLE)


class ReadOutsideUnit(UserWarning):
    """A parameter was read by another unit's forward or backward and gathered on demand."""


class OnDemand:
    """The running units, the ``DEMAND`` event and the borrowing; see the module docstring.

    It owns the units whose forward runs and the reads already warned about; it
    asks the graph tasks and the holds how many holders a unit has.
    """

    __slots__ = ("_mine", "_accepting", "_emit", "_step", "_prefetch", "_graph", "_holds", "forwards", "warned",
                 "__weakref__")  # the placeholders hold its demand weakly: [Note: the demand table holds nothing alive]

    def __init__(self, mine, accepting, emit, step, prefetch, holds):
        self._mine, self._accepting, self._emit, self._step = mine, accepting, emit, step
        self._prefetch, self._holds = prefetch, holds
        self._graph = None  # the graph tasks (paramfsm.engine.schedule.backward), set by the scheduler
        self.forwards: list = []  # (unit, graph task) of the forwards in progress
        self.warned: set = set()  # (parameter, reading unit) reads outside a unit already warned about

    def attach(self, graph) -> None:
        """The graph tasks it asks (constructed after it, since they call it too)."""
        self._graph = graph

    def demand(self, param) -> bool:
        """Emit ``DEMAND`` for ``param`` if a unit is reading it now; True once it is gathered
        (the placeholders' callback: :func:`paramfsm.engine.storage.placeholder.answer_demands`)."""
        rec = partitioned.record_of(param)
        if rec is None or rec not in self._mine or not self._accepting():
            return False
        if rec.state not in _READABLE:
            return False
        task = gt.current_task()
        reader = self.reading_unit(task)
        if reader is None or reader in rec.units:
            return False  # no unit runs, or the parameter's own unit runs without it: NotGathered
        self._emit(Event(DEMAND, None, task, task != gt.NO_TASK and gt.keeps_graph(), rec))
        if reader in rec.units and (rec.name, reader.name) not in self.warned:
            self.warned.add((rec.name, reader.name))
            # stacklevel: the user's forward <- placeholder <- its generator <- gather <- here
            warnings.warn(ReadOutsideUnit(read_outside_message(rec, reader)), stacklevel=5)
        return rec.state is State.AVAILABLE

    def reading_unit(self, task: int):
        """The innermost unit running its forward in ``task``, else the last one whose backward began."""
        for unit, running_in in reversed(self.forwards):
            if running_in == task:
                return unit
        return self._graph.last_open(task)

    def entered(self, unit, task: int) -> None:
        """``PRE_FORWARD``: the unit runs (noted before its fetch: [Note: on-demand gathers never mask a
        lifetime bug])."""
        self.forwards.append((unit, task))

    def left(self, unit, task: int) -> None:
        """``POST_FORWARD``: the unit no longer runs."""
        running, entry = self.forwards, (unit, task)
        for i in range(len(running) - 1, -1, -1):
            if running[i] == entry:
                del running[i]
                break

    def demanded(self, ev: Event) -> None:
        rec, task = ev.record, ev.graph_task
        reader = self.reading_unit(task)
        if reader is None or rec.state not in _READABLE:
            return  # the demand found nothing to do: the placeholder raises NotGathered
        holders = self._holders(reader)
        reader.records = reader.records + (rec,)
        reader.nbytes += rec.nbytes
        rec.units = rec.units + (reader,)
        for _ in range(holders):
            self._step(rec, "demand")
        self._prefetch.issue()
        self._prefetch.wait(reader)
        self._graph.borrowed(task, reader, rec)

    def _holders(self, unit) -> int:
        """How many holds ``unit`` has now: one per fetch that its release will match."""
        count = sum(1 for u, t in self.forwards if u is unit and t == gt.NO_TASK)
        count += self._holds.outside_count(unit) + self._graph.holds_on(unit)
        return max(count, 1)

    def reset(self) -> None:
        self.forwards.clear()


def read_outside_message(rec, reader) -> str:
    """What the warning says: the parameter, the reader, and the ``units=`` that avoids the extra gather."""
    owner_module = rec.name.rpartition(".")[0]
    reader_module = "" if reader.name == "<root>" else reader.name
    return (f"parameter '{rec.name}' (unit '{rec.unit}') was read by the forward or backward of unit "
            f"'{reader.name}' outside its own unit; paramfsm gathered it on demand (one extra all-gather, "
            f"once) and gathers it with '{reader.name}' from now on. Faster and simpler: make them one unit, "
            f"e.g. paramfsm.shard(model, units={suggest_units(owner_module, reader_module)}) "
            "(written for the default units; adapt it to yours).")


def suggest_units(owner_module: str, reader_module: str) -> str:
    """A ``units=`` predicate under which ``reader_module``'s unit owns ``owner_module``'s parameters."""
    default = "any(True for _ in module.parameters(recurse=False))"
    if reader_module == "" or owner_module.startswith(reader_module + "."):
        # the reader encloses the owner: no unit between them, so the owner's parameters go to the reader
        below = owner_module[len(reader_module) + 1:] if reader_module else owner_module
        parts = below.split(".")
        path = tuple((f"{reader_module}." if reader_module else "") + ".".join(parts[:i + 1])
                     for i in range(len(parts)))
        return f"lambda name, module: name not in {path!r} and {default}"
    common = _common(owner_module, reader_module)
    if common == "":
        return "lambda name, module: name == ''"
    return (f"lambda name, module: name == {common!r} or (not name.startswith({common + '.'!r}) "
            f"and {default})")


def _common(a: str, b: str) -> str:
    parts = []
    for x, y in zip(a.split("."), b.split(".")):
        if x != y:
            break
        parts.append(x)
    return ".".join(parts)
