"""Replaying a trace through the spec: the check behind ``paramfsm trace check`` and every test.

A trace (:mod:`paramfsm.core.trace`) is checked by replaying it through the
compiled spec: each parameter's record sequence must start in the initial
state (or where a snapshot record puts it), every record's source state and
hold count must be what the previous records left, and the spec must allow
exactly that destination with exactly those effects.

This module imports neither ``torch`` nor ``cupy``.
"""

from __future__ import annotations

from typing import Iterable

import attrs

from paramfsm.core.spec import State
from paramfsm.core.trace_record import SNAPSHOT, TraceRecord


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
    does not depend on how the spec was chosen). A :data:`SNAPSHOT` record
    sets where its parameter starts (a flight-recorder window); records made
    under another spec (their ``spec`` digest differs from the table's) fail.
    """
    current: dict[tuple[int, str], tuple[State, int]] = {}
    digest = getattr(table, "digest", "")
    for index, r in enumerate(records):
        if r.spec and digest and r.spec != digest:
            return ReplayError(index, r, f"the trace was recorded under spec {r.spec}, not under "
                                         f"{table.spec.file} ({digest}); check it against the spec it was made with")
        key = (r.rank, r.param)
        try:
            src, dst = State[r.src], State[r.dst]
        except KeyError as exc:
            return ReplayError(index, r, f"unknown state {exc.args[0]!r}")
        if r.event == SNAPSHOT:
            if key in current or src is not dst or r.holds < 0:
                return ReplayError(index, r, "a snapshot record must open the parameter's records "
                                             "and name one state")
            current[key] = (dst, r.holds)
            continue
        state, holds = current.get(key, (State[table.spec.initial], 0))
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
