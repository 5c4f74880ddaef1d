"""Traces drawn for ui.perfetto.dev and chrome://tracing (Chrome trace-event JSON).

This module imports neither ``torch`` nor ``cupy``.
"""

from __future__ import annotations

import json
from pathlib import Path

from paramfsm.core.spec import Residency, State

#: The state each machine rests in, not drawn: a lifetime's NOT_AVAILABLE, a residency's PAGED_OUT.
_RESTING = {"": State.NOT_AVAILABLE.name, "residency": Residency.PAGED_OUT.name}


def write_perfetto(records: list, path: str | Path) -> Path:
    """One process per rank, one track (thread) per parameter, one span per state visited.

    [Note: spans from transitions]
    A record marks the end of the span in ``src`` and the start of one in
    ``dst``. NOT_AVAILABLE spans are not drawn (it is the resting state), so
    the tracks show exactly when memory beyond the shard was live. A span
    still open at the end of the trace is closed at the last timestamp and
    flagged ``open: true``; a leak shows up as such a span. An offloaded
    value's residency has a track of its own beside its parameter's, where
    PAGED_OUT is the resting state.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    events: list[dict] = []
    if records:
        t0 = min(r.t_ns for r in records)
        t_end = max(r.t_ns for r in records)
        tids: dict[tuple[int, str], int] = {}
        open_spans: dict[tuple[int, str], tuple] = {}
        for r in records:
            key = r.subject
            if key not in tids:
                tids[key] = len(tids) + 1
                label = f"{r.param} [{r.unit}]" + (f" {r.kind} residency" if r.machine else "")
                events.append({"ph": "M", "name": "thread_name", "pid": r.rank, "tid": tids[key],
                               "args": {"name": label}})
            if key in open_spans:
                state, start, first = open_spans.pop(key)
                events.append(_span(state, start, r.t_ns, t0, r.rank, tids[key], first, closed_by=r))
            if r.dst != _RESTING.get(r.machine):
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


def _span(state, start, end, t0, pid, tid, first, closed_by) -> dict:
    args = {"entered_by": first.event, "step": first.step, "graph_task": first.graph_task,
            "bytes": first.nbytes}
    if closed_by is None:
        args["open"] = True
    else:
        args["left_by"] = closed_by.event
    return {"ph": "X", "name": state, "cat": first.machine or "lifetime", "pid": pid, "tid": tid,
            "ts": (start - t0) / 1000.0, "dur": max((end - start) / 1000.0, 0.001), "args": args}
