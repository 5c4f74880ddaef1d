"""Details of the FSM core that the property tests reach too rarely to pin down.

Three or more holders, the defaults of ``step``, what a traced transition
records, what an illegal one reports, how replay names its first bad record,
and the exact JSON Lines form of a trace. Mutation testing (``make mutate``)
showed each of these could change without a test failing.
"""

from __future__ import annotations

import json

import pytest

from paramfsm.core.fsm import HISTORY, Lifetime, StepContext, compile_table, default_table, ext_class, step
from paramfsm.core.replay import replay
from paramfsm.core.spec import State, load_spec
from paramfsm.core.trace import Trace, TraceRecord
from paramfsm.errors import IllegalTransition

TABLE = default_table()


def _gathered(holds: int) -> Lifetime:
    rec = Lifetime("blocks.0.w", "blocks.0", nbytes=96)
    ctx = StepContext(rank=3)
    step(TABLE, rec, "fetch", ctx)
    step(TABLE, rec, "arrive", ctx)
    for _ in range(holds - 1):
        step(TABLE, rec, "fetch", ctx)
    assert (rec.state, rec.holds) == (State.AVAILABLE, holds)
    return rec


def test_holds_beyond_two_are_one_class():
    assert ext_class(3, False, False) == ext_class(2, False, False) == 8
    assert ext_class(7, True, True) == 11 and ext_class(1, True, False) == 6
    rec = _gathered(3)
    step(TABLE, rec, "release", StepContext())
    assert (rec.state, rec.holds) == (State.AVAILABLE, 2)


def test_step_defaults_are_a_plain_backward():
    """keep_graph and retained default to False: the last release frees, it does not defer."""
    rec = _gathered(1)
    effects = step(TABLE, rec, "release", StepContext())
    assert rec.state is State.NOT_AVAILABLE and "free" in effects


def test_a_traced_transition_records_everything():
    trace = Trace(rank=3)
    ctx = StepContext(rank=3, trace=trace)
    ctx.step, ctx.graph_task = 5, 9
    rec = Lifetime("w", "u", nbytes=96)
    step(TABLE, rec, "fetch", ctx)
    step(TABLE, rec, "arrive", ctx)
    step(TABLE, rec, "release", ctx, keep_graph=True, retained=True)
    last = trace.records[-1]
    assert (last.seq, last.rank, last.step, last.graph_task, last.param, last.unit) == (2, 3, 5, 9, "w", "u")
    assert (last.event, last.src, last.dst) == ("release", "AVAILABLE", "DEFERRED_RELEASE")
    assert (last.keep_graph, last.retained, last.holds, last.nbytes) == (True, True, 1, 96)
    assert trace.count("start_gather", param="w") == 1 and trace.count("start_gather", param="v") == 0
    assert replay(trace.records, TABLE) is None


def test_a_fresh_context_starts_at_step_zero_outside_backward():
    ctx = StepContext()
    assert (ctx.rank, ctx.step, ctx.graph_task, ctx.trace) == (0, 0, -1, None)


def test_an_illegal_transition_reports_state_holds_reason_and_history():
    rec = _gathered(2)
    with pytest.raises(IllegalTransition) as info:
        step(TABLE, rec, "arrive", StepContext(rank=3))
    err = info.value
    assert (err.param, err.unit, err.state, err.event, err.rank, err.holds) == \
        ("blocks.0.w", "blocks.0", "AVAILABLE", "arrive", 3, 2)
    assert err.reason.endswith("]") and "[" in err.reason and len(err.reason) > 10
    assert len(err.history) == 3 and err.history[-1].endswith("fetch: AVAILABLE -> AVAILABLE")
    assert (rec.state, rec.holds) == (State.AVAILABLE, 2), "an illegal event changes nothing"


def test_history_keeps_the_last_events():
    rec = _gathered(1)
    for _ in range(HISTORY + 3):
        step(TABLE, rec, "fetch", StepContext())
    assert len(rec.recent) == HISTORY


def test_the_default_table_is_compiled_once_from_the_shipped_spec():
    assert default_table() is TABLE
    fresh = compile_table(load_spec())
    for state in State:
        for event in fresh.events:
            for holds in (0, 1, 2):
                for keep in (False, True):
                    for retained in (False, True):
                        a = fresh.outcome(state, event, holds, keep, retained)
                        b = TABLE.outcome(state, event, holds, keep, retained)
                        assert (a.kind, a.dst, a.effects, a.entry, a.reason, a.reset) == \
                            (b.kind, b.dst, b.effects, b.entry, b.reason, b.reset)


def test_outcomes_carry_their_rule():
    out = TABLE.outcome(State.NOT_AVAILABLE, "fetch", 0, False, False)
    assert out.kind == "transition" and out.dst is State.INFLIGHT and out.entry.startswith("transition #")
    reset = TABLE.outcome(State.AVAILABLE, "reset", 2, False, False)
    assert reset.reset is True and reset.dst is State.NOT_AVAILABLE
    assert TABLE.outcome(State.AVAILABLE, "fetch", 1, False, False).reset is False
    err = TABLE.outcome(State.NOT_AVAILABLE, "arrive", 0, False, False)
    assert err.kind == "error" and err.reason and err.entry.startswith("error #")


# ------------------------------------------------------------------ replay


def _good_records():
    trace = Trace()
    ctx = StepContext(trace=trace)
    rec = Lifetime("w", "u")
    for event in ("fetch", "arrive", "release"):
        step(TABLE, rec, event, ctx)
    return trace.records


@pytest.mark.parametrize("index, change, reason", [
    (1, {"dst": "GATHERED"}, "unknown state 'GATHERED'"),
    (1, {"src": "AVAILABLE"}, "the previous records left the parameter in INFLIGHT, not AVAILABLE"),
    (2, {"holds": 4}, "the previous records left 1 holder(s), not 4"),
    (1, {"event": "teleport"}, "the spec has no event 'teleport'"),
    (1, {"event": "grad_ready", "effects": ()}, "the spec says"),
    (0, {"effects": ("free",)}, "the spec goes to INFLIGHT with effects ['start_gather']"),
])
def test_replay_names_the_first_bad_record(index, change, reason):
    import attrs

    records = _good_records()
    records[index] = attrs.evolve(records[index], **change)
    err = replay(records, TABLE)
    assert err is not None and err.index == index and err.record is records[index]
    assert err.reason.startswith(reason), err.reason
    assert f"record {index} (seq" in str(err)


def test_replay_tracks_parameters_separately():
    records = _good_records()
    other = [TraceRecord(**{**r.to_json(), "param": "v", "effects": tuple(r.effects)}) for r in records]
    assert replay(records[:2] + other + records[2:], TABLE) is None


# ------------------------------------------------------------- JSON Lines


def test_dump_is_compact_json_lines_and_loads_back(tmp_path):
    records = _good_records()
    trace = Trace(rank=0, records=records)
    path = trace.dump(tmp_path / "a" / "b" / "t.jsonl")
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 3 and lines[0].startswith('{"seq":0,"t_ns":') and ", " not in lines[0]
    assert json.loads(lines[0])["effects"] == ["start_gather"]
    assert records[0].to_json()["effects"] == ["start_gather"] and isinstance(records[0].to_json()["effects"], list)
    assert Trace.load(path).records == records
    empty = tmp_path / "empty.jsonl"
    empty.write_text("", encoding="utf-8")
    assert Trace.load(empty).rank == 0 and Trace.load(empty).records == []


def test_optional_fields_default_when_loading():
    obj = _good_records()[0].to_json()
    for optional in ("keep_graph", "retained", "holds", "nbytes"):
        del obj[optional]
    loaded = TraceRecord.from_json(obj)
    assert (loaded.keep_graph, loaded.retained, loaded.holds, loaded.nbytes) == (False, False, 0, 0)
    with pytest.raises(ValueError, match="expected a JSON object, got list"):
        TraceRecord.from_json([])


def test_defaults_of_records_and_traces():
    assert Lifetime("w", "u").nbytes == 0
    assert Trace().rank == 0 and Trace().records == []


def test_graph_freed_with_step_defaults_flushes_a_deferred_parameter():
    rec = _gathered(1)
    step(TABLE, rec, "release", StepContext(), keep_graph=True)
    assert rec.state is State.DEFERRED_RELEASE
    step(TABLE, rec, "graph_freed", StepContext())  # retained defaults to False: the graph is gone
    assert rec.state is State.NOT_AVAILABLE


def test_blank_lines_in_json_lines_are_skipped(tmp_path):
    records = _good_records()
    path = tmp_path / "t.jsonl"
    path.write_text("\n".join(json.dumps(r.to_json()) for r in records[:1]) + "\n\n"
                    + "\n".join(json.dumps(r.to_json()) for r in records[1:]) + "\n", encoding="utf-8")
    assert Trace.load(path).records == records


def test_perfetto_instant_names_join_effects(tmp_path):
    trace = Trace(0, [TraceRecord(seq=0, t_ns=0, rank=0, step=1, graph_task=-1, param="w", unit="u",
                                  event="release", src="AVAILABLE", dst="NOT_AVAILABLE",
                                  effects=("reduce_grad", "free"))])
    events = json.loads(trace.to_perfetto(tmp_path / "t.json").read_text(encoding="utf-8"))["traceEvents"]
    assert [e["name"] for e in events if e["ph"] == "i"] == ["reduce_grad+free"]


def test_buffer_checks_say_what_is_wrong():
    import torch

    from paramfsm.engine.effects.kernels.layout import check_buffer, shard_layout

    layout = shard_layout((5, 3), 2)
    with pytest.raises(ValueError, match=r"shard_numels \(2, 2\) do not match ceil\(numel / 2\) of the given "
                                         r"tensors \(3, 2\)"):
        check_buffer(layout, (2, 2), torch.empty(10), "out")
    with pytest.raises(ValueError, match=r"out must be 1-D with world \* S = 10 elements, got shape \(9,\)"):
        check_buffer(layout, (3, 2), torch.empty(9), "out")
