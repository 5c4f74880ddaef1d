"""Load and validate the declarative lifetime spec (``specs/param_lifetime.toml``).

The spec is data: states, events, and one row per (state, event[, guards]) that
is a transition, an ``ignore`` or an ``error``. This module checks it once, at
load time, and fails with a :class:`SpecError` that names the file and the
entry. :mod:`paramfsm.core.fsm` compiles the validated spec into the hot-path table;
:mod:`paramfsm.core.machine` builds the equivalent ``transitions`` Machine.

Guards are evaluated over a small extended state ``(holds, keep_graph,
retained)``. Because ``holds`` only matters as 0, 1 or "2 or more", the
extended state has twelve classes, so totality and guard overlap are checked
exhaustively rather than by argument.

The shipped spec is package data: a wheel carries ``specs/*.toml`` as
``paramfsm/specs/`` (``setup.py`` copies them at build time, so the
repository's ``specs/`` stays the one source) and :func:`shipped_spec` finds
it through ``importlib.resources``. An editable install or a bare checkout has
no such copy; there the same function reads the ``specs/`` folder that sits
next to the package.

This module imports neither ``torch.distributed`` nor ``cupy``.
"""

from __future__ import annotations

import enum
import importlib.resources
import reprlib
import tomllib
from pathlib import Path
from typing import Callable, Iterator, Mapping

import attrs

from paramfsm.core.spec_table import check_reachable, check_table, extended_states  # noqa: F401 (re-exported)
from paramfsm.errors import SpecError


def shipped_spec(name: str = "param_lifetime.toml") -> Path:
    """Path of a spec shipped with paramfsm: the package's copy, else the checkout's ``specs/``.

    When neither exists the package's path is returned, so the error names where an installed
    paramfsm should have its spec.
    """
    package = Path(importlib.resources.files("paramfsm"))
    packaged, checkout = package / "specs" / name, package.parent / "specs" / name
    return checkout if checkout.is_file() and not packaged.is_file() else packaged


DEFAULT_SPEC = shipped_spec()


class State(enum.Enum):
    """The lifetime state of one partitioned parameter; the docstrings say what memory is live."""

    NOT_AVAILABLE = "NOT_AVAILABLE"
    """Only this rank's 1/world shard is live; ``param.data`` is empty."""
    INFLIGHT = "INFLIGHT"
    """The shard plus the unit's gather buffer (all-gather issued, not waited on)."""
    AVAILABLE = "AVAILABLE"
    """The shard plus the full parameter in ``param.data``."""
    DEFERRED_RELEASE = "DEFERRED_RELEASE"
    """Like AVAILABLE, kept without holders for the next backward on a retained graph."""

    # Identity hash: states key the compiled table on the hot path (see paramfsm.core.fsm).
    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"State.{self.name}"


class Residency(enum.Enum):
    """Where the working copy of one offloaded value (a shard, its optimizer state) is, against its tier copy.

    The second machine of the spec (``[residency]``); see [Note: two machines].
    """

    DIRTY = "DIRTY"
    """Resident, and changed since it was last written to its tier (or never written)."""
    RESIDENT = "RESIDENT"
    """Resident, and equal to its tier copy: it may be dropped without a write."""
    PAGING_IN = "PAGING_IN"
    """Not usable yet: a read from the tier into a new working buffer is in flight."""
    PAGED_OUT = "PAGED_OUT"
    """Only the tier copy exists; the tensor holds no storage of its own."""

    __hash__ = object.__hash__

    def __repr__(self) -> str:
        return f"Residency.{self.name}"


#: Guard name -> predicate over the extended state (holds, keep_graph, retained).
GUARDS: Mapping[str, Callable[[int, bool, bool], bool]] = {
    "unheld": lambda holds, keep_graph, retained: holds == 0,
    "last_hold": lambda holds, keep_graph, retained: holds == 1,
    "shared_hold": lambda holds, keep_graph, retained: holds >= 2,
    "keep_graph": lambda holds, keep_graph, retained: keep_graph,
    "retained": lambda holds, keep_graph, retained: retained,
}

#: Effects the executor knows how to run, in the order a row lists them.
EFFECTS = frozenset(
    {"start_gather", "unpack", "discard_gather", "free", "defer", "undefer", "reduce_grad", "keep_grad", "sync_grad",
     "write_back"}
)

#: Invariants the runtime (and ``paramfsm.testing``) can check for a state.
INVARIANTS = frozenset(
    {"data_empty", "data_full", "shard_intact", "no_handle", "pending_handle", "retained_graph_live"}
)

#: Effects the residency machine's rows may name (run by ``paramfsm.engine.effects.paging.Pager``).
RESIDENCY_EFFECTS = frozenset({"start_read", "finish_read", "write_tier", "drop_resident"})

#: Invariants a residency state may declare.
RESIDENCY_INVARIANTS = frozenset({"working_copy", "tier_current", "read_pending", "no_working_copy"})

HOLD_UPDATES = ("+1", "-1", "0")
ROW_KINDS = ("transition", "ignore", "error")

# Values quoted in messages are cut short (depth and length), so a misshapen value (say a list nested
# thousands deep) cannot turn a SpecError into a RecursionError or a page of brackets.
_QUOTE = reprlib.Repr()
_QUOTE.maxlevel, _QUOTE.maxstring, _QUOTE.maxother = 3, 80, 80


def _quote(value) -> str:
    """``repr(value)``, bounded in depth and length (see ``_QUOTE``)."""
    return _QUOTE.repr(value)


@attrs.frozen(slots=True)
class MachineKind:
    """What one machine of the spec may name: its states, effects, invariants and guards.

    [Note: two machines]
    The spec file holds two machines. The lifetime machine (the top level)
    says whether a parameter's full copy exists; the residency machine
    (``[residency]``) says where the working copy of an offloaded value is
    against its copy in host memory or on disk. They are separate machines,
    not more states of one, because they are orthogonal: a parameter whose
    full copy is AVAILABLE may have its shard paged out (the gather has
    landed), and a NOT_AVAILABLE one may have it resident. As states of one
    machine every lifetime state would be multiplied by every residency state,
    and each new row written for each product. Both machines are validated,
    compiled and replayed by the same code; they meet only in the schedule,
    which steps a unit's shards to ``need`` and ``read`` before it steps the
    parameters to ``fetch``.
    """

    key: str  # the top-level TOML table ("" for the lifetime machine)
    states: type
    effects: frozenset
    invariants: frozenset
    guards: Mapping
    holders: bool  # whether states may declare holders (``holds = "any"``)


LIFETIME = MachineKind("", State, EFFECTS, INVARIANTS, GUARDS, True)
RESIDENCY = MachineKind("residency", Residency, RESIDENCY_EFFECTS, RESIDENCY_INVARIANTS, {}, False)


@attrs.frozen(slots=True)
class StateSpec:
    """A state as declared: its doc, whether holders are allowed, and its invariants."""

    name: str
    doc: str
    holds_zero: bool
    invariants: tuple[str, ...]


@attrs.frozen(slots=True)
class Rule:
    """One row of the spec for one (state, event) pair; rows with several events are expanded."""

    kind: str  # "transition" | "ignore" | "error"
    src: str
    event: str
    when: tuple[tuple[str, bool], ...]  # (guard name, negated)
    dst: str | None
    effects: tuple[str, ...]
    holds: str | None
    reason: str
    entry: str  # e.g. "transition #7 (AVAILABLE, release)", for messages

    def matches(self, holds: int, keep_graph: bool, retained: bool) -> bool:
        """Whether every guard of this row holds for the extended state."""
        return all(GUARDS[name](holds, keep_graph, retained) != negated for name, negated in self.when)


@attrs.frozen(slots=True)
class Spec:
    """A validated lifetime spec."""

    file: str
    name: str
    initial: str
    states: Mapping[str, StateSpec]
    events: Mapping[str, str]
    rules: tuple[Rule, ...]
    kind: MachineKind = LIFETIME

    def rules_for(self, state: str, event: str) -> tuple[Rule, ...]:
        return tuple(r for r in self.rules if r.src == state and r.event == event)


def load_spec(path: str | Path | None = None) -> Spec:
    """Read, validate and return the lifetime machine of the spec at ``path`` (the shipped spec by default)."""
    path = Path(path) if path is not None else DEFAULT_SPEC
    return parse_spec(_read_toml(path), file=str(path))


def load_residency_spec(path: str | Path | None = None) -> Spec:
    """Read, validate and return the residency machine (``[residency]``) of the spec at ``path``."""
    path = Path(path) if path is not None else DEFAULT_SPEC
    raw = _read_toml(path)
    if "residency" not in raw:
        raise SpecError(path, "residency", "missing [residency] table: the spec declares no residency machine")
    return parse_spec(raw["residency"], file=str(path), kind=RESIDENCY)


def has_residency(path: str | Path | None = None) -> bool:
    """Whether the spec at ``path`` declares a residency machine."""
    return "residency" in _read_toml(Path(path) if path is not None else DEFAULT_SPEC)


def _read_toml(path: Path) -> dict:
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        hint = " (this paramfsm was installed without its spec; reinstall it)" if path == DEFAULT_SPEC else ""
        raise SpecError(path, "file", f"no such file{hint}") from None
    except OSError as exc:
        raise SpecError(path, "file", f"cannot read: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise SpecError(path, "toml", f"not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise SpecError(path, "file", f"not UTF-8 text: {exc}") from None
    except RecursionError:  # tomllib parses nested arrays and inline tables recursively
        raise SpecError(path, "toml", "arrays or inline tables nested too deeply to parse") from None
    return raw


def parse_spec(raw: Mapping, file: str = "<spec>", *, kind: MachineKind = LIFETIME) -> Spec:
    """Validate one machine of a spec already parsed from TOML (see the module docstring for the checks).

    ``kind`` says which machine ``raw`` is: the lifetime machine (the document's top level, whose
    ``[residency]`` table, if any, is the other machine and is not looked at here) or the residency
    machine (that table). Entries named in errors carry the machine's table as a prefix.
    """
    prefix = f"{kind.key}." if kind.key else ""
    fail = lambda entry, reason: SpecError(  # noqa: E731
        file, entry if entry.startswith(prefix) else prefix + entry, reason)

    if not isinstance(raw, Mapping):
        raise fail("toml", f"a spec is a TOML document (a table of tables), not {type(raw).__name__}")
    machine = _table(raw, "machine", fail)
    raw_states = _table(raw, "states", fail)
    raw_events = _table(raw, "events", fail)
    nested = {"residency"} if kind is LIFETIME else set()
    unknown_top = set(raw) - {"machine", "states", "events", *ROW_KINDS, *nested}
    if unknown_top:
        raise fail(sorted(unknown_top)[0], f"unknown top-level table; expected machine, states, events, "
                                           f"{', '.join(ROW_KINDS)}{', residency' if nested else ''}")

    known_states = {s.value for s in kind.states}
    states: dict[str, StateSpec] = {}
    for name, body in raw_states.items():
        entry = f"states.{name}"
        if name not in known_states:
            raise fail(entry, f"unknown state; the runtime knows {sorted(known_states)}")
        if not isinstance(body, dict):
            raise fail(entry, "must be a table")
        holds = body.get("holds", "any" if kind.holders else "zero")
        if holds not in ("zero", "any") or (holds == "any" and not kind.holders):
            allowed = "'zero' or 'any'" if kind.holders else "'zero' (this machine counts no holders)"
            raise fail(entry, f"holds must be {allowed}, not {_quote(holds)}")
        invariants = tuple(_name_list(body.get("invariants", []), entry, "invariants", fail))
        for inv in invariants:
            if inv not in kind.invariants:
                raise fail(entry, f"unknown invariant {inv!r}; known: {sorted(kind.invariants)}")
        states[name] = StateSpec(name, _text(body.get("doc", ""), entry, "doc", fail), holds == "zero", invariants)
    missing = known_states - set(states)
    if missing:
        raise fail("states", f"missing states {sorted(missing)}")

    events = {str(k): _text(v, f"events.{k}", "an event's description", fail) for k, v in raw_events.items()}
    initial = machine.get("initial")
    if not isinstance(initial, str) or initial not in states:
        raise fail("machine.initial", f"unknown initial state {_quote(initial)}")
    name = _text(machine.get("name", kind.key or "param_lifetime"), "machine.name", "the machine's name", fail)

    rules = tuple(_parse_rules(raw, states, events, kind, fail))
    spec = Spec(file, name, initial, states, events, rules, kind)
    check_table(spec, fail)
    check_reachable(spec, fail)
    return spec


def _table(raw: Mapping, key: str, fail) -> dict:
    value = raw.get(key)
    if not isinstance(value, dict) or not value:
        raise fail(key, f"missing or empty [{key}] table")
    return value


def _text(value, entry: str, what: str, fail) -> str:
    if isinstance(value, str):
        return value
    raise fail(entry, f"{what} must be a string, not {type(value).__name__}")


def _names(value, entry: str, what: str, fail) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return list(value)
    raise fail(entry, f"{what} must be a name or a non-empty list of names")


def _name_list(value, entry: str, what: str, fail) -> list[str]:
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    raise fail(entry, f"{what} must be a list of names, like [\"a\", \"b\"]")


def _parse_rules(raw, states, events, machine: MachineKind, fail) -> Iterator[Rule]:
    allowed = {
        "transition": {"src", "event", "when", "dst", "effects", "holds", "reason"},
        "ignore": {"src", "event", "when", "reason"},
        "error": {"src", "event", "when", "reason"},
    }
    for kind in ROW_KINDS:
        rows = raw.get(kind, [])
        if not isinstance(rows, list):
            raise fail(kind, f"use [[{kind}]] (an array of tables)")
        for index, row in enumerate(rows, start=1):
            entry = f"{kind} #{index}"
            if not isinstance(row, dict):
                raise fail(entry, f"use [[{kind}]] (an array of tables)")
            extra = set(row) - allowed[kind]
            if extra:
                raise fail(entry, f"unknown key {sorted(extra)[0]!r}; allowed: {sorted(allowed[kind])}")
            srcs = _names(row.get("src"), entry, "src", fail)
            evs = _names(row.get("event"), entry, "event", fail)
            srcs = list(states) if srcs == ["*"] else srcs
            for src in srcs:
                if src not in states:
                    raise fail(entry, f"unknown state {src!r} in src")
            for ev in evs:
                if ev not in events:
                    raise fail(entry, f"unknown event {ev!r}; declare it under [events]")
            when = []
            for guard in _name_list(row.get("when", []), entry, "when", fail):
                name, negated = (guard[1:], True) if guard.startswith("!") else (guard, False)
                if name not in machine.guards:
                    known = sorted(machine.guards) or "none (this machine has no guards)"
                    raise fail(entry, f"unknown guard {name!r}; known: {known}")
                when.append((name, negated))
            dst, effects, holds = None, (), None
            if kind == "transition":
                dst = row.get("dst")
                if not isinstance(dst, str):
                    raise fail(entry, f"dst must be one state name, like \"AVAILABLE\", not {_quote(dst)}")
                if dst not in states:
                    raise fail(entry, f"unknown dst state {dst!r}")
                effects = tuple(_name_list(row.get("effects", []), entry, "effects", fail))
                for eff in effects:
                    if eff not in machine.effects:
                        raise fail(entry, f"unknown effect {eff!r}; known: {sorted(machine.effects)}")
                holds = row.get("holds")
                if holds is not None and not machine.holders:
                    raise fail(entry, "this machine counts no holders: a row cannot change holds")
                if holds is not None and holds not in HOLD_UPDATES:
                    raise fail(entry, f"holds must be one of {HOLD_UPDATES}, not {_quote(holds)}")
            elif not row.get("reason"):
                raise fail(entry, f"an {kind} row needs a reason")
            reason = _text(row.get("reason", ""), entry, "reason", fail)
            named = f"{machine.key}.{entry}" if machine.key else entry
            for src in srcs:
                for ev in evs:
                    yield Rule(kind, src, ev, tuple(when), dst, effects, holds, reason, f"{named} ({src}, {ev})")
