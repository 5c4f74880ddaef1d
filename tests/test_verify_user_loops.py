"""Verify's user-loop ops: units run again on saved activations, per-part optimizers and GAN iterations, writes
inside ``rt.gathered``, eval segments under no_grad and inference_mode, saved states restored later, and units
whose outputs are dataclasses, namedtuples, nested containers or views (a loss that reads another output on each
rank, RankLoss: tests/test_verify_rank_loss.py).

The drawn programs stay valid plain torch (no backward through a graph a step, a write or a load made
stale); every new op is drawn; the canonical programs of the new ops pass every check on 2 ranks, and so do
their saved reproductions; a value that differs from plain torch's fails the output check.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings

import paramfsm
from paramfsm.verify.checker import Checker, Failed
from paramfsm.verify.search import probe
from paramfsm.verify.frequencies import frequencies
from paramfsm.verify.mirror import Mirror
from paramfsm.verify.ops import (
    RANK_WRITE, USER_LOOP_OPS, Attach, Backward, Config, Evaluate, Forward, GatheredWrite, Loss, PartStep, Program, RankLoss,
    Restore, Save, SubForward,
)
from paramfsm.verify.programs import CANONICAL, canonical, normalise, programs
from paramfsm.verify.reproduction import render, run_saved
from paramfsm.verify.runner import Options, run_program
from paramfsm.verify.subject import global_batch, load_subject, split

SUBJECTS = "paramfsm.testing.subjects:"
GAN = SUBJECTS + "gan_pair"
#: The canonical programs of the user-loop ops but RankLoss (whose program may end in RankDesync on every
#: rank: tests/test_verify_rank_loss.py), CANONICAL[18].
USER_LOOPS = slice(11, 17)


def _mirror_runs(name: str, program: Program) -> None:
    subject = load_subject(name, 0)
    mirror = Mirror(subject, 2, program.config)
    slices = {b: tuple(split(part, 2) for part in global_batch(subject, b, 0, 2, 2)) for b in range(4)}
    for op in program.ops:
        mirror.apply(op, slices)
    assert not mirror.outs and not mirror.losses and not mirror.acts


# ------------------------------------------------------------------ drawn programs (no ranks)

@pytest.mark.parametrize("subject", ["gan_pair", "structured_outputs"])
def test_drawn_user_loop_programs_are_valid_plain_torch(subject):
    """The reference runs every drawn program: no backward reaches a graph a step, write or load made stale."""
    name = SUBJECTS + subject
    shape = probe(name)

    @settings(max_examples=25, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(programs(shape, max_ops=16))
    def draw(program):
        _mirror_runs(name, program)
        compile(render(program, name, per_rank=2, seed=0, parts=shape.parts), "repro.py", "exec")

    draw()


def test_every_user_loop_op_is_drawn():
    seen = frequencies(probe(GAN), examples=50, seeds=6)  # 300 draws: a Restore needs a save, a step, then it
    for op in USER_LOOP_OPS:
        assert seen[op.__name__], f"no drawn program holds {op.__name__}: {seen}"
    for pattern in ("step between a retained backward and the next forward or backward",
                    "SubForward after a step, on inputs saved before it", "SubForward on a kept graph, view",
                    "Evaluate under inference_mode", "Evaluate under no_grad",
                    "RankLoss over outputs of different modules", "RankLoss over outputs of the same modules"):
        assert seen[pattern], f"no drawn program holds {pattern!r}: {seen}"


def test_the_probe_learns_parts_and_what_feeds_each_unit():
    shape = probe(GAN)
    assert shape.parts == ("gen", "disc") and shape.optimizers == 2
    assert shape.callees == (("gen", (0,), (), True), ("disc", (1,), (0,), True)), "D's input comes from G"
    assert dict(zip((n for n, _ in shape.params), shape.param_parts))["disc.2.bias"] == 1
    assert probe(SUBJECTS + "mlp_one_unit").callees == (), "no unit below the root"


def test_a_step_makes_only_its_parts_graphs_stale():
    """The GAN intent: D's step leaves D(fake) run again usable for G's backward (D ran after its step, G did
    not step); with one optimizer the step makes the fake batch's graph stale, so no backward reaches it."""
    ops = normalise([("gan", 0, 0, False)], probe(GAN)).ops
    assert [type(op).__name__ for op in ops].count("Backward") == 2 and PartStep(0) in ops
    single = normalise([("gan", 0, 0, False)], probe(SUBJECTS + "branchy_lm")).ops
    assert [type(op).__name__ for op in single].count("Backward") == 1
    assert sum(isinstance(op, SubForward) for op in single) == 2, "the stale one still runs: its value is compared"


def test_the_user_loop_ops_are_canonical():
    held = {type(op) for program in canonical(probe(GAN))[USER_LOOPS.start:] for op in program.ops}
    assert set(USER_LOOP_OPS) <= held, set(USER_LOOP_OPS) - held
    assert len(CANONICAL) == 30 and any(isinstance(op, RankLoss) for op in canonical(probe(GAN))[18].ops)
    configs = {program.config for program in canonical(probe(GAN))[22:]}  # paramfsm #53's
    assert {c.optimizer for c in configs} == {"adafactor", "subclass", "subject"} and any(c.refused_shard for c in configs)
    assert any(c.offload == "cpu-bounded" and not c.zero_grad_to_none and c.step_hooks for c in configs)
    refusals = [op for program in canonical(probe(GAN))[28:] for op in program.ops]  # paramfsm #57's
    assert any(isinstance(op, GatheredWrite) and op.variant == RANK_WRITE for op in refusals)
    assert any(isinstance(op, Attach) for op in refusals)
    programs_ = canonical(probe(GAN))[USER_LOOPS]
    kinds = [type(op).__name__ for op in programs_[0].ops]
    retained, step = programs_[0].ops.index(Backward(0, True, False)), kinds.index("Step")
    assert retained < step < kinds.index("SubForward"), "a step between a retained backward and the next forward"
    assert Evaluate((1, 2), True) in programs_[4].ops and Restore(False) in programs_[5].ops
    assert Save(True) in programs_[5].ops


# ------------------------------------------------------------------ on the ranks

@pytest.mark.parametrize("subject", ["gan_pair", "structured_outputs", "view_outputs", "mlp_one_unit"])
def test_user_loop_canonical_programs_pass_on_2_ranks(ranks2, subject):
    for index, program in enumerate(canonical(probe(SUBJECTS + subject))[USER_LOOPS], start=11):
        for rank, outcome in enumerate(ranks2.run(run_program, SUBJECTS + subject, program, Options())):
            assert not outcome.failed and not outcome.kind, (index, rank, outcome.kind, outcome.op,
                                                             outcome.message[:600])


def test_saved_user_loop_reproductions_pass_on_2_ranks(ranks2, tmp_path):
    """The rendered scripts run the same checks as the runner (and pass where it passes)."""
    shape = probe(GAN)
    for index, program in enumerate(canonical(shape)[USER_LOOPS], start=11):
        path = tmp_path / f"repro_{index}.py"
        path.write_text(render(program, GAN, per_rank=2, seed=0, world=2, parts=shape.parts), encoding="utf-8")
        assert ranks2.run(run_saved, str(path)) == [(0, ""), (0, "")], index


def _output_check_job(rank, world):
    """A loss value that is not plain torch's fails the output check on every rank."""
    torch.manual_seed(0)
    subject = load_subject(GAN)
    check = Checker(subject, Config(), seed=0, per_rank=2)
    rt = paramfsm.shard(subject.model, units=subject.units, trace=True)
    check.attach(rt)
    x = check.batch(0)[0][rank]
    with check(Forward(0, 0, "train")):
        out = subject.model(x)
    with check(Loss(0, 0, 0, 1)):
        loss = out.float().pow(2).mean()
        check.same(loss)
    try:
        with check(Loss(1, 0, 0, 1)):
            check.same(out.float().pow(2).mean() * 1.01)
    except Failed as exc:
        return exc.kind
    return None


def test_the_output_check_fails_a_value_that_differs(ranks2):
    assert ranks2.run(_output_check_job) == ["output", "output"]


def test_saved_reproductions_of_the_refusal_patterns_stop_where_every_rank_refuses(ranks2, tmp_path):
    """paramfsm #57's canonical patterns rendered as scripts: a write inside rt.gathered that differs by rank,
    and a module attached after shard(), each stop with every rank refusing (exit 0 and the accepted outcome
    named), as the runner does."""
    shape = probe(GAN)
    refusals = canonical(shape)[28:]
    assert len(refusals) == 2
    for index, program in enumerate(refusals):
        path = tmp_path / f"repro_refusal_{index}.py"
        path.write_text(render(program, GAN, per_rank=2, seed=0, world=2, parts=shape.parts), encoding="utf-8")
        for status, output in ranks2.run(run_saved, str(path)):
            assert status == 0 and "stopped: every rank raised" in output, (index, output)
