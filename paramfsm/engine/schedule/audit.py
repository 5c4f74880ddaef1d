"""The leak audit run at the end of every final (non-retained) backward.

After the last backward of an iteration nothing should stay gathered except
what a user explicitly holds with ``rt.gathered``. A leak is a parameter that
is still INFLIGHT, AVAILABLE without a holder (or with holders nobody
accounts for), or DEFERRED_RELEASE without a live retained graph. Each is
reported by qualified name with the last events that touched it.
"""

from __future__ import annotations

import logging

import attrs

from paramfsm.core.fsm import history
from paramfsm.core.spec import State
from paramfsm.errors import ParamFSMError

log = logging.getLogger(__name__)


@attrs.frozen(slots=True)
class Leak:
    """A parameter left gathered after the final backward."""

    param: str
    unit: str
    state: State
    holds: int
    why: str
    recent: tuple

    def __str__(self) -> str:
        events = "; ".join(f"step {s} task {g}: {e} {a.name}->{b.name}" for s, g, e, a, b in self.recent)
        return f"'{self.param}' (unit '{self.unit}') left {self.state.name} holds={self.holds}: {self.why}. Last events: {events}"


class LeakError(ParamFSMError):
    """Raised by the leak audit in strict mode."""


class LeakAudit:
    """Runs the audit after every final backward and keeps its last result (``last``)."""

    __slots__ = ("_records", "_ctx", "_held_units", "_report_failure", "strict", "last")

    def __init__(self, records, ctx, held_units, report_failure, *, strict: bool):
        self._records, self._ctx = records, ctx
        self._held_units, self._report_failure = held_units, report_failure
        self.strict = strict  # raise LeakError instead of logging
        self.last: list = []

    def run(self) -> list[Leak]:
        """Find leaked parameters; log them (or raise LeakError when strict)."""
        self.last = audit_leaks(self._records, self._held_units(), self._ctx, self._report_failure, self.strict)
        return self.last


def audit_leaks(records, held_units, ctx, report_failure, strict: bool = False) -> list[Leak]:
    """The parameters of ``records`` left gathered, except those of ``held_units`` (held by the user)."""
    held = {rec for unit in held_units for rec in unit.records}
    leaks = []
    for rec in records:
        state = rec.state
        if state is State.NOT_AVAILABLE:
            continue
        if state is State.INFLIGHT:
            why = "a gather was issued and never used or abandoned"
        elif state is State.AVAILABLE and rec in held:
            continue
        elif state is State.AVAILABLE:
            why = "gathered with no holder" if rec.holds == 0 else "held by a forward or backward that never released it"
        elif any(u.live_graphs > 0 for u in rec.units):
            continue
        else:
            why = "deferred with no live retained graph"
        leaks.append(Leak(rec.name, rec.unit, state, rec.holds, why, tuple(history(rec))))
    if leaks:
        message = f"paramfsm leak audit on rank {ctx.rank}, step {ctx.step}: " + \
            f"{len(leaks)} parameter(s) still gathered after the final backward:\n  " + \
            "\n  ".join(str(leak) for leak in leaks) + \
            "\nWhat to do: run `paramfsm trace summary` on the flight-recorder dump (or on a full trace: " \
            "paramfsm.shard(..., trace=True), rt.trace.dump(...)) to see each leaked parameter's last records."
        if strict:
            raise LeakError(message)
        path = report_failure(None, "leak")
        log.warning(message + (f"\nFlight-recorder dump: {path}" if path is not None else ""))
    return leaks
