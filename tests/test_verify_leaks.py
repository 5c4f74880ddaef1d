"""``paramfsm verify`` leaves nothing behind in its ranks: no process group, no thread, no descriptor.

Each program runs on a process group of its own (``paramfsm.verify.runner.run_program``). A group that
stays referenced after it is destroyed keeps gloo's threads (three a group) and sockets alive, so a
leak shows as a thread count that grows with every program. Programs of every outcome run here in one
pool: passing, failing under an injected fault, stopped by an accepted ``RankDesync`` and ended by a
collective timeout, and each rank's counts must come back to what they were after the first round.
"""

from __future__ import annotations

import os
import time

import pytest

from paramfsm.engine.effects.collectives import TIMEOUT_ENV
from paramfsm.verify.launch import RankPool
from paramfsm.verify import runner
from paramfsm.verify.search import probe
from paramfsm.verify.programs import canonical

SUBJECT = "paramfsm.testing.subjects:branchy_lm"  # the fault catalogue's subject
#: Threads and descriptors a rank may gain over 50 programs: one program's worth is 3 threads and about
#: 6 descriptors, so a per-program leak lands far above this.
SLACK_THREADS, SLACK_FDS = 2, 4


def _counts(rank, world):
    return len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))


def _stall_before(op_index: int, seconds: float):
    """Patch ``Run._apply`` on this rank to sleep before op ``op_index`` (so its peer's collective times out)."""
    original = runner.Run._apply
    applied = [0]

    def apply(self, op):
        if applied[0] == op_index:
            time.sleep(seconds)
        applied[0] += 1
        return original(self, op)

    runner.Run._apply = apply
    return original


def program_job(rank, world, program, options, stall):
    """One verify program on this rank; ``stall``: the runtime's collectives time out after 0.5 s, and rank 1
    sleeps 0.8 s before the first op, a forward that gathers (the harness's own agreements keep the group's
    longer limit)."""
    original = _stall_before(0, 0.8) if stall and rank == 1 else None
    if stall:
        os.environ[TIMEOUT_ENV] = "0.5"
    try:
        outcome = runner.run_program(rank, world, SUBJECT, program, options)
    finally:
        os.environ.pop(TIMEOUT_ENV, None)
        if original is not None:
            runner.Run._apply = original
    return outcome.kind, outcome.failed, outcome.message


def _outcomes():
    """(program, options, stall, the outcome kinds expected on some rank) of every kind, in one round."""
    programs = canonical(probe(SUBJECT))
    two_losses, flushed = programs[0], programs[3]  # the third: two losses, a flush between the backwards
    rank_loss = next(p for p in programs if any(type(op).__name__ == "RankLoss" for op in p.ops))
    return [
        (two_losses, runner.Options(), False, {""}),  # passes
        (flushed, runner.Options(fault="preprocess_once_per_process"), False, None),  # a finding
        (rank_loss, runner.Options(), False, {"desync", ""}),  # every rank raised RankDesync, or trained right
        (two_losses, runner.Options(timeout_s=20.0), True, None),  # a collective timeout on rank 0
    ]


@pytest.mark.slow
def test_verify_programs_of_every_outcome_leak_no_group_thread_or_descriptor():
    cases = _outcomes()
    with RankPool(2, timeout=120) as pool:
        seen = set()

        def run(case):
            program, options, stall, expected = case
            results = pool.run(program_job, program, options, stall)
            kinds = {kind for kind, _, _ in results}
            if expected is not None:
                assert kinds <= expected, (options, results)
            else:
                assert any(failed for _, failed, _ in results), (options, results)
            if stall:
                assert any("CollectiveTimeout" in message for _, _, message in results), results
            seen.update(kinds)

        for case in cases:  # the first round starts what lives as long as a rank (the exchange threads)
            run(case)
        before = pool.run(_counts)
        for i in range(50 - len(cases)):
            # A timeout costs seconds: every 16th program is one.
            run(cases[i % 3] if i % 16 != 15 else cases[3])
        after = pool.run(_counts)
    assert "desync" in seen and any(kind not in ("", "desync") for kind in seen), seen
    for rank, ((threads0, fds0), (threads1, fds1)) in enumerate(zip(before, after)):
        assert threads1 - threads0 <= SLACK_THREADS, f"rank {rank}: {threads0} -> {threads1} threads"
        assert fds1 - fds0 <= SLACK_FDS, f"rank {rank}: {fds0} -> {fds1} open descriptors"
