"""Transition traces: one record per state change, dumped as JSON Lines, drawn in Perfetto, replayed.

A :class:`Trace` keeps its records in one of three ways (see [Note: three ways
to keep a trace]): a bounded ring, the flight recorder that is on by default;
the whole run in memory (``trace=True``); or the whole run streamed to a JSON
Lines file (``trace="run.jsonl"``). With ``trace=0``,
:func:`paramfsm.core.fsm.step` sees ``ctx.trace is None`` and does no work for it.

A trace is checked by replaying it through the compiled spec
(:func:`paramfsm.core.replay.replay`): each parameter's record sequence must start in the initial
state, every record's source state and hold count must be what the previous
records left, and the spec must allow exactly that destination with exactly
those effects.

This module imports neither ``torch`` nor ``cupy``.
"""

from __future__ import annotations

import bisect
import json
from operator import itemgetter
from pathlib import Path
from typing import Iterable, Iterator

from paramfsm.core.fsm import TAGS
from paramfsm.core.perfetto import write_perfetto
from paramfsm.core.spec import Residency, State
from paramfsm.core.trace_record import FIELDS, SNAPSHOT, TraceRecord, iter_jsonl

__all__ = ["DEFAULT_RING", "FIELDS", "SNAPSHOT", "STREAM_BATCH", "Trace", "TraceRecord", "iter_jsonl"]

#: Records the flight recorder keeps by default (``PARAMFSM_TRACE_RECORDS`` overrides it).
DEFAULT_RING = 8192
#: Records a streamed trace buffers before it writes them.
STREAM_BATCH = 4096


class Trace:
    """The transition records of one rank: a bounded ring, the whole run in memory, or a stream.

    [Note: three ways to keep a trace]
    :func:`paramfsm.core.fsm.step` calls :meth:`append` with the raw facts of a
    transition; they are kept as one tuple (no record object, no string
    formatting) and become :class:`TraceRecord` only when read, so keeping a
    trace costs about one tuple per transition. :func:`~paramfsm.core.fsm.step_many`
    keeps one tuple for the whole unit (:meth:`append_many`): the records and
    their holders before the step, one transition each when read.

    [Note: entries the collector never sees]
    An entry holds only numbers, strings and tuples of them: each record by
    its number in this trace (:meth:`_register`), the transition by its
    outcome's tag (one interned string naming event, source, destination and
    effects: :data:`paramfsm.core.fsm.TAGS`), the holders as a number, or a
    tuple of numbers when a unit's records differ. CPython stops tracking
    such a tuple the first time it collects the young generation, so entries
    that live for thousands of transitions (a ring's window, a whole trace)
    never reach the older generations. Entries that pointed at the records
    and states did: as the ring turned over, every few steps the collector
    ran a full collection of the process (torch's objects included, about
    150 ms here). A traced unit step cost 3.3 us against 0.5 us untraced; it
    now costs 0.9 us. Each record's recent history (``Lifetime.recent``)
    follows the same rule.

    * ``limit=N``: a ring of the last N transitions (the flight recorder). Its
      memory does not grow with the run: it trims itself once per N
      transitions, so it holds the raw tuples of at most 2N, and reading it
      gives the last N transitions. Once it has dropped records, reading
      it starts with :data:`SNAPSHOT` records that give each parameter's state
      and holders where the window opens, so the window replays through the
      spec from its first record like a whole trace does.
    * ``limit=None``: every transition, in memory.
    * ``path=...``: every transition, written to a JSON Lines file in batches
      of :data:`STREAM_BATCH`; memory stays bounded. :meth:`flush` writes what
      is buffered; :meth:`close` also closes the file.

    ``digest`` (the spec's, see :attr:`paramfsm.core.fsm.Table.digest`) goes
    into every record, so a trace checked against another spec says so.
    ``lifetimes`` (the parameters' :class:`~paramfsm.core.fsm.Lifetime`
    records) lets a snapshot name parameters that have no record in the window.
    """

    def __init__(self, rank: int = 0, records: Iterable[TraceRecord] = (), *, limit: int | None = None,
                 path: str | Path | None = None, digest: str = "", lifetimes: Iterable = (),
                 coord: tuple[int, ...] = ()):
        self.rank = rank
        self.digest = digest
        self.coord = tuple(coord)  # (replica, shard rank) under hybrid sharding
        self._coord_json = f',"coord":[{",".join(map(str, self.coord))}]' if self.coord else ""
        self.limit = limit
        self.path = Path(path) if path is not None else None
        self.lifetimes = tuple(lifetimes)
        self._loaded: list[TraceRecord] = list(records)
        self._done: list[TraceRecord] = []  # materialised raw entries (unbounded mode)
        self._done_raw = 0  # raw entries materialised into _done
        self._raw: list = []  # raw entries, oldest first (a ring drops a block of old ones at a time)
        # Entries name records by number: [Note: entries the collector never sees].
        self._keys: dict = {}  # record -> its number
        self._lifetimes: list = []  # number -> record
        self._group_keys: dict = {}  # tuple of records -> tuple of their numbers
        self._seq = 0  # the seq of the next transition appended
        self._cleared = 0  # the seq of the first transition after the last clear()
        # At this seq a ring drops what its window no longer needs and a stream writes (_trim).
        self._next_trim = float("inf") if limit is None else limit
        self._out = None
        self._about: dict = {}  # a streamed trace's JSON for each parameter's constant fields
        self._effects: dict = {}  # ... and for each effects tuple
        if self.path is not None:
            if limit is not None:
                raise ValueError("a streamed trace keeps every record: give limit or path, not both")
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._out = self.path.open("w", encoding="utf-8")
            self._next_trim = STREAM_BATCH

    @property
    def mode(self) -> str:
        """``"ring"``, ``"full"`` or ``"stream"``."""
        return "stream" if self.path is not None else "ring" if self.limit is not None else "full"

    def append(self, t_ns, ctx, rec, cell, keep_graph, retained, holds) -> None:
        """Called by :func:`paramfsm.core.fsm.step` for each transition (``cell``: its compiled
        outcome) while tracing is on."""
        seq = self._seq
        self._seq = seq + 1
        key = self._keys.get(rec)
        if key is None:
            key = self._register(rec)
        self._raw.append((seq, t_ns, ctx.step, ctx.graph_task, key, cell.tag, keep_graph, retained, holds))
        if seq >= self._next_trim:
            self._trim()

    def append_many(self, t_ns, ctx, records, cell, keep_graph, retained, holds) -> None:
        """One transition for each of ``records``, kept as one entry; called by
        :func:`paramfsm.core.fsm.step_many` before it moves them. ``holds``: the holders every record
        had before, or a tuple of each one's when they differ."""
        seq = self._seq
        self._seq = seq + len(records)
        if records.__class__ is not tuple:
            records = tuple(records)
        keys = self._group_keys.get(records)
        if keys is None:
            keys = self._register_group(records)
        self._raw.append((seq, t_ns, ctx.step, ctx.graph_task, keys, cell.tag, keep_graph, retained, holds))
        if seq >= self._next_trim:
            self._trim()

    def _register(self, rec) -> int:
        """The number that stands for ``rec`` in this trace's entries (see [Note: entries the collector
        never sees])."""
        key = self._keys[rec] = len(self._lifetimes)
        self._lifetimes.append(rec)
        return key

    def _register_group(self, records: tuple) -> tuple[int, ...]:
        """The numbers of a group of records, remembered for the next step of the same group."""
        if len(self._group_keys) >= _GROUPS_KEPT:
            self._group_keys.clear()
        keys = self._group_keys[records] = tuple(
            self._keys[rec] if rec in self._keys else self._register(rec) for rec in records)
        return keys

    def _transitions(self, raw) -> Iterator[tuple]:
        """The raw entries one transition each, with their records and states (a unit's entry from
        :meth:`append_many` becomes one per record): (seq, t_ns, step, graph task, record, event, src,
        dst, effects, keep_graph, retained, holds)."""
        lifetimes, states, tags = self._lifetimes, _STATES, TAGS
        for seq, t_ns, step, task, who, tag, keep_graph, retained, holds in raw:
            event, src, dst, effects = tags[tag]
            src, dst = states[src], states[dst]
            if who.__class__ is int:
                yield seq, t_ns, step, task, lifetimes[who], event, src, dst, effects, keep_graph, retained, holds
                continue
            each = holds.__class__ is tuple
            for i, key in enumerate(who):
                yield (seq + i, t_ns, step, task, lifetimes[key], event, src, dst, effects, keep_graph, retained,
                       holds[i] if each else holds)

    def _trim(self) -> None:
        """A stream writes what it buffered; a ring drops the oldest entries that the last ``limit``
        transitions do not need. Both run once per ``limit`` (or STREAM_BATCH) transitions, so a ring
        holds at most twice its limit."""
        if self.path is not None:
            self.flush()
            self._next_trim = self._seq + STREAM_BATCH
            return
        raw, start = self._raw, self._seq - self.limit
        # The last entry that starts at or before the window keeps its place (a unit's entry may
        # straddle the window's start); everything older goes in one slice deletion (a memmove).
        keep_from = bisect.bisect_right(raw, start, key=_entry_seq) - 1
        if keep_from > 0:
            del raw[:keep_from]
        self._next_trim = self._seq + self.limit

    def _record(self, e) -> TraceRecord:
        seq, t_ns, step, graph_task, rec, event, src, dst, effects, keep_graph, retained, holds = e
        machine, kind = _about(rec)
        return TraceRecord(seq, t_ns, self.rank, step, graph_task, rec.name, rec.unit, event, src.name, dst.name,
                           effects, bool(keep_graph), bool(retained), holds, rec.nbytes, self._digest(machine),
                           self.coord, machine, kind)

    def _digest(self, machine: str) -> str:
        """The digest a record of ``machine`` carries: the lifetime spec's, or the residency machine's."""
        if not machine:
            return self.digest
        from paramfsm.core.fsm import residency_table
        return residency_table().digest

    @property
    def records(self) -> list[TraceRecord]:
        """Every record kept, oldest first (a ring that dropped records opens with snapshot records)."""
        if self.path is not None:
            self.flush()
            return self._loaded + list(iter_jsonl(self.path))
        if self.limit is not None:
            window = list(self._transitions(self._raw))[-self.limit:]
            return self._loaded + self._snapshot(window) + [self._record(e) for e in window]
        raw, done = self._raw, self._done
        if self._done_raw < len(raw):
            done.extend(self._record(e) for e in self._transitions(raw[self._done_raw:]))
            self._done_raw = len(raw)
        return self._loaded + done

    def _snapshot(self, window: list) -> list[TraceRecord]:
        """Where a ring's window opens, for the parameters not resting there (empty if nothing was dropped).

        A parameter's state at the window's start is the source of its first
        record in the window; one without records is where it is now.
        """
        first_seq = window[0][0] if window else self.appended
        if first_seq == 0:
            return []
        start: dict = {}
        for e in window:
            start.setdefault(e[4], (e[6], e[11]))
        for rec in self.lifetimes:
            start.setdefault(rec, (rec.state, rec.holds))
        t_ns, step, graph_task = (window[0][1], window[0][2], window[0][3]) if window else (0, 0, -1)
        return [TraceRecord(first_seq, t_ns, self.rank, step, graph_task, rec.name, rec.unit, SNAPSHOT,
                            state.name, state.name, (), False, False, holds, rec.nbytes,
                            self._digest(_about(rec)[0]), self.coord, *_about(rec))
                for rec, (state, holds) in start.items() if state.name != _RESTING or holds]

    @property
    def appended(self) -> int:
        """Transitions appended so far (the seq the next one gets)."""
        return self._seq

    def flush(self) -> None:
        """A streamed trace: write the buffered records now (cheap when nothing is buffered)."""
        out, raw = self._out, self._raw
        if out is None or not raw:
            return
        out.write("".join(map(self._line, self._transitions(raw))))
        out.flush()
        raw.clear()

    def _line(self, e) -> str:
        """One raw entry as a JSON line, the same object as ``TraceRecord.to_json`` (formatted directly:
        a streamed trace writes every transition, so this is its cost)."""
        seq, t_ns, step, graph_task, rec, event, src, dst, effects, keep_graph, retained, holds = e
        about = self._about.get(rec)
        if about is None:
            machine, kind = _about(rec)
            which = f',"machine":"{machine}","kind":"{kind}"' if machine else ""
            about = self._about[rec] = (json.dumps(rec.name), json.dumps(rec.unit), rec.nbytes,
                                        self._digest(machine), which)
        name, unit, nbytes, digest, which = about
        listed = self._effects.get(effects)
        if listed is None:
            listed = self._effects[effects] = json.dumps(list(effects), separators=(",", ":"))
        return (f'{{"seq":{seq},"t_ns":{t_ns},"rank":{self.rank},"step":{step},"graph_task":{graph_task},'
                f'"param":{name},"unit":{unit},"event":"{event}","src":"{src.name}","dst":"{dst.name}",'
                f'"effects":{listed},"keep_graph":{_BOOL[bool(keep_graph)]},"retained":{_BOOL[bool(retained)]},'
                f'"holds":{holds},"nbytes":{nbytes},"spec":"{digest}"{self._coord_json}{which}}}\n')

    def close(self) -> None:
        """Flush and close a streamed trace's file (the records stay readable)."""
        self.flush()
        if self._out is not None:
            self._out.close()
            self._out = None
            self._next_trim = float("inf")

    def clear(self) -> None:
        """Forget every record kept (a streamed trace starts its file again)."""
        self._cleared = self._seq
        self._raw.clear()
        self._done.clear()
        self._done_raw = 0
        self._loaded.clear()
        if self._out is not None:
            self._out.seek(0)
            self._out.truncate()

    def __len__(self) -> int:
        """Records kept (for a stream, every record written or buffered)."""
        if self.path is not None:
            return self.appended
        kept = self._seq - self._cleared
        return len(self._loaded) + (kept if self.limit is None else min(kept, self.limit))

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
        records = self.records
        with path.open("w", encoding="utf-8") as out:
            for r in records:
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


_RESTING = State.NOT_AVAILABLE.name
_entry_seq = itemgetter(0)  # a raw entry's seq
_STATES = {state.name: state for machine in (State, Residency) for state in machine}


def _about(rec) -> tuple[str, str]:
    """(machine, kind) of a stepped record: ("", "") for a parameter's lifetime."""
    machine = getattr(rec, "machine", "")
    return (machine, rec.kind) if machine else ("", "")
#: Groups of records whose numbers a trace remembers (a bound, so odd groups cannot grow it for ever).
_GROUPS_KEPT = 4096
_BOOL = {False: "false", True: "true"}

