"""``paramfsm trace`` on the traces a debugging user meets: empty, cut short, made under another spec,
illegal, nested absurdly deep, from a long run, and flight-recorder dumps of two ranks."""

from __future__ import annotations

import json

import attrs
import pytest
from scenario_traces import scenario_trace

from paramfsm import cli
from paramfsm.core.fsm import Lifetime, StepContext, default_table, step
from paramfsm.core.trace import SNAPSHOT, Trace
from paramfsm.verify.faults.user_paths import scrolled_leak_trace


def run(capsys, *args) -> tuple[int, str, str]:
    status = cli.main(list(args))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return status, out, err


def write(path, records) -> str:
    path.write_text("".join(json.dumps(r.to_json()) + "\n" for r in records), encoding="utf-8")
    return str(path)


@pytest.mark.parametrize("command", [["check"], ["summary"], ["export", "--perfetto", "out.json"]])
def test_an_empty_trace_is_bad_input_to_check_summary_and_export(tmp_path, capsys, command):
    """An empty trace shows nothing: every command that reads one trace says so and exits 1 alike."""
    (tmp_path / "empty.jsonl").write_text("", encoding="utf-8")
    status, out, err = run(capsys, "trace", command[0], str(tmp_path / "empty.jsonl"),
                           *[str(tmp_path / a) if a.endswith(".json") else a for a in command[1:]])
    assert status == 1 and "no records" in err and err.count("\n") == 1 and not out, (out, err)
    assert not (tmp_path / "out.json").exists()


def test_a_trace_ending_gathered_needs_allow_open(tmp_path, capsys):
    path = write(tmp_path / "open.jsonl", scenario_trace(leak=True).records)
    status, _, err = run(capsys, "trace", "check", path)
    assert status == 1 and "end gathered" in err and "--allow-open" in err, err
    assert "'enc.weight' ends DEFERRED_RELEASE" in err, err
    status, out, _ = run(capsys, "trace", "check", path, "--allow-open")
    assert status == 0 and "replay cleanly" in out and "end gathered" in out, out


def test_a_trace_made_under_another_spec_says_so(tmp_path, capsys):
    records = [attrs.evolve(r, spec="0123456789ab") for r in scenario_trace().records]
    status, _, err = run(capsys, "trace", "check", write(tmp_path / "other.jsonl", records))
    assert status == 1 and "recorded under spec 0123456789ab" in err, err
    assert default_table().digest in err and "illegal record 0 (seq 0," in err, err


@pytest.mark.parametrize("command", ["summary", "export"])
def test_summary_and_export_warn_with_status_3_on_an_illegal_trace(tmp_path, capsys, command):
    records = scenario_trace().records
    records[5] = attrs.evolve(records[5], dst="DEFERRED_RELEASE")
    path = write(tmp_path / "bad.jsonl", records)
    extra = ["--perfetto", str(tmp_path / "t.json")] if command == "export" else []
    status, out, err = run(capsys, "trace", command, path, *extra)
    assert status == 3 and "does not replay" in err and "record 5" in err, err
    assert out.strip(), "the result is still printed"
    status, _, err = run(capsys, "trace", command, write(tmp_path / "good.jsonl", scenario_trace().records), *extra)
    assert status == 0 and not err


def test_deeply_nested_json_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "deep.jsonl").write_text("[" * 100_000 + "]" * 100_000 + "\n", encoding="utf-8")
    status, _, err = run(capsys, "trace", "check", str(tmp_path / "deep.jsonl"))
    assert status == 1 and "deep.jsonl:1" in err and "nested too deeply" in err, err


def _many_tasks(n: int) -> Trace:
    table, trace = default_table(), Trace(0)
    ctx, rec = StepContext(0, trace), Lifetime("w", "u", 64)
    for task in range(n):
        ctx.graph_task = task
        for event in ("fetch", "arrive", "release"):
            step(table, rec, event, ctx)
    return trace


def test_the_per_task_line_stays_short_for_long_runs(tmp_path, capsys):
    status, out, _ = run(capsys, "trace", "summary", str(_many_tasks(5000).dump(tmp_path / "long.jsonl")))
    line = next(ln for ln in out.splitlines() if ln.startswith("records per graph task"))
    assert status == 0 and len(line) < 160 and "5000 graph tasks" in line, line
    status, out, _ = run(capsys, "trace", "summary", str(_many_tasks(3).dump(tmp_path / "short.jsonl")))
    assert "records per graph task: 0: 3, 1: 3, 2: 3" in out, out


def _ring(rank: int, steps: int, limit: int, diverge_at: int | None = None) -> Trace:
    """A ring over ``steps`` fetch/arrive/release rounds; ``diverge_at`` swaps that round's parameter."""
    table = default_table()
    trace = Trace(rank, limit=limit, digest=table.digest)
    recs = [Lifetime("a", "u", 64), Lifetime("b", "u", 64)]
    trace.lifetimes = tuple(recs)
    ctx = StepContext(rank, trace)
    for i in range(steps):
        ctx.step = i
        rec = recs[(i + (i == diverge_at)) % 2]
        for event in ("fetch", "arrive", "release"):
            step(table, rec, event, ctx)
    step(table, recs[0], "fetch", ctx)  # a dump is taken mid-step: "a" is in flight
    return trace


def test_dumps_of_two_ranks_replay_and_diff_from_their_common_window(tmp_path, capsys):
    a = _ring(0, 50, limit=41).dump(tmp_path / "r0.jsonl")
    b = _ring(1, 50, limit=30).dump(tmp_path / "r1.jsonl")
    assert Trace.load(a).records[0].event == SNAPSHOT
    for path in (a, b):
        assert run(capsys, "trace", "check", str(path), "--allow-open")[0] == 0
    status, out, _ = run(capsys, "trace", "diff", str(a), str(b))
    assert status == 0 and "agree" in out, out
    c = _ring(1, 50, limit=30, diverge_at=45).dump(tmp_path / "r1-diverged.jsonl")
    status, _, err = run(capsys, "trace", "diff", str(a), str(c))
    assert status == 1 and "step" in err and "45" in err, err


def test_mesh_coordinates_survive_every_way_of_keeping_a_trace(tmp_path):
    """Under hybrid sharding each record names (replica, shard rank); JSON Lines written by a stream,
    a ring dump and a full dump read back the same records, and traces without a mesh omit the field."""
    table = default_table()
    runs = {}
    for name, kwargs in {"stream": {"path": tmp_path / "s.jsonl"}, "ring": {"limit": 100}, "full": {}}.items():
        trace = Trace(3, digest=table.digest, coord=(1, 1), **kwargs)
        ctx, rec = StepContext(3, trace), Lifetime("w", "u", 64)
        for event in ("fetch", "arrive", "release"):
            step(table, rec, event, ctx)
        trace.close()
        loaded = Trace.load(trace.path if name == "stream" else trace.dump(tmp_path / f"{name}.jsonl")).records
        runs[name] = [attrs.evolve(r, t_ns=0) for r in loaded]  # each run has its own clock
    assert runs["stream"] == runs["ring"] == runs["full"] and len(runs["full"]) == 3
    assert all(r.coord == (1, 1) for r in runs["full"])
    plain = scenario_trace().records[0]
    assert "coord" not in plain.to_json() and plain.coord == ()


def test_a_snapshot_spliced_into_a_parameters_records_fails_the_check(tmp_path, capsys):
    """A snapshot only opens a parameter's records (a flight-recorder window). Spliced in after a
    fetch that nobody released, it would hide the holder: the check must name it."""
    table = default_table()
    trace = Trace(0, digest=table.digest)
    ctx = StepContext(0, trace)
    a = Lifetime("a", "u", 64)
    for event in ("fetch", "arrive", "release", "fetch", "arrive"):
        step(table, a, event, ctx)
    records = trace.records
    snapshot = attrs.evolve(records[-1], seq=records[-1].seq + 1, event=SNAPSHOT, src="NOT_AVAILABLE",
                            dst="NOT_AVAILABLE", effects=(), holds=0)
    path = write(tmp_path / "spliced.jsonl", records + [snapshot])
    for extra in ((), ("--allow-open",)):
        status, _, err = run(capsys, "trace", "check", path, *extra)
        assert status == 1 and "record 5" in err, err
        assert "a snapshot record must open the parameter's records and name one state" in err, err
    status, _, err = run(capsys, "trace", "summary", path)
    assert status == 3 and "snapshot record must open" in err, err


def test_a_ring_dump_keeps_a_leak_whose_records_scrolled_out(tmp_path, capsys):
    """A parameter fetched and never released, then thousands of other transitions: the ring no longer
    holds its records, but its dump still shows it gathered, so check and summary name the leak."""
    trace = scrolled_leak_trace()
    path = trace.dump(tmp_path / "ring.jsonl")
    assert all(r.event == SNAPSHOT for r in Trace.load(path).records if r.param == "leaked")
    status, _, err = run(capsys, "trace", "check", str(path))
    assert status == 1 and "rank 0 'leaked' ends AVAILABLE" in err, err
    status, out, _ = run(capsys, "trace", "summary", str(path))
    assert status == 0 and "leaks: 1" in out and "'leaked' (unit 'head') ends AVAILABLE" in out, out


def _deferred_window():
    """A ring window that opens with 'a' DEFERRED_RELEASE (no holders) and 'b' resting, then goes on."""
    table = default_table()
    trace = Trace(0, limit=6, digest=table.digest)
    a, b = Lifetime("a", "u", 64), Lifetime("b", "v", 64)
    trace.lifetimes = (a, b)
    ctx = StepContext(0, trace)
    for event in ("fetch", "arrive"):
        step(table, a, event, ctx)
    step(table, a, "release", ctx, keep_graph=True)  # a retained backward: 'a' waits deferred
    for _ in range(3):
        for event in ("fetch", "arrive", "release"):
            step(table, b, event, ctx)
    return trace.records


def test_snapshots_open_a_window_and_nothing_else(tmp_path, capsys):
    """A deferred parameter opens the window with no holders and replays; a snapshot naming two states, or
    an illegal record after the snapshots, is rejected."""
    records = _deferred_window()
    opening = [r for r in records if r.event == SNAPSHOT]
    assert [(r.param, r.dst, r.holds) for r in opening] == [("a", "DEFERRED_RELEASE", 0)]
    status, out, _ = run(capsys, "trace", "check", write(tmp_path / "window.jsonl", records), "--allow-open")
    assert status == 0 and "1 parameter(s) end gathered" in out, out
    two_states = [attrs.evolve(records[0], src="AVAILABLE")] + records[1:]
    status, _, err = run(capsys, "trace", "check", write(tmp_path / "two.jsonl", two_states), "--allow-open")
    assert status == 1 and "record 0" in err and "name one state" in err, err
    illegal = records[:-1] + [attrs.evolve(records[-1], src="INFLIGHT")]
    status, _, err = run(capsys, "trace", "check", write(tmp_path / "late.jsonl", illegal), "--allow-open")
    assert status == 1 and f"record {len(records) - 1}" in err and "left the parameter in" in err, err
