"""The three ways to keep a trace (ring, whole run in memory, stream) give the same records.

:class:`paramfsm.core.trace.Trace` is driven here through
:func:`paramfsm.core.fsm.step` and :func:`~paramfsm.core.fsm.step_many`
exactly as the scheduler drives it. The reference is the trace kept whole in
memory: a stream must write the same lines that ``dump`` writes for it, a
ring must read as its last ``limit`` records (after snapshots), a unit's
grouped step must read as the same step applied record by record, and the
bounds the docstring promises (a ring's memory, a stream's batches) hold.
"""

from __future__ import annotations

import re

import attrs
import pytest

from paramfsm.core.fsm import Lifetime, StepContext, default_table, step, step_many
from paramfsm.core.replay import replay
from paramfsm.core.trace import SNAPSHOT, STREAM_BATCH, Trace

TABLE = default_table()


def _unit() -> list[Lifetime]:
    return [Lifetime("w", "unit", 64), Lifetime("b", "unit", 8), Lifetime("é", "unit", 4)]


def _drive(trace: Trace, recs: list[Lifetime], rounds: int = 3, *, grouped: bool = True) -> None:
    """A unit of three parameters fetched by two holders, used, released with and without a kept graph.

    The first parameter is held three times and the others twice, so a grouped step of the unit
    carries each record's own holders. ``grouped=False`` applies every step record by record.
    """
    ctx = StepContext(rank=trace.rank, trace=trace)

    def each(event, **flags):
        if grouped:
            assert step_many(TABLE, recs, event, ctx, **flags) is not None, event
        else:
            for rec in recs:
                step(TABLE, rec, event, ctx, **flags)

    for r in range(rounds):
        ctx.step, ctx.graph_task = r, -1
        each("fetch")
        each("arrive")
        each("fetch")
        step(TABLE, recs[0], "fetch", ctx)
        each("release")
        step(TABLE, recs[0], "release", ctx)
        each("release")
        ctx.graph_task = 10 + r  # a backward that keeps its graph, then the flush of its deferred releases
        each("fetch")
        each("arrive")
        each("grad_ready")
        each("release", keep_graph=True)
        each("flush", retained=True)
        each("flush")


_TIME = re.compile(r'"t_ns":\d+,')


def _without_time(records):
    return [attrs.evolve(r, t_ns=0) for r in records]


def test_a_grouped_step_reads_as_the_same_step_record_by_record():
    grouped, single = Trace(3, digest=TABLE.digest), Trace(3, digest=TABLE.digest)
    _drive(grouped, _unit())
    _drive(single, _unit(), grouped=False)
    assert _without_time(grouped.records) == _without_time(single.records)
    assert [r.seq for r in grouped.records] == list(range(grouped.appended))
    assert {r.holds for r in grouped.records if r.param == "w"} != {r.holds for r in grouped.records
                                                                    if r.param == "b"}
    assert any(r.keep_graph for r in grouped.records) and replay(grouped.records, TABLE) is None


@pytest.mark.parametrize("coord", [(), (1, 0)])
def test_a_stream_writes_what_dump_writes_for_the_whole_trace(tmp_path, coord):
    full = Trace(2, digest=TABLE.digest, coord=coord)
    stream = Trace(2, path=tmp_path / "new" / "dir" / "run.jsonl", digest=TABLE.digest, coord=coord)
    for trace in (full, stream):
        _drive(trace, _unit())
    stream.flush()
    written = stream.path.read_bytes().decode("utf-8")
    dumped = full.dump(tmp_path / "dump.jsonl").read_text("utf-8")
    assert _TIME.sub("", written) == _TIME.sub("", dumped) and written.count("\n") == full.appended
    assert _without_time(stream.records) == _without_time(full.records)
    assert len(stream) == len(full) == full.appended
    stream.close()
    before = stream.records
    stream.close()  # closing twice is harmless, and the records stay readable
    assert stream.records == before


def test_a_stream_writes_in_batches_and_starts_again_when_cleared(tmp_path):
    stream = Trace(0, path=tmp_path / "run.jsonl")
    rec, ctx = Lifetime("p", "u"), StepContext(trace=stream)
    events = ["fetch", "arrive", "release"]
    for i in range(STREAM_BATCH + 11):  # whole fetch, arrive, release cycles
        step(TABLE, rec, events[i % 3], ctx)
    assert len(stream.path.read_text().splitlines()) == STREAM_BATCH + 1, "one batch, written when it filled"
    assert len(stream) == STREAM_BATCH + 11
    stream.clear()
    for event in ("fetch", "arrive"):
        step(TABLE, rec, event, ctx)
    assert [(r.seq, r.event) for r in stream.records] == [(STREAM_BATCH + 11, "fetch"),
                                                         (STREAM_BATCH + 12, "arrive")]
    assert stream.path.read_text().count("\n") == 2
    with pytest.raises(ValueError, match="^a streamed trace keeps every record: give limit or path, not both$"):
        Trace(0, path=tmp_path / "other.jsonl", limit=4)


@pytest.mark.parametrize("limit", [1, 2, 7, 40])
@pytest.mark.parametrize("grouped", [True, False])
def test_a_ring_reads_as_the_last_records_of_the_whole_trace(limit, grouped):
    full = Trace(1, digest=TABLE.digest)
    ring = Trace(1, limit=limit, digest=TABLE.digest)
    _drive(full, _unit(), rounds=4, grouped=grouped)
    _drive(ring, _unit(), rounds=4, grouped=grouped)
    records = ring.records
    window = [r for r in records if r.event != SNAPSHOT]
    assert _without_time(window) == _without_time(full.records[-limit:])
    assert len(ring) == limit and len(window) == limit
    assert len(ring._raw) <= 2 * limit, "a ring's memory does not grow with the run"
    assert replay(records, TABLE) is None


def test_a_ring_names_resting_parameters_given_at_construction():
    """A parameter with no record in the window, not at rest, opens the window as a snapshot."""
    held, other = Lifetime("held", "u", 4), Lifetime("other", "v", 4)
    ring = Trace(0, limit=2, digest=TABLE.digest, lifetimes=[held, other])
    ctx = StepContext(trace=ring)
    step(TABLE, held, "fetch", ctx)
    step(TABLE, held, "arrive", ctx)
    for event in ("fetch", "arrive", "release"):
        step(TABLE, other, event, ctx)
    records = ring.records
    assert [(r.param, r.event, r.dst, r.holds) for r in records] == [
        ("other", SNAPSHOT, "INFLIGHT", 1), ("held", SNAPSHOT, "AVAILABLE", 1),
        ("other", "arrive", "AVAILABLE", 1), ("other", "release", "NOT_AVAILABLE", 1)]
    assert replay(records, TABLE) is None


def test_clearing_a_trace_in_memory_keeps_counting_its_sequence():
    for limit in (None, 50):
        trace = Trace(0, limit=limit)
        rec, ctx = Lifetime("p", "u"), StepContext(trace=trace)
        step(TABLE, rec, "fetch", ctx)
        assert len(trace.records) == 1
        trace.clear()
        assert len(trace) == 0 and trace.records == []
        step(TABLE, rec, "arrive", ctx)
        step(TABLE, rec, "release", ctx)
        window = [(r.seq, r.event) for r in trace.records if r.event != SNAPSHOT]
        assert window == [(1, "arrive"), (2, "release")]
        assert len(trace) == 2 and trace.appended == 3
