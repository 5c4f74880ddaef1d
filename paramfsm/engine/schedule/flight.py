"""The flight recorder's dumps: a rank's last transitions, written to disk when something goes wrong.

Every runtime keeps a bounded ring of its last transitions (see
:class:`paramfsm.core.trace.Trace`). When a run fails, the ring is what
explains the failure, so it is written as JSON Lines, automatically, on:

* ``IllegalTransition``, ``RankDesync``, ``CollectiveTimeout`` and any other
  exception raised while the scheduler applies an event;
* a leak found by the audit after the final backward;
* an exception inside the model's forward;
* the recovery from an interrupted forward or backward (an exception inside
  backward, seen at the next forward or at ``rt.reset()``).

A dump goes to ``$PARAMFSM_TRACE_DIR`` (default: the working directory) as
``paramfsm-trace-rank{R}-step{S}-{reason}.jsonl``. It opens with snapshot
records when the ring dropped older transitions, so ``paramfsm trace check
FILE --allow-open`` replays it from its first record. A streamed trace
(``trace="run.jsonl"``) is flushed instead: the file already holds everything.
The exception gets a note naming the file; the dump is logged as a warning.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from paramfsm import errors
from paramfsm.core.trace import DEFAULT_RING, Trace

log = logging.getLogger(__name__)

DIR_ENV = "PARAMFSM_TRACE_DIR"
TRACE_RECORDS_ENV = "PARAMFSM_TRACE_RECORDS"


def make_trace(trace, rank: int, digest: str, lifetimes, coord: tuple[int, ...] = ()) -> Trace:
    """The runtime's Trace for ``shard(..., trace=...)`` (see :func:`paramfsm.shard`).

    False (or None): the flight recorder, a ring of ``$PARAMFSM_TRACE_RECORDS``
    (default :data:`~paramfsm.core.trace.DEFAULT_RING`) records; an int: a ring
    of that many (0: a Trace that records nothing); True: every record in
    memory; a path: every record streamed to that file. ``coord``: the rank's
    (replica, shard rank) under hybrid sharding, written into every record.
    """
    if trace is True:
        return Trace(rank, digest=digest, lifetimes=lifetimes, coord=coord)
    if isinstance(trace, (str, os.PathLike)):
        try:
            return Trace(rank, path=trace, digest=digest, lifetimes=lifetimes, coord=coord)
        except OSError as exc:
            raise errors.ParamFSMError(f"trace={str(trace)!r}: cannot open it for writing: {exc.strerror or exc}") from None
    if trace is False or trace is None:
        text = os.environ.get(TRACE_RECORDS_ENV, "").strip()
        if not text.isdigit() and text:
            raise errors.ParamFSMError(f"{TRACE_RECORDS_ENV}={text!r}: expected a number of records (0: off)")
        trace = int(text) if text else DEFAULT_RING
    if not isinstance(trace, int) or trace < 0:
        raise errors.ParamFSMError(f"trace={trace!r}: expected False (the flight recorder), True (every transition), "
                            "a number of records to keep (0: none) or a JSON Lines path to stream to")
    return Trace(rank, limit=trace, digest=digest, lifetimes=lifetimes, coord=coord)


#: Dumps one runtime writes at most (a leak repeated every step must not fill the disk).
MAX_DUMPS = 16

_REASONS = (
    (errors.IllegalTransition, "illegal-transition"),
    (errors.RankDesync, "rank-desync"),
    (errors.CollectiveTimeout, "collective-timeout"),
)


def reason_of(exc: BaseException | None) -> str:
    """The short name of a failure, used in the dump's file name."""
    for cls, reason in _REASONS:
        if isinstance(exc, cls):
            return reason
    if type(exc).__name__ == "LeakError":
        return "leak"
    return "exception"


def dump_dir() -> Path:
    """Where dumps go: ``$PARAMFSM_TRACE_DIR``, else the working directory."""
    return Path(os.environ.get(DIR_ENV) or os.getcwd())


class FlightRecorder:
    """Writes a runtime's trace when a failure is reported; at most one dump per new records."""

    def __init__(self, trace, ctx, memory=None):
        self.trace, self.ctx = trace, ctx
        self.dumps: list[Path] = []
        # Transitions seen at the last dump: nothing new, no dump. It starts at 0, so a failure before
        # the first transition (a forward stopped by a guard of shard(), say) writes no empty dump.
        self._dumped_at = 0
        self._capped = False
        self.memory = memory  # () -> a line of the bytes held by kind, for messages (None: no line)

    def failed(self, exc: BaseException | None = None, reason: str | None = None) -> Path | None:
        """Dump for a failure (``exc`` raised, or ``reason`` without one); note the file on ``exc``."""
        if exc is not None and getattr(exc, "paramfsm_dump", None) is not None:
            return exc.paramfsm_dump  # already dumped where it was first seen
        path = self.dump(reason or reason_of(exc))
        if exc is not None and path is not None:
            try:
                exc.paramfsm_dump = path
            except AttributeError:
                return path
            held = f" (memory held: {self.memory()})" if self.memory is not None else ""
            exc.add_note(f"paramfsm flight recorder: rank {self.ctx.rank}'s last transitions are in {path}; "
                         f"replay them with `paramfsm trace check {path} --allow-open`{held}")
        return path

    def dump(self, reason: str) -> Path | None:
        """Write the trace for ``reason``; None when tracing is off, nothing is new, or the cap is reached."""
        trace = self.trace
        if trace is None:
            return None
        if trace.mode == "stream":
            trace.flush()
            return trace.path
        seen = trace.appended
        if seen == self._dumped_at:
            return self.dumps[-1] if self.dumps else None
        if len(self.dumps) >= MAX_DUMPS:
            if not self._capped:
                log.warning("paramfsm: rank %d wrote %d flight-recorder dumps; writing no more",
                            self.ctx.rank, MAX_DUMPS)
                self._capped = True
            return None
        path = dump_dir() / f"paramfsm-trace-rank{self.ctx.rank}-step{self.ctx.step}-{reason}.jsonl"
        try:
            trace.dump(path)
        except OSError as exc:
            log.warning("paramfsm: cannot write the flight-recorder dump %s: %s", path, exc.strerror or exc)
            return None
        self._dumped_at = seen
        self.dumps.append(path)
        held = f"; memory held: {self.memory()}" if self.memory is not None else ""
        log.warning("paramfsm: %s on rank %d at step %d: last %d transitions written to %s "
                    "(paramfsm trace check %s --allow-open)%s", reason, self.ctx.rank, self.ctx.step,
                    len(trace), path, path, held)
        return path
