"""Verify's training-loop vocabulary: mixed precision and the loss scaler, clipping, state-dict and DCP round
trips, requires_grad toggles and per-block reentrant checkpointing, on 2 and 3 ranks.

Also the two gaps planted bugs once slipped through: ``clip_grad_norm_`` without its clamp at 1, and a
sharded-checkpoint chunk cut with the unpadded share ``numel // world`` (only sizes not divisible by the
world size show it). Each is caught here directly, by verify's programs, and as a catalogue fault.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import paramfsm
from paramfsm.verify import faults
from paramfsm.verify.search import probe, verify
from paramfsm.verify.mirror import Mirror
from paramfsm.verify.ops import (
    Backward, Checkpoint, Clip, Config, Drop, Forward, FullState, Loss, Overflow, Program, RequiresGrad, Step, Unscale,
    ZeroGrad,
)
from paramfsm.verify.programs import programs
from paramfsm.verify.reproduction import render
from paramfsm.verify.runner import Options, run_program
from paramfsm.verify.subject import global_batch, load_subject, split

SUBJECTS = "paramfsm.testing.subjects:"
FP16 = Config(param_dtype="float16")
BF16 = Config(param_dtype="bfloat16")

#: fp16 and the scaler: two scaled losses over a retained graph, unscale, a clip far above the norm, a step;
#: then a forced overflow in the last element of the tied embedding (the last rank's slice), unscale, a clip
#: below the norm and a step every rank must skip.
FP16_LOOP = (Forward(0, 0, "train"), Loss(0, 0, 0, 0), Loss(1, 0, 0, 1), Backward(0, True, False),
             Backward(1, False, True), Unscale(), Clip(100.0, 2.0), Step(), ZeroGrad(), Forward(1, 1, "checkpoint"),
             Loss(2, 1, 1, 0), Backward(2, False, False), Overflow("embed.weight", 376), Unscale(),
             Clip(0.05, math.inf), Step(), Drop(0, (0, 1)), Drop(1, (2,)))
#: bf16: a frozen norm, per-block reentrant checkpointing, a DCP round trip, unfreezing, a perturbed and a
#: plain full-state-dict round trip, and an iteration after them.
BF16_LOOP = (RequiresGrad("blocks.0.norm1.weight", False), Forward(0, 0, "reentrant"), Loss(0, 0, 0, 0),
             Backward(0, False, True), Clip(1.0, 1.0), Step(), Drop(0, (0,)), Checkpoint(),
             RequiresGrad("blocks.0.norm1.weight", True), FullState(True), ZeroGrad(), Forward(1, 1, "reentrant"),
             Loss(1, 1, 1, 2), Backward(1, False, False), Step(), FullState(False), Drop(1, (1,)))


def _outcomes(pool, subject, program, fault=None):
    return pool.run(run_program, SUBJECTS + subject, program, Options(fault=fault))


def _passes(outcomes) -> None:
    for rank, outcome in enumerate(outcomes):
        assert not outcome.failed and not outcome.kind, (rank, outcome.kind, outcome.op, outcome.message[:600])


# ------------------------------------------------------------------ generated programs (no ranks)

@pytest.mark.slow
@settings(max_examples=10, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(programs(probe(SUBJECTS + "tiny_transformer_tied"), max_ops=12))
def test_generated_training_programs_are_valid_plain_torch(program):
    """The reference runs every drawn program, scaler, clip, round trips, toggles and reentrant blocks included."""
    subject = load_subject(SUBJECTS + "tiny_transformer_tied", 0)
    mirror = Mirror(subject, 2, program.config)
    slices = {b: tuple(split(part, 2) for part in global_batch(subject, b, 0, 2, 2)) for b in range(4)}
    for op in program.ops:
        mirror.apply(op, slices)
    assert not mirror.outs and not mirror.losses


def test_training_reproductions_are_python():
    for config, ops in ((FP16, FP16_LOOP), (BF16, BF16_LOOP)):
        script = render(Program(config, ops), SUBJECTS + "branchy_lm", per_rank=2, seed=0, fail_at=7)
        compile(script, "repro.py", "exec")
        assert script.count("    with check(") == len(ops)
    assert "scaler.scale(loss0).backward(retain_graph=True)" in render(Program(FP16, FP16_LOOP), "m:f",
                                                                       per_rank=2, seed=0)


# ------------------------------------------------------------------ on the ranks

@pytest.mark.parametrize("subject", ["branchy_lm", "tiny_transformer_tied"])
def test_training_loops_pass_every_check_on_2_ranks(ranks2, subject):
    _passes(_outcomes(ranks2, subject, Program(FP16, FP16_LOOP)))
    _passes(_outcomes(ranks2, subject, Program(BF16, BF16_LOOP)))


@pytest.mark.slow
def test_training_loops_pass_every_check_on_3_ranks(ranks3):
    _passes(_outcomes(ranks3, "branchy_lm", Program(FP16, FP16_LOOP)))
    _passes(_outcomes(ranks3, "branchy_lm", Program(BF16, BF16_LOOP)))


@pytest.mark.parametrize("fault, kind", [("found_inf_not_agreed", "reference"),
                                         ("unscaled_once_per_backward", "reference"),
                                         ("scale_not_backpropagated", "reference"),
                                         ("clip_without_clamp", "reference")])
def test_the_fp16_loop_catches_the_scaler_and_clip_faults_on_3_ranks(ranks3, fault, kind):
    outcomes = _outcomes(ranks3, "branchy_lm", Program(FP16, FP16_LOOP), fault)
    assert any(o.failed and o.kind == kind for o in outcomes), [(o.kind, o.op, o.message[:200]) for o in outcomes]


def test_a_clip_far_above_the_norm_leaves_gradients_alone(ranks2):
    """The clamp gap: fp32, one backward, Clip(100): without the clamp the gradients would grow ~100x."""
    ops = (Forward(0, 0, "train"), Loss(0, 0, 0, 0), Backward(0, False, False), Clip(100.0, 2.0), Step(),
           Drop(0, (0,)))
    _passes(_outcomes(ranks2, "mlp_regression", Program(Config(), ops)))
    failed = _outcomes(ranks2, "mlp_regression", Program(Config(), ops), "clip_without_clamp")
    assert [o.kind for o in failed] == ["reference", "reference"] and all(o.op == 3 for o in failed)


def chunk_job(rank, world):
    """Every DTensor of rt.sharded_state_dict() holds exactly this rank's Shard(0) chunk (torch.chunk's)."""
    torch.manual_seed(0)
    subject = load_subject(SUBJECTS + "branchy_lm", 0)
    full = {k: v.detach().clone() for k, v in subject.model.state_dict().items()}
    rt = paramfsm.shard(subject.model)
    problems = []
    for key, value in rt.sharded_state_dict(layout="flat").items():
        if not hasattr(value, "to_local"):
            continue
        chunks = full[key].reshape(-1).chunk(world)
        want = chunks[rank] if rank < len(chunks) else full[key].reshape(-1)[:0]
        got = value.to_local()
        if got.shape != want.shape or not torch.equal(got, want):
            problems.append(f"{key}: {tuple(got.shape)} vs {tuple(want.shape)}")
    rt.close()
    return problems


def test_sharded_state_dict_chunks_at_world_3(ranks3):
    """The offset gap: sizes 13, 39, 169, 377 do not divide by 3, so the last rank's chunk is short."""
    assert ranks3.run(chunk_job) == [[], [], []]
    problems = ranks3.run(_chunk_job_under_fault)
    assert problems[0] == [] and problems[2], problems


def _chunk_job_under_fault(rank, world):
    with faults.activate("checkpoint_offset_unpadded"):
        return chunk_job(rank, world)


def test_a_dcp_round_trip_catches_the_offset_fault(ranks2):
    ops = (Forward(0, 0, "train"), Loss(0, 0, 0, 0), Backward(0, False, False), Step(), Drop(0, (0,)),
           Checkpoint())
    _passes(_outcomes(ranks2, "branchy_lm", Program(Config(), ops)))
    failed = _outcomes(ranks2, "branchy_lm", Program(Config(), ops), "checkpoint_offset_unpadded")
    # the model-shaped pieces of the wrong range overlap their neighbour's: DCP refuses the save on every rank
    assert all(o.failed and o.op == 5 and "overlapping chunks" in o.message for o in failed), failed
    assert all("do not tile each tensor" in o.message and "writable" not in o.message for o in failed), failed


@pytest.mark.slow
def test_verify_kills_a_training_fault_at_world_3(ranks3):
    report = verify(SUBJECTS + "branchy_lm", world_size=3, examples=5, pool=ranks3, fault="found_inf_not_agreed",
                    shrink=False)
    assert report.failure is not None and report.failure.kind in ("reference", "scaler"), report


def test_a_retained_backward_through_reentrant_blocks(ranks2):
    """Once found by verify: a retained backward through reentrant blocks deferred their parameters
    with no live graph (see [Note: what a recomputation defers] in paramfsm.engine.schedule.backward)."""
    ops = (Forward(0, 0, "reentrant"), Loss(0, 0, 0, 1), Backward(0, True, False), Backward(0, False, False),
           Drop(0, (0,)))
    _passes(_outcomes(ranks2, "branchy_lm", Program(Config(), ops)))
