"""``step_many`` (one table lookup for a unit's records) against ``step`` on each record in turn.

Whatever the records' situations, the batched step must leave every record in
the state, hold count and recent history that stepping them one by one gives,
append the same trace records (timestamps aside) in the same order, return the
same effects, and raise the same error with nothing changed; when the records
are in different situations it must change nothing and return None. Strict
mode's cross-check (``CrossCheckedStep.many``) must accept it and catch a
table that disagrees with the spec.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paramfsm.core.fsm import Lifetime, StepContext, default_table, ext_class, step, step_many
from paramfsm.core.machine import CrossCheckedStep
from paramfsm.core.spec import State
from paramfsm.core.trace import Trace
from paramfsm.errors import IllegalTransition

TABLE = default_table()
EVENTS = sorted(TABLE.events)
# Event sequences that reach every state with 0, 1 or more holders.
SETUPS = {
    "rest": [],
    "inflight": ["prefetch"], "inflight_held": ["fetch"], "inflight_held2": ["fetch", "fetch"],
    "available": ["prefetch", "arrive"], "held": ["fetch", "arrive"], "held2": ["fetch", "arrive", "fetch"],
    "held3": ["fetch", "arrive", "fetch", "fetch"],
}


def _record(i: int, setup: str, deferred: bool) -> Lifetime:
    rec = Lifetime(f"p{i}", "u", nbytes=4 * (i + 1))
    ctx = StepContext()
    for event in SETUPS[setup]:
        step(TABLE, rec, event, ctx)
    if deferred and setup == "held":
        step(TABLE, rec, "release", ctx, keep_graph=True)
    return rec


def _pair(setups, deferred):
    """Two identical lists of records in the given situations, with their own traces."""
    made = []
    for _ in range(2):
        made.append([_record(i, s, d) for i, (s, d) in enumerate(zip(setups, deferred))])
    return made


def _situation(rec: Lifetime, event: str, keep_graph: bool, retained: bool) -> tuple:
    """What selects the outcome: the state, and the extended-state class where guards tell them apart."""
    guarded = TABLE.cells[rec.state][event].__class__ is tuple
    return rec.state, ext_class(rec.holds, keep_graph, retained) if guarded else None


def _facts(trace: Trace) -> list[tuple]:
    return [(r.seq, r.step, r.graph_task, r.param, r.unit, r.event, r.src, r.dst, r.effects, r.keep_graph,
             r.retained, r.holds, r.nbytes) for r in trace.records]


@settings(max_examples=300, deadline=None)
@given(setups=st.lists(st.sampled_from(sorted(SETUPS)), min_size=1, max_size=4),
       deferred=st.lists(st.booleans(), min_size=4, max_size=4),
       event=st.sampled_from(EVENTS), keep_graph=st.booleans(), retained=st.booleans())
def test_step_many_is_step_on_each_record(setups, deferred, event, keep_graph, retained):
    batch, single = _pair(setups, deferred)
    ctx_b, ctx_s = StepContext(rank=1, trace=Trace(1)), StepContext(rank=1, trace=Trace(1))
    for ctx in (ctx_b, ctx_s):
        ctx.step, ctx.graph_task = 3, 7
    shared = len({_situation(r, event, keep_graph, retained) for r in batch}) == 1
    try:
        effects = step_many(TABLE, batch, event, ctx_b, keep_graph, retained)
    except IllegalTransition as exc:
        with pytest.raises(IllegalTransition) as expected:
            step(TABLE, single[0], event, ctx_s, keep_graph, retained)
        assert str(exc) == str(expected.value)
        assert [(r.state, r.holds, list(r.recent)) for r in batch] == \
            [(r.state, r.holds, list(r.recent)) for r in single]
        assert len(ctx_b.trace) == 0
        return
    if not shared:
        assert effects is None
        assert [(r.state, r.holds, list(r.recent)) for r in batch] == \
            [(r.state, r.holds, list(r.recent)) for r in single]
        assert len(ctx_b.trace) == 0
        return
    returned = [step(TABLE, r, event, ctx_s, keep_graph, retained) for r in single]
    assert all(e == effects for e in returned)
    assert [(r.state, r.holds, list(r.recent)) for r in batch] == \
        [(r.state, r.holds, list(r.recent)) for r in single]
    assert _facts(ctx_b.trace) == _facts(ctx_s.trace)


def test_one_lookup_moves_every_record_and_traces_each():
    records = [Lifetime(f"u.p{i}", "u", nbytes=8) for i in range(3)]
    ctx = StepContext(trace=Trace(0))
    assert step_many(TABLE, records, "fetch", ctx) == ("start_gather",)
    assert step_many(TABLE, records, "arrive", ctx) == ("unpack",)
    assert step_many(TABLE, records, "prefetch", ctx) == ()  # an ignore row: nothing recorded
    assert [(r.state, r.holds) for r in records] == [(State.AVAILABLE, 1)] * 3
    assert [(r.seq, r.param, r.event, r.holds) for r in ctx.trace.records] == [
        (0, "u.p0", "fetch", 0), (1, "u.p1", "fetch", 0), (2, "u.p2", "fetch", 0),
        (3, "u.p0", "arrive", 1), (4, "u.p1", "arrive", 1), (5, "u.p2", "arrive", 1)]
    step(TABLE, records[1], "fetch", ctx)  # p1 now has two holders: another extended-state class
    assert step_many(TABLE, records, "release", ctx) is None
    assert [r.holds for r in records] == [1, 2, 1] and len(ctx.trace) == 7


def test_an_error_row_raises_for_the_first_record_and_changes_nothing():
    records = [Lifetime(f"p{i}", "u") for i in range(2)]
    ctx = StepContext(trace=Trace(0))
    with pytest.raises(IllegalTransition, match="'p0'"):
        step_many(TABLE, records, "release", ctx)
    with pytest.raises(IllegalTransition, match="no event 'bogus'"):
        step_many(TABLE, records, "bogus", ctx)
    assert [(r.state, r.holds, len(r.recent)) for r in records] == [(State.NOT_AVAILABLE, 0, 0)] * 2
    assert len(ctx.trace) == 0


def test_strict_cross_checks_each_record_of_a_batch():
    checked = CrossCheckedStep(TABLE.spec, step, step_many)
    records = [Lifetime(f"p{i}", "u") for i in range(2)]
    ctx = StepContext()
    assert checked.many(TABLE, records, "fetch", ctx) == ("start_gather",)
    assert checked.many(TABLE, records, "arrive", ctx) == ("unpack",)
    with pytest.raises(IllegalTransition):
        checked.many(TABLE, records, "arrive", ctx)

    def lying(table, recs, event, ctx, keep_graph=False, retained=False):
        effects = step_many(table, recs, event, ctx, keep_graph, retained)
        recs[-1].holds += 1  # a compiled table that miscounts holders on one record
        return effects

    liar = CrossCheckedStep(TABLE.spec, step, lying)
    with pytest.raises(AssertionError, match="strict: 'fetch' in AVAILABLE .* on 'p1'"):
        liar.many(TABLE, records, "fetch", ctx)


@settings(max_examples=200, deadline=None)
@given(ops=st.lists(st.tuples(st.booleans(), st.sampled_from(["fetch", "arrive", "release", "prefetch"])),
                    min_size=1, max_size=30),
       limit=st.integers(min_value=1, max_value=12))
def test_a_ring_of_unit_tuples_reads_as_the_last_n_transitions(ops, limit):
    """``step_many`` keeps one raw tuple per unit; a ring must still read as exactly the last ``limit``
    transitions of the whole trace (a tuple straddling the window's edge is cut), open with the snapshot
    its window needs, replay clean, and count its records right."""
    from paramfsm.core.trace import SNAPSHOT
    from paramfsm.core.replay import replay

    lifetimes = [Lifetime(f"p{i}", "u") for i in range(3)]
    full, ring = Trace(0), Trace(0, limit=limit, lifetimes=lifetimes)
    mirror = [Lifetime(f"p{i}", "u") for i in range(3)]
    ctx_full, ctx_ring = StepContext(trace=full), StepContext(trace=ring)
    for batched, event in ops:
        for records, ctx in ((mirror, ctx_full), (lifetimes, ctx_ring)):
            try:
                if batched and step_many(TABLE, records, event, ctx) is not None:
                    continue
                for rec in records:
                    step(TABLE, rec, event, ctx)
            except IllegalTransition:
                pass
    kept = [r for r in ring.records if r.event != SNAPSHOT]
    want = full.records[-limit:]
    assert [(r.seq, r.param, r.event, r.src, r.dst, r.holds) for r in kept] == \
        [(r.seq, r.param, r.event, r.src, r.dst, r.holds) for r in want]
    assert len(ring) == len(want) and ring.appended == full.appended
    assert replay(ring.records, TABLE) is None


def test_trace_and_history_entries_are_left_to_the_young_generation():
    """[Note: entries the collector never sees]: once collected young, no trace or history entry is
    tracked by the garbage collector, for single and unit steps, uniform or mixed holders alike."""
    import gc

    records = [Lifetime(f"p{i}", "u") for i in range(3)]
    ctx = StepContext(trace=Trace(0, limit=64))
    for _ in range(40):
        assert step_many(TABLE, records, "fetch", ctx) is not None
        step(TABLE, records[0], "fetch", ctx)  # the unit's holders now differ: 2, 1, 1
        assert step_many(TABLE, tuple(records), "arrive", ctx) is not None
        step(TABLE, records[0], "release", ctx)
        assert step_many(TABLE, records, "release", ctx) is not None
    # A tuple is untracked once its items are: the first collection may meet an entry before the
    # group's numbers it holds (made once, then shared), so collect twice.
    gc.collect()
    gc.collect()
    entries = list(ctx.trace._raw)
    assert len(entries) > 10 and any(isinstance(e[-1], tuple) for e in entries)  # mixed holders were kept
    assert not [e for e in entries if gc.is_tracked(e)]
    assert not [e for rec in records for e in rec.recent if gc.is_tracked(e)]
    arrivals = [(r.param, r.holds) for r in ctx.trace.records if r.event == "arrive"][-3:]
    assert arrivals == [("p0", 2), ("p1", 1), ("p2", 1)]
