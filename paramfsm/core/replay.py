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

from paramfsm.core.spec import Residency, State
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


def replay(records: Iterable[TraceRecord], table, residency=None) -> ReplayError | None:
    """Replay records through a compiled table; return the first illegal one, or None.

    ``table`` is a :class:`paramfsm.core.fsm.Table` (passed in, so this module
    does not depend on how the spec was chosen); residency records (an
    offloaded value's, ``machine == "residency"``) replay through
    ``residency``, by default the shipped spec's residency machine. Each
    (rank, machine, kind, parameter) is one sequence. A :data:`SNAPSHOT` record
    sets where its sequence starts (a flight-recorder window); records made
    under another spec (their ``spec`` digest differs from the table's) fail.
    """
    current: dict[tuple, tuple] = {}
    tables = {"": table}
    for index, r in enumerate(records):
        machine_table = tables.get(r.machine)
        if machine_table is None:
            if r.machine != "residency":
                return ReplayError(index, r, f"unknown machine {r.machine!r}; the spec has the lifetime "
                                             "machine and 'residency'")
            if residency is None:
                from paramfsm.core.fsm import residency_table
                residency = residency_table()
            machine_table = tables["residency"] = residency
        failed = _replay_one(index, r, machine_table, current)
        if failed is not None:
            return failed
    return None


def _replay_one(index: int, r: TraceRecord, table, current: dict) -> ReplayError | None:
    """Check one record against what the records before it left (``current``) and step it."""
    digest = getattr(table, "digest", "")
    if r.spec and digest and r.spec != digest:
        return ReplayError(index, r, f"the trace was recorded under spec {r.spec}, not under "
                                     f"{table.spec.file} ({digest}); check it against the spec it was made with")
    states = Residency if r.machine else State
    key = r.subject
    try:
        src, dst = states[r.src], states[r.dst]
    except KeyError as exc:
        return ReplayError(index, r, f"unknown state {exc.args[0]!r}")
    if r.event == SNAPSHOT:
        if key in current or src is not dst or r.holds < 0:
            return ReplayError(index, r, "a snapshot record must open the parameter's records "
                                         "and name one state")
        current[key] = (dst, r.holds)
        return None
    state, holds = current.get(key, (states[table.spec.initial], 0))
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
    current[key] = (dst, 0 if outcome.reset else holds + outcome.hold)
    return None


def final_states(records: Iterable[TraceRecord]) -> dict[tuple[int, str], TraceRecord]:
    """The last lifetime record of every (rank, parameter): what a leak report starts from (residency
    records say where a value is, not whether a full copy is live, so they are left out)."""
    last: dict[tuple[int, str], TraceRecord] = {}
    for r in records:
        if not r.machine:
            last[(r.rank, r.param)] = r
    return last
