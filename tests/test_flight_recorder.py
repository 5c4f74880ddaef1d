"""Debugging that can stay on: the bounded flight recorder, its dumps, collective time limits, skipped steps.

Every dump is checked the way a user reads it: ``paramfsm trace check FILE
--allow-open`` must replay it through the spec from its first record.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest
import torch
from test_failures import Flaky
from torch.utils.checkpoint import checkpoint

import paramfsm
from paramfsm import CollectiveTimeout, IllegalTransition, RankDesync
from paramfsm.cli import main as cli
from paramfsm.core.replay import replay
from paramfsm.core.trace import Trace
from paramfsm.engine.events import graph_task as gt
from paramfsm.engine.events.events import POST_FORWARD, Event
from paramfsm.verify.launch import RankPool
from paramfsm.testing.models import mlp


def _steps(model, rt, opt, n: int, start: int = 0) -> None:
    for i in range(start, start + n):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def _held_bytes(trace: Trace) -> int:
    """Bytes the trace itself holds: its container and each kept entry with its numbers (the
    parameter records and interned strings the entries point to belong to the model)."""
    entries = trace._raw
    return sys.getsizeof(entries) + sum(
        sys.getsizeof(e) + sum(sys.getsizeof(v) for v in e if isinstance(v, (int, list))) for e in entries)


def ring_memory_job(rank, world, trace, steps):
    """The most bytes the trace held in each quarter of ``steps`` training steps (sampled every 10
    steps: a ring trims itself once per ``limit`` transitions, so its size saws between the limit and
    twice it), and whether it replays."""
    torch.manual_seed(0)
    model = mlp(8, 16, 8)
    rt = paramfsm.shard(model, trace=trace)
    opt = torch.optim.SGD(rt.shard_parameters(), lr=1e-3)
    held = []
    for quarter in range(4):
        most = 0
        for tenth in range(0, steps // 4, 10):
            _steps(model, rt, opt, 10, start=quarter * steps // 4 + tenth)
            most = max(most, _held_bytes(rt.trace))
        held.append(most)
    records = rt.trace.records
    problem = replay(records, rt.table)
    rt.close()
    return held, len(rt.trace), records[0].seq, str(problem) if problem else None


@pytest.mark.slow
def test_the_recorder_memory_is_flat_over_2000_steps(ranks1):
    held, kept, first_seq, problem = ranks1.run(ring_memory_job, 256, 2000)[0]
    assert kept == 256 and first_seq > 0 and problem is None, problem
    assert max(held) - min(held) < 1024, f"the ring's memory changed over the run: {held}"
    full, *_ = ranks1.run(ring_memory_job, True, 200)[0]
    assert full[3] > 3 * full[0] > 3 * max(held), f"the measure cannot see a growing trace: {full}"


def _check_dump(path) -> tuple[int, int]:
    """``paramfsm trace check PATH --allow-open``: its exit status, and the seq of the file's first record."""
    records = Trace.load(path).records
    return cli(["trace", "check", str(path), "--allow-open"]), records[0].seq if records else -1


def dump_triggers_job(rank, world, out_dir):
    """Cause each failure the recorder dumps on; return {reason: (file name, check status, first event)}."""
    os.environ["PARAMFSM_TRACE_DIR"] = out_dir
    torch.manual_seed(0)
    model = Flaky()
    rt = paramfsm.shard(model, trace=64)  # a small ring: the dumps start mid-run, with a snapshot
    x = torch.randn(2, 4)
    for _ in range(3):
        model(x).sum().backward()
        # Checkpointing stops a recomputation of the root by raising inside it: not a failure, no dump.
        checkpoint(model, x, use_reentrant=False).sum().backward()
    found = {}
    model.fail = "forward"
    try:
        model(x)
    except RuntimeError:
        pass
    model.fail = "backward"
    try:
        model(x).sum().backward()
    except RuntimeError:
        pass
    model.fail = None
    model(x).sum().backward()  # the next forward recovers from the interrupted backward
    try:
        rt.scheduler.emit(Event(POST_FORWARD, rt.units[1], gt.NO_TASK))  # a release nobody fetched (0: the root)
    except IllegalTransition as exc:
        found["note"] = "".join(getattr(exc, "__notes__", []))
    out = model(x)
    rt.scheduler._step_all(rt.units[-1].records, "fetch")  # a holder nobody releases: a leak
    out.sum().backward()
    rt.detach()
    paths = sorted(Path(out_dir).glob(f"paramfsm-trace-rank{rank}-*.jsonl"))
    for path in paths:
        reason = path.stem.split("-", 4)[-1]
        found[reason] = (path.name, *_check_dump(path))
    found["files"] = len(paths)
    return found


def test_a_dump_appears_on_each_trigger(ranks2, tmp_path):
    results = ranks2.run(dump_triggers_job, str(tmp_path))
    for rank, found in enumerate(results):
        note = found.pop("note")
        assert found.pop("files") == 4, found
        assert set(found) == {"forward-exception", "interrupted", "illegal-transition", "leak"}, found
        for name, status, first_seq in found.values():
            assert name.startswith(f"paramfsm-trace-rank{rank}-step"), name
            assert first_seq > 0, f"{name} should be a window of the run (a 64-record ring)"
            assert status == 0, f"{name} does not replay from its first record"
        assert found["illegal-transition"][0] in note and "--allow-open" in note, note


def stalled_peer_job(rank, world, out_dir):
    """Rank 1 sleeps through rank 0's first gather of step 2; both use a 2 s limit.

    Rank 1 wakes to a peer that gave up: its gather either times out too or finds the connection
    closed (gloo closes a pair whose point-to-point receive timed out); either way it must raise."""
    os.environ["PARAMFSM_TRACE_DIR"] = out_dir
    torch.manual_seed(0)
    model = mlp(8, 8, 8)
    torch.distributed.barrier()  # the ranks start together however late a loaded machine starts one
    paramfsm.shard(model, collective_timeout=2.0)
    model(torch.randn(2, 8)).sum().backward()
    torch.distributed.barrier()
    if rank == 1:
        time.sleep(4.5)
    start = time.monotonic()
    try:
        model(torch.randn(2, 8)).sum().backward()
    except CollectiveTimeout as exc:
        waited = time.monotonic() - start
        return (waited, exc.rank, exc.step, exc.collective, exc.unit, str(exc),
                str(getattr(exc, "paramfsm_dump", "")))
    except RuntimeError as exc:
        if rank == 0:
            raise
        return ("raised", type(exc).__name__, str(exc))
    return None


@pytest.mark.slow
def test_a_stalled_peer_raises_collective_timeout(tmp_path):
    with RankPool(2, timeout=60) as pool:  # its own ranks: a timed-out group is not reused
        results = pool.run(stalled_peer_job, str(tmp_path))
    assert results[0] is not None, "rank 0 waited for the sleeping peer without a time limit"
    assert results[1] is not None, "rank 1 carried on after its peer gave up"
    waited, rank, step, collective, unit, message, dump = results[0]
    assert 2.0 <= waited < 4.4, waited
    assert (rank, step) == (0, 2) and collective.startswith("all-gather"), message
    assert f"'{unit}'" in message and "within 2s" in message and "collective_timeout" in message, message
    assert Path(dump).is_file() and "collective-timeout" in dump, dump
    assert _check_dump(dump)[0] == 0


def skipped_step_job(rank, world, debug):
    torch.manual_seed(0)
    model = mlp(8, 8, 8)
    rt = paramfsm.shard(model, debug=debug)
    opt = torch.optim.SGD(rt.shard_parameters(), lr=1e-2)
    try:
        for step in range(4):
            rt.set_step(step)
            if rank == 1 and step == 2:
                continue  # e.g. a bad batch on this rank only
            x = torch.randn(2, 8, generator=torch.Generator().manual_seed(step))
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
    except RankDesync as exc:
        rt.reset()
        rt.detach()
        return exc.rank, exc.step, str(exc)
    rt.detach()
    return None


@pytest.mark.parametrize("debug", [False, True], ids=["default_check", "debug_header"])
def test_a_skipped_step_raises_rank_desync(ranks2, debug):
    results = ranks2.run(skipped_step_job, debug, timeout=60)
    assert all(r is not None for r in results), "a rank that skipped a step was paired silently"
    for rank, (err_rank, step, message) in enumerate(results):
        assert err_rank == rank and step == (2 if rank == 0 else 3), message
        assert "at step 2" in message and "at step 3" in message, message


def test_dumps_stop_at_the_cap_and_skip_when_nothing_is_new(tmp_path, monkeypatch, caplog):
    from paramfsm.core.fsm import Lifetime, StepContext, default_table, step
    from paramfsm.engine.schedule.flight import MAX_DUMPS, FlightRecorder

    monkeypatch.setenv("PARAMFSM_TRACE_DIR", str(tmp_path))
    trace = Trace(0, limit=16)
    ctx, rec = StepContext(0, trace), Lifetime("w", "u", 64)
    recorder = FlightRecorder(trace, ctx)
    written = []
    for i in range(MAX_DUMPS + 3):
        ctx.step = i
        for event in ("fetch", "arrive", "release"):
            step(default_table(), rec, event, ctx)
        written.append(recorder.dump("leak"))
        assert recorder.dump("leak") == written[-1], "nothing new since the last dump: no second file"
    assert all(p is not None and p.is_file() for p in written[:MAX_DUMPS])
    assert written[MAX_DUMPS:] == [None] * 3
    assert len(list(tmp_path.glob("paramfsm-trace-rank0-*.jsonl"))) == MAX_DUMPS
    assert sum("writing no more" in r.getMessage() for r in caplog.records) == 1
