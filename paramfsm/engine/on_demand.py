"""Parameters read outside their unit: gathered on demand, then borrowed by the unit that read them.

A module's forward may read a parameter of another unit directly: an output
layer tied through ``F.linear(h, self.emb.weight)``, a block that reads a
child's weight instead of calling the child. The parameter is empty there
(its unit is not running), so its placeholder (:mod:`paramfsm.engine.placeholder`)
asks :func:`gather` for it before it would raise ``NotGathered``.

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

from torch.utils.weak import WeakIdKeyDictionary

from paramfsm.core.spec import State
from paramfsm.engine import graph_task as gt
from paramfsm.engine import partitioned
from paramfsm.engine.events import DEMAND, Event

log = logging.getLogger(__name__)

#: partitioned parameter -> the scheduler that drives it (weakly keyed: never keeps a model alive).
SCHEDULERS = WeakIdKeyDictionary()


class ReadOutsideUnit(UserWarning):
    """A parameter was read by another unit's forward or backward and gathered on demand."""


def watch(records, scheduler) -> None:
    """Let the placeholders of ``records`` ask ``scheduler`` for on-demand gathers."""
    for rec in records:
        SCHEDULERS[rec.param] = scheduler


def gather(param) -> bool:
    """Gather the empty parameter ``param`` for the unit reading it; False when no unit is running."""
    scheduler = SCHEDULERS.get(param)
    return scheduler is not None and scheduler.demand(param)


class OnDemandHandlers:
    """The scheduler's part: the running units, the ``DEMAND`` event and the borrowing."""

    def demand(self, param) -> bool:
        """Emit ``DEMAND`` for ``param`` if a unit is reading it now; True once it is gathered."""
        rec = partitioned.record_of(param)
        if rec is None or rec not in self._records or self.closed or self._draining:
            return False
        if rec.state not in (State.NOT_AVAILABLE, State.INFLIGHT):
            return False
        task = gt.current_task()
        reader = self.reading_unit(task)
        if reader is None or reader in rec.units:
            return False  # no unit runs, or the parameter's own unit runs without it: NotGathered
        self.emit(Event(DEMAND, None, task, task != gt.NO_TASK and gt.keeps_graph(), rec))
        if reader in rec.units and (rec.name, reader.name) not in self.warned:
            self.warned.add((rec.name, reader.name))
            # stacklevel: the user's forward <- placeholder <- its generator <- gather <- here
            warnings.warn(ReadOutsideUnit(read_outside_message(rec, reader)), stacklevel=5)
        return rec.state is State.AVAILABLE

    def reading_unit(self, task: int):
        """The innermost unit running its forward in ``task``, else the last one whose backward began."""
        for unit, running_in in reversed(self.running):
            if running_in == task:
                return unit
        ts = self.tasks.get(task)
        if ts is not None:
            for unit, count in reversed(ts.open.items()):
                if count > 0:
                    return unit
        return None

    def enter_forward(self, ev: Event) -> None:
        """``PRE_FORWARD``: note the unit as running, then fetch it (``_on_pre_forward``)."""
        self.running.append((ev.unit, ev.graph_task))
        self._on_pre_forward(ev)

    def leave_forward(self, ev: Event) -> None:
        """``POST_FORWARD``: the unit no longer runs; release it (``_on_post_forward``)."""
        running, entry = self.running, (ev.unit, ev.graph_task)
        for i in range(len(running) - 1, -1, -1):
            if running[i] == entry:
                del running[i]
                break
        self._on_post_forward(ev)

    def _on_demand(self, ev: Event) -> None:
        rec, task = ev.record, ev.graph_task
        reader = self.reading_unit(task)
        if reader is None or rec.state not in (State.NOT_AVAILABLE, State.INFLIGHT):
            return  # the demand found nothing to do: the placeholder raises NotGathered
        holders = self._holders(reader, task)
        reader.records = reader.records + (rec,)
        reader.nbytes += rec.nbytes
        rec.units = rec.units + (reader,)
        for _ in range(holders):
            self._step(rec, "demand")
        self._issue()
        self._wait(reader)
        ts = self.tasks.get(task)
        if ts is not None and ts.open.get(reader, 0) > 0 and rec.requires_grad and rec not in ts.grad_holds:
            ts.grad_holds[rec] = None  # its backward began already: [Note: the pending gradient is a holder]
            self._step(rec, "fetch")

    def _holders(self, unit, task: int) -> int:
        """How many holds ``unit`` has now: one per fetch that its release will match."""
        count = sum(1 for u, t in self.running if u is unit and t == gt.NO_TASK)
        count += self.held_outside.get(unit, 0)
        for ts in self.tasks.values():
            count += ts.open.get(unit, 0) + ts.recomputing.get(unit, 0)
        return max(count, 1)


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
