"""The pure lifetime step: the only place a parameter's state is assigned.

``compile_table(spec)`` turns a validated :class:`~paramfsm.core.spec.Spec` into a
frozen lookup table; :func:`step` applies one event to one parameter's
:class:`Lifetime` record and returns the effects the executor must run.

[Note: hot-path dispatch]
A step costs one dict lookup keyed by the state (identity-hashed enum), one
keyed by the interned event name, and, only for guarded pairs, one index into
a 12-entry tuple selected by the extended-state class
``min(holds, 2) * 4 + keep_graph * 2 + retained``. Guards were evaluated for
all twelve classes at compile time, so no guard function runs per event.

[Note: one lookup for a unit]
Events arrive per unit, and the records of a unit are nearly always in the
same situation (same state, same extended-state class). :func:`step_many`
then looks the outcome up once and applies it to every record in one loop:
each record still gets its own state change, hold count, recent-history
entry and trace record, exactly what :func:`step` would have given it in
turn, and the effects (the same for all) are returned once. Records in
different situations get ``None`` back, unchanged, and the caller steps them
one by one.

This module imports neither ``torch`` nor ``cupy``; it is tested in milliseconds.
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections import deque
from typing import Mapping

from paramfsm.core.spec import Residency, Spec, State, extended_states, load_residency_spec, load_spec
from paramfsm.errors import IllegalTransition

TRANSITION, IGNORE, ERROR = "transition", "ignore", "error"
_HOLD_DELTA = {None: None, "+1": 1, "-1": -1, "0": 0}
HISTORY = 6  # events kept per parameter for error messages and leak reports
#: An outcome's tag -> (event, src name, dst name, effects): what history and trace entries name.
TAGS: dict[str, tuple[str, str, str, tuple[str, ...]]] = {}


class Outcome:
    """What one (state, event, extended-state class) does: compiled from one spec row."""

    __slots__ = ("kind", "dst", "effects", "hold", "reset", "reason", "entry", "tag")

    def __init__(self, rule, event: str, src: str, states: type = State):
        self.kind = {TRANSITION: TRANSITION, IGNORE: IGNORE, ERROR: ERROR}[rule.kind]  # the module's constants
        self.dst = states[rule.dst] if rule.dst else None
        self.effects: tuple[str, ...] = rule.effects
        delta = _HOLD_DELTA[rule.holds]
        self.reset = delta == 0
        self.hold = delta if delta else 0
        self.reason = rule.reason
        self.entry = rule.entry
        # What a history entry and a trace entry say of this transition: one string (see TAGS), so
        # the tuples that carry it are never tracked by the garbage collector ([Note: entries the
        # collector never sees] in paramfsm.core.trace).
        self.tag = sys.intern(f"{event}:{src}:{rule.dst or src}:{'+'.join(rule.effects)}")
        TAGS[self.tag] = (event, src, rule.dst or src, rule.effects)

    def __repr__(self) -> str:
        target = f" -> {self.dst.name} {list(self.effects)}" if self.dst else ""
        return f"<Outcome {self.kind}{target} [{self.entry}]>"


class Table:
    """The compiled spec: ``cells[state][event]`` is an Outcome or a 12-tuple of Outcomes.

    ``digest`` identifies what the spec does (see :func:`spec_digest`); traces carry it.
    """

    __slots__ = ("spec", "cells", "events", "digest")

    def __init__(self, spec: Spec, cells: Mapping[State, Mapping[str, object]]):
        self.spec = spec
        self.cells = cells
        self.events = frozenset(spec.events)
        self.digest = spec_digest(spec)

    def outcome(self, state: State, event: str, holds: int, keep_graph: bool, retained: bool) -> Outcome:
        """The outcome for one concrete situation (slow path, for tests and replay)."""
        cell = self.cells[state][event]
        if cell.__class__ is tuple:
            cell = cell[ext_class(holds, keep_graph, retained)]
        return cell


def spec_digest(spec: Spec) -> str:
    """12 hex digits that change exactly when the spec's behaviour does.

    Hashed: the initial state, each state's holder rule, the event names and
    every row's source, event, guards, kind, destination, effects and holder
    change. Docs, reasons and the file's layout are left out, so rewording a
    spec keeps its traces valid.
    """
    content = (
        spec.initial,
        sorted((s.name, s.holds_zero) for s in spec.states.values()),
        sorted(spec.events),
        sorted((r.src, r.event, r.when, r.kind, r.dst or "", r.effects, r.holds or "") for r in spec.rules),
    )
    return hashlib.sha256(repr(content).encode()).hexdigest()[:12]


def ext_class(holds: int, keep_graph: bool, retained: bool) -> int:
    """The index of an extended state among the twelve classes guards can tell apart."""
    return (2 if holds > 1 else holds) * 4 + keep_graph * 2 + retained


def compile_table(spec: Spec) -> Table:
    """Compile one validated machine of a spec (lifetime or residency) into the frozen hot-path table."""
    states = spec.kind.states
    cells: dict = {}
    for state_spec in spec.states.values():
        row: dict[str, object] = {}
        for event in spec.events:
            rules = spec.rules_for(state_spec.name, event)
            by_class: list[Outcome | None] = [None] * 12
            compiled = {id(r): Outcome(r, event, state_spec.name, states) for r in rules}
            for ext in extended_states(state_spec):
                hit = next(r for r in rules if r.matches(*ext))
                by_class[ext_class(*ext)] = compiled[id(hit)]
            distinct = {id(o) for o in by_class if o is not None}
            if len(distinct) == 1:
                row[event] = next(o for o in by_class if o is not None)
            else:
                filler = next(o for o in by_class if o is not None)
                row[event] = tuple(o if o is not None else filler for o in by_class)
        cells[states[state_spec.name]] = row
    return Table(spec, cells)


_DEFAULT: Table | None = None
_RESIDENCY: Table | None = None


def default_table() -> Table:
    """The compiled shipped spec, loaded once per process."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = compile_table(load_spec())
    return _DEFAULT


def residency_table() -> Table:
    """The compiled residency machine of the shipped spec (``[residency]``), loaded once per process."""
    global _RESIDENCY
    if _RESIDENCY is None:
        _RESIDENCY = compile_table(load_residency_spec())
    return _RESIDENCY


class Lifetime:
    """The lifetime part of a parameter's side-table record: state, holders, recent history."""

    __slots__ = ("name", "unit", "nbytes", "state", "holds", "recent")

    def __init__(self, name: str, unit: str, nbytes: int = 0):
        self.name = name
        self.unit = unit
        self.nbytes = nbytes  # bytes of the full parameter, for traces and memory bounds
        self.state = State.NOT_AVAILABLE
        self.holds = 0
        self.recent: deque = deque(maxlen=HISTORY)


class Placement:
    """The residency record of one offloaded value: what the residency machine (``[residency]``) steps.

    To the residency machine what :class:`Lifetime` is to the lifetime machine: the
    same :func:`step` moves both, through their own compiled tables. ``kind`` says
    which value of the parameter it is (see :data:`PLACEMENT_KINDS`).
    """

    __slots__ = ("name", "unit", "kind", "nbytes", "state", "holds", "recent", "__weakref__")
    machine = "residency"  # which machine's records these are, in traces and messages

    def __init__(self, name: str, unit: str, kind: str, nbytes: int = 0):
        if kind not in PLACEMENT_KINDS:
            raise ValueError(f"a placement's kind is one of {tuple(PLACEMENT_KINDS)}, not {kind!r}")
        self.name = name
        self.unit = unit
        self.kind = kind
        self.nbytes = nbytes  # bytes of the value on this rank
        self.state = Residency.DIRTY
        self.holds = 0  # the residency machine counts no holders; step() reads it
        self.recent: deque = deque(maxlen=HISTORY)

    @property
    def what(self) -> str:
        """The value in words, for messages: "shard", "shard gradient" or "optimizer state"."""
        return PLACEMENT_KINDS[self.kind]

    def __repr__(self) -> str:
        return f"<Placement {self.kind} of {self.name!r} [{self.unit}] {self.state.name}>"


#: What a placement's ``kind`` may be (a parameter's shard, its shard gradient, its optimizer state), in words.
PLACEMENT_KINDS = {"shard": "shard", "grad": "shard gradient", "optim": "optimizer state"}


class StepContext:
    """Who is stepping: rank, training step, current graph task, and the trace (or None when off).

    ``pinned`` is the training step named by ``rt.set_step`` (None: each root forward counts one).
    """

    __slots__ = ("rank", "step", "pinned", "graph_task", "trace")

    def __init__(self, rank: int = 0, trace=None):
        self.rank = rank
        self.step = 0
        self.pinned: int | None = None
        self.graph_task = -1
        self.trace = trace


def step(table: Table, rec: Lifetime, event: str, ctx: StepContext,
         keep_graph: bool = False, retained: bool = False) -> tuple[str, ...]:
    """Apply ``event`` to ``rec``; return the effects to run. Raises IllegalTransition.

    On an ``ignore`` row nothing changes and no effects are returned. On an
    ``error`` row, or an event the spec does not know, the record is left
    unchanged and :class:`IllegalTransition` is raised.
    """
    src = rec.state
    try:
        cell = table.cells[src][event]
    except KeyError:
        raise _illegal(rec, event, ctx, f"the spec has no event {event!r}") from None
    if cell.__class__ is tuple:
        holds = rec.holds
        cell = cell[(2 if holds > 1 else holds) * 4 + keep_graph * 2 + retained]
    kind = cell.kind
    if kind is TRANSITION:
        holds_before = rec.holds
        rec.state = cell.dst
        rec.holds = 0 if cell.reset else holds_before + cell.hold
        rec.recent.append((ctx.step, ctx.graph_task, cell.tag))
        trace = ctx.trace
        if trace is not None:
            trace.append(time.perf_counter_ns(), ctx, rec, cell, keep_graph, retained, holds_before)
        return cell.effects
    if kind is IGNORE:
        return ()
    raise _illegal(rec, event, ctx, f"{cell.reason} [{cell.entry}]")


def step_many(table: Table, records, event: str, ctx: StepContext,
              keep_graph: bool = False, retained: bool = False) -> tuple[str, ...] | None:
    """Apply ``event`` to every record of ``records``, when they share one situation.

    The same as :func:`step` on each record in turn (see [Note: one lookup for
    a unit]): the effects every record must run are returned once, ``()`` on an
    ``ignore`` row, and an ``error`` row raises for the first record with
    nothing changed. When the records are not all in the same state and
    extended-state class, nothing changes and None is returned.
    """
    first = records[0]
    src = first.state
    try:
        cell = table.cells[src][event]
    except KeyError:
        raise _illegal(first, event, ctx, f"the spec has no event {event!r}") from None
    holds = first.holds
    uniform = True  # every record holds exactly as many holders as the first
    if cell.__class__ is tuple:
        ext = 2 if holds > 1 else holds
        for rec in records:
            other = rec.holds
            if rec.state is not src or (2 if other > 1 else other) != ext:
                return None
            if other != holds:
                uniform = False
        cell = cell[ext * 4 + keep_graph * 2 + retained]
    else:
        for rec in records:
            if rec.state is not src:
                return None
            if rec.holds != holds:
                uniform = False
    kind = cell.kind
    if kind is TRANSITION:
        trace = ctx.trace
        if trace is not None:
            trace.append_many(time.perf_counter_ns(), ctx, records, cell, keep_graph, retained,
                              holds if uniform else tuple([rec.holds for rec in records]))
        dst = cell.dst
        entry = (ctx.step, ctx.graph_task, cell.tag)
        if cell.reset:
            for rec in records:
                rec.state = dst
                rec.holds = 0
                rec.recent.append(entry)
        else:
            hold = cell.hold
            for rec in records:
                rec.state = dst
                rec.holds += hold
                rec.recent.append(entry)
        return cell.effects
    if kind is IGNORE:
        return ()
    raise _illegal(first, event, ctx, f"{cell.reason} [{cell.entry}]")


def history(rec: Lifetime) -> list[tuple]:
    """``rec``'s recent transitions, oldest first, as (step, graph task, event, src, dst) with states."""
    states = type(rec.state)
    return [(s, g, event, states[src], states[dst]) for s, g, (event, src, dst, _) in map(_untag, rec.recent)]


def _untag(entry: tuple) -> tuple:
    step, graph_task, tag = entry
    return step, graph_task, TAGS[tag]


def _illegal(rec: Lifetime, event: str, ctx: StepContext, reason: str) -> IllegalTransition:
    recent = [f"step {s} graph_task {g}: {e}: {a} -> {b}" for s, g, (e, a, b, _) in map(_untag, rec.recent)]
    if getattr(rec, "machine", "") == "residency":
        reason = f"the residency of its {rec.what}: {reason}"
    return IllegalTransition(param=rec.name, unit=rec.unit, state=rec.state.name, event=event,
                             rank=ctx.rank, reason=reason, holds=rec.holds, history=recent)
