"""Transition traces: one record per state change, dumped as JSON Lines, drawn in Perfetto, replayed.

Tracing is off by default; when off, :func:`paramfsm.core.fsm.step` sees
``ctx.trace is None`` and does no work for it.

A trace is checked by replaying it through the compiled spec
(:func:`replay`): each parameter's record sequence must start in the initial
state, every record's source state and hold count must be what the previous
records left, and the spec must allow exactly that destination with exactly
those effects.

This module imports neither ``torch`` nor ``cupy``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator

import attrs

from paramfsm.core.spec import State

FIELDS = ("seq", "t_ns", "rank", "step", "graph_task", "param", "unit", "event", "src", "dst",
          "effects", "keep_graph", "retained", "holds", "nbytes")


@attrs.frozen(slots=True)
class TraceRecord:
    """One transition of one parameter (DESIGN §5), plus the guard inputs replay needs."""

    seq: int
    t_ns: int
    rank: int
    step: int
    graph_task: int
    param: str
    unit: str
    event: str
    src: str
    dst: str
    effects: tuple[str, ...]
    keep_graph: bool = False
    retained: bool = False
    holds: int = 0  # holders before the transition
    nbytes: int = 0  # bytes of the full parameter

    def to_json(self) -> dict:
        return {f: (list(v) if f == "effects" else v) for f, v in zip(FIELDS, attrs.astuple(self))}

    @classmethod
    def from_json(cls, obj: dict) -> "TraceRecord":
        """Build a record from its JSON object; raises ValueError naming a missing or mistyped field."""
        if not isinstance(obj, dict):
            raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
        missing = [f for f in FIELDS[:11] if f not in obj]
        if missing:
            raise ValueError(f"record lacks field(s) {missing}")
        kwargs = {f: obj[f] for f in FIELDS if f in obj}
        for field, value in kwargs.items():
            if not _FIELD_CHECKS[field](value):
                raise ValueError(f"field {field!r} has the wrong type: {value!r}")
        kwargs["effects"] = tuple(kwargs["effects"])
        return cls(**kwargs)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_FIELD_CHECKS = {
    **dict.fromkeys(("seq", "t_ns", "rank", "step", "graph_task", "holds", "nbytes"), _is_int),
    **dict.fromkeys(("param", "unit", "event", "src", "dst"), lambda v: isinstance(v, str)),
    **dict.fromkeys(("keep_graph", "retained"), lambda v: isinstance(v, bool)),
    "effects": lambda v: isinstance(v, list) and all(isinstance(e, str) for e in v),
}


class Trace:
    """An append-only list of :class:`TraceRecord` for one rank."""

    def __init__(self, rank: int = 0, records: Iterable[TraceRecord] = ()):
        self.rank = rank
        self.records: list[TraceRecord] = list(records)

    def append(self, t_ns, ctx, rec, event, src, dst, effects, keep_graph, retained, holds) -> None:
        """Called by :func:`paramfsm.core.fsm.step` for each transition while tracing is on."""
        self.records.append(TraceRecord(
            len(self.records), t_ns, ctx.rank, ctx.step, ctx.graph_task, rec.name, rec.unit,
            event, src.name, dst.name, effects, bool(keep_graph), bool(retained), holds, rec.nbytes,
        ))

    def clear(self) -> None:
        self.records.clear()

    def __len__(self) -> int:
        return len(self.records)

    def count(self, effect: str, **match) -> int:
        """How many records carry ``effect`` and match every ``field=value`` given."""
        return sum(
            1 for r in self.records
            if effect in r.effects and all(getattr(r, k) == v for k, v in match.items())
        )

    def dump(self, path: str | Path) -> Path:
        """Write the records as JSON Lines, one object per transition."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w", encoding="utf-8") as out:
            for r in self.records:
                out.write(json.dumps(r.to_json(), separators=(",", ":")) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Trace":
        """Read a JSON Lines trace; raises ValueError naming the line of a malformed record."""
        records = list(iter_jsonl(path))
        return cls(records[0].rank if records else 0, records)

    def to_perfetto(self, path: str | Path) -> Path:
        """Write Chrome trace-event JSON (opens in ui.perfetto.dev and chrome://tracing)."""
        return write_perfetto(self.records, path)


def iter_jsonl(path: str | Path) -> Iterator[TraceRecord]:
    with Path(path).open(encoding="utf-8") as src:
        for lineno, line in enumerate(src, start=1):
            if not line.strip():
                continue
            try:
                yield TraceRecord.from_json(json.loads(line))
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a trace record: {exc}") from None


def write_perfetto(records: list[TraceRecord], path: str | Path) -> Path:
    """One process per rank, one track (thread) per parameter, one span per state visited.

    [Note: spans from transitions]
    A record marks the end of the span in ``src`` and the start of one in
    ``dst``. NOT_AVAILABLE spans are not drawn (it is the resting state), so
    the tracks show exactly when memory beyond the shard was live. A span
    still open at the end of the trace is closed at the last timestamp and
    flagged ``open: true``; a leak shows up as such a span.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    events: list[dict] = []
    if records:
        t0 = min(r.t_ns for r in records)
        t_end = max(r.t_ns for r in records)
        tids: dict[tuple[int, str], int] = {}
        open_spans: dict[tuple[int, str], tuple[str, int, TraceRecord]] = {}
        for r in records:
            key = (r.rank, r.param)
            if key not in tids:
                tids[key] = len(tids) + 1
                events.append({"ph": "M", "name": "thread_name", "pid": r.rank, "tid": tids[key],
                               "args": {"name": f"{r.param} [{r.unit}]"}})
            if key in open_spans:
                state, start, first = open_spans.pop(key)
                events.append(_span(state, start, r.t_ns, t0, r.rank, tids[key], first, closed_by=r))
            if r.dst != State.NOT_AVAILABLE.name:
                open_spans[key] = (r.dst, r.t_ns, r)
            if r.effects:
                events.append({"ph": "i", "s": "t", "name": "+".join(r.effects), "pid": r.rank,
                               "tid": tids[key], "ts": (r.t_ns - t0) / 1000.0,
                               "args": {"event": r.event, "step": r.step, "graph_task": r.graph_task}})
        for key, (state, start, first) in open_spans.items():
            events.append(_span(state, start, t_end, t0, key[0], tids[key], first, closed_by=None))
        for rank in sorted({r.rank for r in records}):
            events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
    path.write_text(json.dumps({"traceEvents": events, "displayTimeUnit": "ns"}), encoding="utf-8")
    return path


def _span(state, start, end, t0, pid, tid, first: TraceRecord, closed_by) -> dict:
    args = {"entered_by": first.event, "step": first.step, "graph_task": first.graph_task,
            "bytes": first.nbytes}
    if closed_by is None:
        args["open"] = True
    else:
        args["left_by"] = closed_by.event
    return {"ph": "X", "name": state, "cat": "lifetime", "pid": pid, "tid": tid,
            "ts": (start - t0) / 1000.0, "dur": max((end - start) / 1000.0, 0.001), "args": args}


@attrs.frozen(slots=True)
class ReplayError:
    """The first record that the spec does not allow, and why."""

    index: int
    record: TraceRecord
    reason: str

    def __str__(self) -> str:
        r = self.record
        return (f"record {self.index} (seq {r.seq}, rank {r.rank}, step {r.step}, graph_task {r.graph_task}): "
                f"param '{r.param}' unit '{r.unit}' event '{r.event}' {r.src} -> {r.dst}: {self.reason}")


def replay(records: Iterable[TraceRecord], table) -> ReplayError | None:
    """Replay records through a compiled table; return the first illegal one, or None.

    ``table`` is a :class:`paramfsm.core.fsm.Table` (passed in, so this module
    does not depend on how the spec was chosen).
    """
    current: dict[tuple[int, str], tuple[State, int]] = {}
    for index, r in enumerate(records):
        key = (r.rank, r.param)
        state, holds = current.get(key, (State[table.spec.initial], 0))
        try:
            src, dst = State[r.src], State[r.dst]
        except KeyError as exc:
            return ReplayError(index, r, f"unknown state {exc.args[0]!r}")
        if src is not state:
            return ReplayError(index, r, f"the previous records left the parameter in {state.name}, not {r.src}")
        if r.holds != holds:
            return ReplayError(index, r, f"the previous records left {holds} holder(s), not {r.holds}")
        if r.event not in table.events:
            return ReplayError(index, r, f"the spec has no event {r.event!r}")
        outcome = table.outcome(src, r.event, holds, r.keep_graph, r.retained)
        if outcome.kind != "transition":
            return ReplayError(index, r, f"the spec says {outcome.kind}: {outcome.reason} [{outcome.entry}]")
        if outcome.dst is not dst or tuple(outcome.effects) != tuple(r.effects):
            return ReplayError(index, r, f"the spec goes to {outcome.dst.name} with effects "
                                         f"{list(outcome.effects)} [{outcome.entry}]")
        new_holds = 0 if outcome.reset else holds + outcome.hold
        current[key] = (dst, new_holds)
    return None


def final_states(records: Iterable[TraceRecord]) -> dict[tuple[int, str], TraceRecord]:
    """The last record of every (rank, parameter): what a leak report starts from."""
    last: dict[tuple[int, str], TraceRecord] = {}
    for r in records:
        last[(r.rank, r.param)] = r
    return last
