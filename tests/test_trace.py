"""Traces: JSONL round trips, Perfetto export, replay catching tampering, summaries and diffs."""

from __future__ import annotations

import json

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scenario_traces import UNITS, scenario_trace

from paramfsm.core.fsm import default_table
from paramfsm.core.spec import EFFECTS, State
from paramfsm.core.trace import SNAPSHOT, Trace, TraceRecord
from paramfsm.core.replay import final_states, replay
from paramfsm.core.trace_report import diff, summarize

TABLE = default_table()
N_PARAMS = sum(len(params) for params in UNITS.values())


# ------------------------------------------------------------ dump and load


def test_dump_load_replay_round_trip(tmp_path):
    trace = scenario_trace(rank=1)
    assert len(trace) > 20 and replay(trace.records, TABLE) is None
    loaded = Trace.load(trace.dump(tmp_path / "rank1.jsonl"))
    assert loaded.rank == 1
    assert loaded.records == trace.records
    assert replay(loaded.records, TABLE) is None


names = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
records = st.builds(
    TraceRecord,
    seq=st.integers(0, 2**40), t_ns=st.integers(0, 2**62), rank=st.integers(0, 1023),
    step=st.integers(0, 10**6), graph_task=st.integers(-1, 10**6), param=names, unit=names,
    event=names, src=st.sampled_from([s.name for s in State]), dst=st.sampled_from([s.name for s in State]),
    effects=st.lists(st.sampled_from(sorted(EFFECTS)), max_size=3).map(tuple),
    keep_graph=st.booleans(), retained=st.booleans(), holds=st.integers(0, 64), nbytes=st.integers(0, 2**40),
)


@settings(max_examples=50, deadline=None)
@given(st.lists(records, max_size=8))
def test_any_records_survive_dump_and_load(tmp_path_factory, recs):
    path = Trace(0, recs).dump(tmp_path_factory.mktemp("trace") / "t.jsonl")
    assert Trace.load(path).records == recs


@pytest.mark.parametrize("line, complaint", [
    ('{"seq": 0,', "not a trace record"),
    ('[1, 2]', "expected a JSON object"),
    ('{"seq": 0}', "lacks field"),
])
def test_malformed_lines_are_named(tmp_path, line, complaint):
    good = json.dumps(scenario_trace().records[0].to_json())
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{good}\n{line}\n", encoding="utf-8")
    with pytest.raises(ValueError, match=complaint) as info:
        Trace.load(path)
    assert f"{path}:2:" in str(info.value)


def test_mistyped_field_is_named(tmp_path):
    obj = scenario_trace().records[0].to_json() | {"t_ns": "soon"}
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(obj) + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match="'t_ns' has the wrong type"):
        Trace.load(path)


# ---------------------------------------------------------------- perfetto


def test_perfetto_is_chrome_trace_json(tmp_path):
    trace = scenario_trace(rank=2, leak=True)
    doc = json.loads(trace.to_perfetto(tmp_path / "t.json").read_text(encoding="utf-8"))
    events = doc["traceEvents"]
    assert isinstance(events, list) and events
    spans = [e for e in events if e["ph"] == "X"]
    assert spans
    for span in spans:
        assert {"name", "ts", "dur", "pid", "tid"} <= set(span)
        assert isinstance(span["ts"], (int, float)) and span["ts"] >= 0 and span["dur"] > 0
        assert span["pid"] == 2 and span["name"] in {s.name for s in State} - {"NOT_AVAILABLE"}
    threads = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert len(threads) == N_PARAMS
    assert {name.split(" ")[0] for name in threads.values()} == {p for ps in UNITS.values() for p in ps}
    assert {s["tid"] for s in spans} <= set(threads)
    # The leaked deferred parameters show as spans still open at the end.
    open_spans = [s for s in spans if s["args"].get("open")]
    assert {threads[s["tid"]].split(" ")[0] for s in open_spans} == set(UNITS["enc"])


def test_perfetto_of_empty_trace(tmp_path):
    doc = json.loads(Trace().to_perfetto(tmp_path / "empty.json").read_text(encoding="utf-8"))
    assert doc["traceEvents"] == []


# ------------------------------------------------------------------ replay


def test_changed_destination_is_caught_at_its_index():
    recs = scenario_trace().records
    k = next(i for i, r in enumerate(recs) if r.dst == "DEFERRED_RELEASE")
    tampered = recs[:k] + [attrs.evolve(recs[k], dst="NOT_AVAILABLE")] + recs[k + 1:]
    error = replay(tampered, TABLE)
    assert error is not None and error.index == k and error.record == tampered[k]
    assert "DEFERRED_RELEASE" in error.reason


def test_deleted_record_is_caught_at_the_next_record_of_that_parameter():
    recs = scenario_trace().records
    k = next(i for i, r in enumerate(recs) if r.event == "arrive")
    tampered = recs[:k] + recs[k + 1:]
    follower = next(i for i, r in enumerate(tampered) if i >= k and r.param == recs[k].param)
    error = replay(tampered, TABLE)
    assert error is not None and error.index == follower
    assert "INFLIGHT" in error.reason  # the previous records left it in flight
    assert f"record {follower}" in str(error) and recs[k].param in str(error)


def test_dropped_effect_is_caught():
    recs = scenario_trace().records
    k = next(i for i, r in enumerate(recs) if "start_gather" in r.effects)
    tampered = recs[:k] + [attrs.evolve(recs[k], effects=())] + recs[k + 1:]
    error = replay(tampered, TABLE)
    assert error is not None and error.index == k and "start_gather" in error.reason


def test_wrong_hold_count_is_caught():
    recs = scenario_trace().records
    k = next(i for i, r in enumerate(recs) if r.event == "release")
    tampered = recs[:k] + [attrs.evolve(recs[k], holds=recs[k].holds + 1)] + recs[k + 1:]
    error = replay(tampered, TABLE)
    assert error is not None and error.index == k and "holder" in error.reason


# ----------------------------------------------------------------- summary


def rec(t, param, event, src, dst, effects=(), *, holds=0, keep_graph=False, graph_task=-1, rank=0, nbytes=0):
    return TraceRecord(0, t, rank, 0, graph_task, param, "u", event, src, dst, tuple(effects),
                       keep_graph, False, holds, nbytes)


def hand_trace(rank_b: int = 0) -> list[TraceRecord]:
    """Parameter a (100 bytes) is deferred 50..150 and flushed; b (50 bytes, rank_b) is deferred 70..120,
    fetched again and left AVAILABLE (a leak)."""
    NA, IN, AV, DR = "NOT_AVAILABLE", "INFLIGHT", "AVAILABLE", "DEFERRED_RELEASE"
    a = dict(nbytes=100)
    b = dict(nbytes=50, rank=rank_b)
    recs = [
        rec(0, "a", "fetch", NA, IN, ["start_gather"], **a),
        rec(5, "b", "prefetch", NA, IN, ["start_gather"], **b),
        rec(10, "a", "arrive", IN, AV, ["unpack"], holds=1, **a),
        rec(25, "b", "arrive", IN, AV, ["unpack"], **b),
        rec(30, "a", "fetch", AV, AV, holds=1, **a),
        rec(40, "a", "release", AV, AV, holds=2, **a),
        rec(50, "a", "release", AV, DR, ["defer"], holds=1, keep_graph=True, graph_task=1, **a),
        rec(60, "b", "fetch", AV, AV, **b),
        rec(70, "b", "release", AV, DR, ["defer"], holds=1, keep_graph=True, graph_task=1, **b),
        rec(80, "a", "grad_ready", DR, DR, ["reduce_grad"], graph_task=1, **a),
        rec(120, "b", "fetch", DR, AV, ["undefer"], graph_task=2, **b),
        rec(150, "a", "flush", DR, NA, ["undefer", "free"], graph_task=2, **a),
    ]
    return [attrs.evolve(r, seq=i) for i, r in enumerate(recs)]


def test_hand_built_trace_is_legal():
    assert replay(hand_trace(), TABLE) is None


def test_summary_numbers():
    s = summarize(hand_trace())
    assert (s.records, s.params, s.ranks, s.duration_ns) == (12, 2, (0,), 150)
    st_ = s.states
    assert (st_["INFLIGHT"].spans, st_["INFLIGHT"].total_ns, st_["INFLIGHT"].open) == (2, 10 + 20, 0)
    # a: 10..50 (the fetch and release at 30 and 40 continue the span); b: 25..70, then 120..end (open)
    assert (st_["AVAILABLE"].spans, st_["AVAILABLE"].total_ns, st_["AVAILABLE"].open) == (2, 40 + 45, 1)
    assert (st_["DEFERRED_RELEASE"].spans, st_["DEFERRED_RELEASE"].total_ns) == (2, 100 + 50)
    assert (st_["NOT_AVAILABLE"].spans, st_["NOT_AVAILABLE"].open) == (0, 0)
    assert (s.gathers, s.gathered_bytes) == (2, 150)
    d = s.deferred
    assert (d.count, d.open, d.total_ns, d.max_ns, d.max_concurrent_bytes) == (2, 0, 150, 100, 150)
    assert s.graph_tasks == {-1: 7, 1: 3, 2: 2}
    assert [(leak.rank, leak.param, leak.state) for leak in s.leaks] == [(0, "b", "AVAILABLE")]
    assert [r.t_ns for r in s.leaks[0].last] == [5, 25, 60, 70, 120]


def test_deferred_bytes_do_not_add_up_across_ranks():
    assert summarize(hand_trace(rank_b=1)).deferred.max_concurrent_bytes == 100


def test_leak_tail_and_final_states_agree():
    recs = hand_trace()
    s = summarize(recs, leak_tail=2)
    assert [r.t_ns for r in s.leaks[0].last] == [70, 120]
    leaked = {key for key, last in final_states(recs).items() if last.dst != "NOT_AVAILABLE"}
    assert leaked == {(leak.rank, leak.param) for leak in s.leaks}


def test_summary_format_is_readable():
    text = summarize(hand_trace()).format()
    for expected in ("DEFERRED_RELEASE", "gathers: 2 (150 B)", "deferred windows: 2 (0 open)",
                     "leaks: 1", "'b'", "ends AVAILABLE", "fetch: DEFERRED_RELEASE -> AVAILABLE [undefer]"):
        assert expected in text, text
    assert "leaks: none" in summarize(scenario_trace().records).format()


def test_summary_of_scenario_counts_gathers():
    s = summarize(scenario_trace().records)
    gathers = [r for r in scenario_trace().records if "start_gather" in r.effects]
    assert s.gathers == len(gathers) == 2 * N_PARAMS
    assert s.deferred.count == N_PARAMS and not s.leaks
    assert summarize(scenario_trace(leak=True).records).deferred.open == len(UNITS["enc"])


def test_summary_of_nothing():
    s = summarize([])
    assert (s.records, s.gathers, s.leaks, s.deferred.count) == (0, 0, (), 0)
    assert "0 records" in s.format()


# -------------------------------------------------------------------- diff


def test_ranks_that_agree_have_no_divergence():
    # Different ranks and timestamps, same steps, events, states and effects.
    assert diff(scenario_trace(rank=0).records, scenario_trace(rank=1).records) is None


@pytest.mark.parametrize("field, value", [("event", "prefetch"), ("param", "enc.other"), ("step", 7),
                                          ("dst", "AVAILABLE"), ("effects", ("discard_gather",))])
def test_first_divergence_is_named(field, value):
    a = scenario_trace(rank=0).records
    b = scenario_trace(rank=1).records
    b[9] = attrs.evolve(b[9], **{field: value})
    b[12] = attrs.evolve(b[12], event="reset")  # later differences are not reported
    divergence = diff(a, b)
    assert divergence is not None and (divergence.index, divergence.field) == (9, field)
    assert (divergence.a, divergence.b) == (a[9], b[9])
    assert f"record 9 differs in '{field}'" in str(divergence)


def test_shorter_trace_diverges_where_it_ends():
    a = scenario_trace().records
    divergence = diff(a, a[:-3])
    assert (divergence.index, divergence.field, divergence.a, divergence.b) == (len(a) - 3, "length", a[-3], None)
    assert "trace B ends after" in str(divergence)
    assert diff(a[:-3], a).b == a[-3]


def _rec(seq, t_ns, rank, param, event, src, dst, effects=(), step=1, task=-1):
    return TraceRecord(seq=seq, t_ns=t_ns, rank=rank, step=step, graph_task=task, param=param, unit="u",
                       event=event, src=src, dst=dst, effects=tuple(effects), nbytes=64)


def test_perfetto_document_exactly(tmp_path):
    """The whole Chrome trace-event document for a small trace: every key the viewer reads."""
    records = [
        _rec(0, 1_000, 0, "w", "fetch", "NOT_AVAILABLE", "INFLIGHT", ["start_gather"]),
        _rec(1, 3_000, 0, "w", "arrive", "INFLIGHT", "AVAILABLE", ["unpack"]),
        _rec(2, 9_000, 0, "w", "release", "AVAILABLE", "NOT_AVAILABLE", ["free"], task=4),
        _rec(3, 5_000, 1, "b", "fetch", "NOT_AVAILABLE", "AVAILABLE"),
    ]
    path = Trace().to_perfetto(tmp_path / "nested" / "dir" / "t.json")
    assert json.loads(path.read_text(encoding="utf-8")) == {"traceEvents": [], "displayTimeUnit": "ns"}
    trace = Trace(0, records)
    doc = json.loads(trace.to_perfetto(tmp_path / "t.json").read_text(encoding="utf-8"))

    def span(state, pid, tid, ts, dur, first, **extra):
        return {"ph": "X", "name": state, "cat": "lifetime", "pid": pid, "tid": tid, "ts": ts, "dur": dur,
                "args": {"entered_by": first.event, "step": first.step, "graph_task": first.graph_task,
                         "bytes": 64, **extra}}

    def instant(name, r, tid):
        return {"ph": "i", "s": "t", "name": name, "pid": r.rank, "tid": tid, "ts": (r.t_ns - 1000) / 1000.0,
                "args": {"event": r.event, "step": r.step, "graph_task": r.graph_task}}

    assert doc == {"displayTimeUnit": "ns", "traceEvents": [
        {"ph": "M", "name": "thread_name", "pid": 0, "tid": 1, "args": {"name": "w [u]"}},
        instant("start_gather", records[0], 1),
        span("INFLIGHT", 0, 1, 0.0, 2.0, records[0], left_by="arrive"),
        instant("unpack", records[1], 1),
        span("AVAILABLE", 0, 1, 2.0, 6.0, records[1], left_by="release"),
        instant("free", records[2], 1),
        {"ph": "M", "name": "thread_name", "pid": 1, "tid": 2, "args": {"name": "b [u]"}},
        span("AVAILABLE", 1, 2, 4.0, 4.0, records[3], open=True),
        {"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "rank 0"}},
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "rank 1"}},
    ]}


def test_perfetto_span_has_a_visible_minimum_duration(tmp_path):
    trace = Trace(0, [_rec(0, 7_000, 0, "w", "fetch", "NOT_AVAILABLE", "AVAILABLE"),
                      _rec(1, 7_000, 0, "w", "release", "AVAILABLE", "NOT_AVAILABLE")])
    events = json.loads(trace.to_perfetto(tmp_path / "t.json").read_text(encoding="utf-8"))["traceEvents"]
    assert [e["dur"] for e in events if e["ph"] == "X"] == [0.001]


def test_a_table_without_a_digest_replays_records_of_any_spec():
    """A table that names no spec digest (one built by hand, say) checks transitions only."""
    from types import SimpleNamespace

    from paramfsm.core.replay import replay

    table = default_table()
    bare = SimpleNamespace(spec=table.spec, events=table.events, outcome=table.outcome)
    records = [attrs.evolve(r, spec="0123456789ab") for r in scenario_trace().records]
    assert replay(records, bare) is None
    assert "recorded under spec 0123456789ab" in str(replay(records, table))


def test_a_ring_window_opens_with_snapshots_stamped_like_its_first_record():
    """The snapshot records that open a ring's window carry the first record's seq, time, step and graph
    task, no graph flags, and the rank's coordinates; a window emptied by ``clear`` opens at the next seq."""
    from paramfsm.core.fsm import Lifetime, StepContext, step
    from paramfsm.core.replay import replay

    table = default_table()
    trace = Trace(0, limit=2, digest=table.digest, coord=(1, 0))
    a, b = Lifetime("a", "u", 64), Lifetime("b", "v", 64)
    trace.lifetimes = (a, b)
    ctx = StepContext(0, trace)
    for i, (rec, event) in enumerate(((b, "fetch"), (b, "arrive"), (a, "fetch"), (a, "arrive"), (a, "release"))):
        ctx.step, ctx.graph_task = 10 + i, 20 + 2 * i
        step(table, rec, event, ctx)
    records = trace.records
    first = records[2]
    assert [(r.param, r.dst, r.holds) for r in records[:2]] == [("a", "INFLIGHT", 1), ("b", "AVAILABLE", 1)]
    for snap in records[:2]:
        assert snap.event == SNAPSHOT and snap.src == snap.dst and snap.coord == (1, 0)
        assert (snap.seq, snap.t_ns, snap.step, snap.graph_task) == (first.seq, first.t_ns, first.step, first.graph_task)
        assert (snap.seq, snap.step, snap.graph_task) == (3, 13, 26) and not (snap.keep_graph or snap.retained)
    assert records[3].t_ns != first.t_ns and replay(records, table) is None
    trace.clear()
    assert [(r.param, r.seq, r.t_ns, r.step, r.graph_task) for r in trace.records] == [("b", 5, 0, 0, -1)]


def test_a_ring_that_dropped_its_first_record_opens_with_a_snapshot():
    from paramfsm.core.fsm import Lifetime, StepContext, step
    from paramfsm.core.replay import replay

    table = default_table()
    trace = Trace(0, limit=2, digest=table.digest)
    a = Lifetime("a", "u", 64)
    trace.lifetimes = (a,)
    ctx = StepContext(0, trace)
    for event in ("fetch", "arrive", "release"):
        step(table, a, event, ctx)
    records = trace.records
    assert [(r.event, r.seq, r.dst) for r in records] == [(SNAPSHOT, 1, "INFLIGHT"), ("arrive", 1, "AVAILABLE"),
                                                          ("release", 2, "NOT_AVAILABLE")]
    assert replay(records, table) is None
