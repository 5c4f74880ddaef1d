"""Read a trace for debugging memory or a hang: totals per state, deferred windows, leaks, divergence.

:func:`summarize` turns a list of :class:`~paramfsm.core.trace.TraceRecord` into a
:class:`Summary` (time per state, gathers, deferred windows, graph tasks,
leaks) that ``paramfsm trace summary`` prints. :func:`diff` compares two
ranks' traces and names the first record where they part ways, which is
where a rank desync starts.

[Note: spans]
A record ends the parameter's stay in ``src`` and starts one in ``dst``. A
span is one uninterrupted stay in a state: consecutive records of the same
(rank, parameter) that loop on a state (a second fetch in AVAILABLE, a
gradient reduced while DEFERRED_RELEASE) continue the span instead of
starting a new one, so a deferred window is counted once however many
gradients were reduced during it. The time before a parameter's first
record is unknown and not counted. A span still open at the end of the
trace is counted under ``open`` and left out of the totals; the time it was
open is unknown too. Ending in NOT_AVAILABLE, the resting state, is not an
open span.

[Note: gather waits]
How long compute waited for communication, from the records alone: a
holder's ``fetch`` that finds a parameter NOT_AVAILABLE or INFLIGHT waits
until that parameter's next ``arrive``; one that finds it AVAILABLE with no
holder (a prefetch that already arrived) or DEFERRED_RELEASE waits for
nothing. The parameters of a unit are fetched together (same rank, unit and
timestamp), so a unit's fetch waits as long as its slowest parameter. A
well-overlapped run has most fetches ready and short waits; fetches of the
first unit of a pass, which nothing prefetched, always wait. The wait
includes issuing the gather when nothing prefetched it and, on the CPU,
unpacking it.

This module imports neither ``torch`` nor ``cupy``.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Mapping, Sequence

import attrs

from paramfsm.core.spec import State
from paramfsm.core.trace import SNAPSHOT, TraceRecord

LEAK_TAIL = 5  # records shown per leaked parameter
DIFF_FIELDS = ("step", "param", "unit", "event", "src", "dst", "effects")


@attrs.frozen(slots=True)
class StateTime:
    """Time spent in one state, over every parameter of every rank."""

    spans: int = 0  # closed spans
    total_ns: int = 0  # summed duration of the closed spans
    open: int = 0  # spans still open at the end of the trace


@attrs.frozen(slots=True)
class DeferredWindows:
    """Stays in DEFERRED_RELEASE: the memory kept for retained graphs."""

    count: int = 0  # windows, open ones included
    open: int = 0  # windows not closed by the end of the trace
    total_ns: int = 0  # over the closed windows
    max_ns: int = 0  # longest closed window
    max_concurrent_bytes: int = 0  # largest deferred footprint of one rank at one time


@attrs.frozen(slots=True)
class Leak:
    """A parameter whose last record leaves it holding more than its shard."""

    rank: int
    param: str
    unit: str
    state: str
    last: tuple[TraceRecord, ...]  # the last records of the parameter, oldest first


@attrs.frozen(slots=True)
class GatherWait:
    """The holder fetches of one unit and how long they waited for their gather (see [Note: gather waits])."""

    fetches: int = 0  # holder fetches of the unit (each counted once for the unit)
    waited: int = 0  # of which found the unit not gathered yet
    total_ns: int = 0  # summed waits
    max_ns: int = 0  # longest wait


@attrs.frozen(slots=True)
class Summary:
    """What ``paramfsm trace summary`` prints; see :func:`summarize`."""

    records: int
    ranks: tuple[int, ...]
    params: int
    duration_ns: int  # first to last timestamp
    states: Mapping[str, StateTime]
    gathers: int  # records whose effects contain start_gather
    gathered_bytes: int
    deferred: DeferredWindows
    graph_tasks: Mapping[int, int]  # graph task id -> records; -1 means outside any backward
    leaks: tuple[Leak, ...]
    gather_waits: Mapping[str, GatherWait] = attrs.field(factory=dict)  # unit -> its fetches' waits

    def format(self) -> str:
        """A plain-text report: a table of time per state, then gathers, deferred windows, leaks."""
        lines = [
            f"{self.records} records, {self.params} parameters, ranks {list(self.ranks)}, "
            f"{_ms(self.duration_ns)} ms from first to last record",
            "",
            f"{'state':<18}{'spans':>8}{'open':>7}{'total ms':>12}{'mean us':>11}",
        ]
        for name, st in self.states.items():
            mean = f"{st.total_ns / st.spans / 1e3:.3f}" if st.spans else "-"
            lines.append(f"{name:<18}{st.spans:>8}{st.open:>7}{_ms(st.total_ns):>12}{mean:>11}")
        d = self.deferred
        lines += [
            "",
            f"gathers: {self.gathers} ({_bytes(self.gathered_bytes)})",
            f"deferred windows: {d.count} ({d.open} open), total {_ms(d.total_ns)} ms, "
            f"longest {_ms(d.max_ns)} ms, at most {_bytes(d.max_concurrent_bytes)} deferred at once on a rank",
            _per_task(self.graph_tasks),
            *_waits(self.gather_waits),
        ]
        if not self.leaks:
            lines.append("leaks: none (every parameter ends NOT_AVAILABLE)")
            return "\n".join(lines)
        lines.append(f"leaks: {len(self.leaks)} parameter(s) do not end NOT_AVAILABLE")
        for leak in self.leaks:
            lines.append(f"  rank {leak.rank} '{leak.param}' (unit '{leak.unit}') ends {leak.state}; last records:")
            lines.extend(f"    {_describe(r)}" for r in leak.last)
        return "\n".join(lines)


#: Graph tasks listed one by one; past this many, the line gives their count and spread instead.
TASKS_LISTED = 6


def _per_task(graph_tasks: Mapping[int, int]) -> str:
    """The records-per-graph-task line, short however long the run."""
    outside = graph_tasks.get(-1)
    tasks = {t: n for t, n in graph_tasks.items() if t != -1}
    parts = [f"outside backward: {outside}"] if outside is not None else []
    if len(tasks) <= TASKS_LISTED:
        parts += [f"{task}: {n}" for task, n in tasks.items()]
    else:
        counts = sorted(tasks.values())
        parts.append(f"{len(tasks)} graph tasks ({min(tasks)}..{max(tasks)}), records per task min {counts[0]}, "
                     f"median {counts[len(counts) // 2]}, max {counts[-1]}")
    return "records per graph task: " + (", ".join(parts) or "none")


#: Units listed by their total gather wait (the longest first).
WAITS_LISTED = 5


def _waits(waits: Mapping[str, GatherWait]) -> list[str]:
    """The gather-wait lines: the whole run, then the units that waited longest."""
    fetches = sum(w.fetches for w in waits.values())
    if not fetches:
        return ["gather waits: no holder fetches"]
    waited = sum(w.waited for w in waits.values())
    total = sum(w.total_ns for w in waits.values())
    lines = [f"gather waits: {waited} of {fetches} unit fetches waited for their gather, total {_ms(total)} ms, "
             f"mean {total / fetches / 1e3:.1f} us per fetch ({fetches - waited} found it ready)"]
    worst = sorted(waits.items(), key=lambda item: -item[1].total_ns)[:WAITS_LISTED]
    lines += [f"  unit '{unit}': {w.waited}/{w.fetches} waited, total {_ms(w.total_ns)} ms, longest "
              f"{_ms(w.max_ns)} ms" for unit, w in worst if w.waited]
    return lines


def gather_waits(records: Iterable[TraceRecord]) -> dict[str, GatherWait]:
    """Per unit, its holder fetches and how long each waited for its gather (see [Note: gather waits])."""
    fetches: dict[tuple, int] = {}  # (rank, unit, fetch t_ns) -> wait (-1: still waiting at the end)
    waiting: dict[tuple[int, str], tuple] = {}  # (rank, param) -> key of its fetch waiting for arrive
    for r in records:
        if r.event == "fetch":
            key = (r.rank, r.unit, r.t_ns)
            if r.src in _NOT_GATHERED:
                fetches[key] = max(fetches.get(key, 0), 0)
                waiting[(r.rank, r.param)] = key
            elif r.holds == 0:
                fetches.setdefault(key, 0)
        elif r.event == "arrive":
            key = waiting.pop((r.rank, r.param), None)
            if key is not None:
                fetches[key] = max(fetches[key], r.t_ns - key[2], 1)
    out: dict[str, list[int]] = {}
    for (_, unit, _), wait in fetches.items():
        counts = out.setdefault(unit, [0, 0, 0, 0])
        counts[0] += 1
        if wait > 0:
            counts[1] += 1
            counts[2] += wait
            counts[3] = max(counts[3], wait)
    return {unit: GatherWait(*counts) for unit, counts in out.items()}


_NOT_GATHERED = (State.NOT_AVAILABLE.name, State.INFLIGHT.name)


def summarize(records: Iterable[TraceRecord], leak_tail: int = LEAK_TAIL) -> Summary:
    """Summarize a trace of one or several ranks (see [Note: spans] in the module docstring)."""
    records = list(records)
    by_param: dict[tuple[int, str], list[TraceRecord]] = {}
    for r in records:
        by_param.setdefault((r.rank, r.param), []).append(r)

    spans = {s.name: [0, 0, 0] for s in State}  # name -> [closed, total_ns, open]
    windows: list[tuple[int, int, int | None, int]] = []  # (rank, start, end or None, nbytes)
    leaks = []
    for (rank, param), seq in by_param.items():
        for state, start, end, first in _stays(seq):
            counts = spans.setdefault(state, [0, 0, 0])
            if end is not None:
                counts[0] += 1
                counts[1] += end - start
            elif state != State.NOT_AVAILABLE.name:
                counts[2] += 1
            if state == State.DEFERRED_RELEASE.name:
                windows.append((rank, start, end, first.nbytes))
        last = seq[-1]
        if last.dst != State.NOT_AVAILABLE.name:
            leaks.append(Leak(rank, param, last.unit, last.dst, tuple(seq[-leak_tail:])))

    gathers = [r for r in records if "start_gather" in r.effects]
    closed = [end - start for _, start, end, _ in windows if end is not None]
    times = [r.t_ns for r in records]
    return Summary(
        records=len(records),
        ranks=tuple(sorted({r.rank for r in records})),
        params=len(by_param),
        duration_ns=max(times) - min(times) if times else 0,
        states={name: StateTime(*counts) for name, counts in spans.items()},
        gathers=len(gathers),
        gathered_bytes=sum(r.nbytes for r in gathers),
        deferred=DeferredWindows(
            count=len(windows),
            open=len(windows) - len(closed),
            total_ns=sum(closed),
            max_ns=max(closed, default=0),
            max_concurrent_bytes=_max_concurrent(windows),
        ),
        graph_tasks=dict(sorted(Counter(r.graph_task for r in records).items())),
        leaks=tuple(sorted(leaks, key=lambda leak: (leak.rank, leak.param))),
        gather_waits=gather_waits(records),
    )


def _stays(seq: Sequence[TraceRecord]):
    """Yield ``(state, start_ns, end_ns or None, entering record)`` for one parameter's records."""
    current = None  # (state, start, entering record)
    for r in seq:
        if current is not None and current[0] != r.dst:
            yield current[0], current[1], r.t_ns, current[2]
            current = None
        if current is None:
            current = (r.dst, r.t_ns, r)
    if current is not None:
        yield current[0], current[1], None, current[2]


def _max_concurrent(windows) -> int:
    """The largest sum of bytes of windows open at one instant on one rank (open windows never close)."""
    best = 0
    for rank in {w[0] for w in windows}:
        # At equal timestamps a window closes before another opens: the memory is handed over.
        points = []
        for _, start, end, nbytes in (w for w in windows if w[0] == rank):
            points.append((start, 1, nbytes))
            if end is not None:
                points.append((end, 0, -nbytes))
        live = 0
        for _, _, delta in sorted(points):
            live += delta
            best = max(best, live)
    return best


@attrs.frozen(slots=True)
class Divergence:
    """The first place where two traces differ (``a``/``b`` is None where that trace ended)."""

    index: int
    field: str  # one of DIFF_FIELDS, or "length" when one trace ended first
    a: TraceRecord | None
    b: TraceRecord | None

    def __str__(self) -> str:
        if self.field == "length":
            shorter = "A" if self.a is None else "B"
            extra = self.b if self.a is None else self.a
            return (f"trace {shorter} ends after {self.index} records; "
                    f"the other continues with record {self.index}: {_describe(extra)}")
        return (f"record {self.index} differs in '{self.field}': "
                f"{getattr(self.a, self.field)!r} vs {getattr(self.b, self.field)!r}\n"
                f"  A: {_describe(self.a)}\n  B: {_describe(self.b)}")


def diff(records_a: Iterable[TraceRecord], records_b: Iterable[TraceRecord]) -> Divergence | None:
    """Compare two ranks' traces record by record on what every rank must agree on.

    Timestamps, ranks, graph task ids and sequence numbers legitimately
    differ between ranks; the step, parameter, unit, event, states and
    effects must not. Returns None when the traces agree.

    Flight-recorder dumps start wherever each rank's ring started: both are
    compared from the later first ``seq`` on (ranks running the same program
    number their transitions alike), without their snapshot records.
    """
    a = [r for r in records_a if r.event != SNAPSHOT]
    b = [r for r in records_b if r.event != SNAPSHOT]
    if a and b:
        start = max(a[0].seq, b[0].seq)
        a, b = [r for r in a if r.seq >= start], [r for r in b if r.seq >= start]
    for index, (ra, rb) in enumerate(zip(a, b)):
        for field in DIFF_FIELDS:
            if _value(ra, field) != _value(rb, field):
                return Divergence(index, field, ra, rb)
    if len(a) != len(b):
        n = min(len(a), len(b))
        return Divergence(n, "length", a[n] if n < len(a) else None, b[n] if n < len(b) else None)
    return None


def _describe(r: TraceRecord) -> str:
    effects = f" [{', '.join(r.effects)}]" if r.effects else ""
    return (f"seq {r.seq} step {r.step} graph_task {r.graph_task}: '{r.param}' (unit '{r.unit}') "
            f"{r.event}: {r.src} -> {r.dst}{effects}")


def _value(r: TraceRecord, field: str):
    value = getattr(r, field)
    return tuple(value) if field == "effects" else value


def _ms(ns: int) -> str:
    return f"{ns / 1e6:.3f}"


def _bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in ("KiB", "MiB", "GiB"):
        value /= 1024
        if value < 1024:
            break
    return f"{value:.1f} {unit}"
