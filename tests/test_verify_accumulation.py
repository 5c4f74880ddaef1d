"""Verify draws gradient accumulation and ``reshard_after_forward``, and checks them against plain torch.

The drawn programs hold ``rt.no_sync()`` micro-batch loops (with retained graphs inside the window), the sync
switch toggled mid-program, ``rt.sync_gradients()`` and configurations that keep some units from their
forward to their backward; every one stays a loop paramfsm accepts (nothing that needs synchronised
gradients runs while some are kept, and the program ends synchronised). The catalogue's accumulation faults
are killed through verify by ``tests/test_mutants.py``.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings

from paramfsm.verify import sync_checks
from paramfsm.verify.search import probe
from paramfsm.verify.ops import (
    Backward, Checkpoint, Clip, ClosureStep, Config, Drop, Forward, FullState, GradSync, NoSync, Overflow, Penalty, Program,
    RequiresGrad, Step, SyncGradients, Unscale, ZeroGrad,
)
from paramfsm.verify.programs import CANONICAL, canonical, kept_alternate, programs
from paramfsm.verify.reproduction import render
from paramfsm.verify.runner import Options, run_program

SUBJECT = "paramfsm.testing.subjects:branchy_lm"
SHAPE = probe(SUBJECT)
NEEDS_SYNC = (Step, Clip, Unscale, Overflow, RequiresGrad, ClosureStep)


def _walk(program: Program) -> Counter:
    """Follow the program's sync state; assert it is a loop paramfsm accepts; count what it exercises."""
    seen: Counter = Counter()
    sync_on, window, kept = True, False, False
    # A ClosureStep runs its inner ops (the closure's forward and backward) and then steps.
    flat = [x for op in program.ops for x in ((*op.inner, op) if isinstance(op, ClosureStep) else (op,))]
    for op in flat:
        seen[type(op).__name__] += 1
        if isinstance(op, NoSync):
            assert op.enter != window, f"unbalanced no_sync window in {program.ops}"
            window = op.enter
        elif isinstance(op, GradSync):
            sync_on = op.flag
        elif isinstance(op, (Backward, Penalty)):
            kept = window or not sync_on
            seen["kept backward"] += kept
            seen["retained kept backward"] += kept and op.retain
        elif isinstance(op, (ZeroGrad, SyncGradients)):
            kept = False
        elif isinstance(op, NEEDS_SYNC):
            assert not kept, f"{op!r} runs on unsynchronised gradients in {program.ops}"
    assert not window and not kept, "a program ends outside no_sync with its gradients synchronised"
    seen[f"reshard {program.config.reshard_after_forward}"] += 1
    return seen


def test_drawn_programs_hold_the_accumulation_loops_and_stay_valid():
    seen: Counter = Counter()

    @settings(max_examples=150, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(programs(SHAPE, max_ops=16))
    def draw(program):
        seen.update(_walk(program))
        compile(render(program, SUBJECT, per_rank=2, seed=0), "repro.py", "exec")

    draw()
    for what in ("NoSync", "GradSync", "SyncGradients", "kept backward", "retained kept backward",
                 "reshard False", f"reshard {kept_alternate(SHAPE)}"):
        assert seen[what], f"no drawn program has {what}: {seen}"


def test_the_accumulation_pattern_is_canonical():
    config, intents = next((c, i) for c, i in CANONICAL if any(kind == "no_sync" for kind, *_ in i))
    assert config.reshard_after_forward is False
    program = next(p for p in canonical(SHAPE) if p.config == config)
    seen = _walk(program)
    assert seen["NoSync"] == 4 and seen["retained kept backward"] and seen["GradSync"] >= 2


@pytest.mark.slow  # over 5 s on two cores: make test-slow
def test_accumulation_and_kept_units_match_plain_torch(ranks2):
    """The canonical accumulation loop, with every unit kept and with the drawn predicate (the root and every
    second unit kept), passes every check on 2 ranks; so do state-dict and checkpoint round trips while a
    forward keeps its units for a backward (they release those holds: the load makes them stale)."""
    program = next(p for p in canonical(SHAPE) if p.config.reshard_after_forward is False)
    some = Program(Config(reshard_after_forward=kept_alternate(SHAPE)), program.ops)
    loads = Program(Config(reshard_after_forward=False),
                    (Forward(0, 0, "train"), FullState(True), Forward(1, 1, "eval"), Checkpoint(), Drop(0, ()),
                     Drop(1, ())))
    for each in (program, some, loads):
        for rank, outcome in enumerate(ranks2.run(run_program, SUBJECT, each, Options())):
            assert not outcome.failed and not outcome.kind, (rank, outcome.kind, outcome.op, outcome.message[:600])


def test_ranks_keeping_different_experts_synchronise_the_same_parameters(ranks2):
    """A mixture of experts made one unit: under no_sync each rank keeps only the experts its tokens reached,
    and rt.sync_gradients() must still pair the same parameters on every rank (it sent only the kept ones,
    so the reduce-scatters of the two ranks mixed different experts)."""
    experts = "paramfsm.testing.subjects:experts_lm"
    program = next(p for p in canonical(probe(experts)) if p.config.reshard_after_forward is False)
    for rank, outcome in enumerate(ranks2.run(run_program, experts, program, Options())):
        assert not outcome.failed and not outcome.kind, (rank, outcome.kind, outcome.op, outcome.message[:600])


def test_sync_checks_name_what_is_wrong():
    assert sync_checks.synchronised(frozenset({"head.weight"}), True, "a Backward op") == []
    problem, = sync_checks.synchronised(frozenset({"head.weight"}), False, "a Backward op")
    assert "'head.weight' still holds an unsynchronised gradient after a Backward op" in problem
    before, after = {"reduce_scatters": 3}, {"reduce_scatters": 5}
    assert sync_checks.kept_without_sync("Backward", True, before, after) == []
    assert sync_checks.kept_without_sync("Step", False, before, after) == []
    problem, = sync_checks.kept_without_sync("Penalty", False, before, after)
    assert problem.startswith("2 reduce-scatter(s) in a Penalty op with gradient sync off")
