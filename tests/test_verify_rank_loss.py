"""Verify's RankLoss op: a loss that reads another output on each rank.

The checker accepts exactly two outcomes: values and gradients equal to plain torch's (each rank slice's loss
from its own output), or ``RankDesync`` raised on every rank at the same op, naming a unit and the fix (the
program stops there, not failed). The canonical program gets one of them on every subject, and so does its
saved reproduction; planted bugs fail: one rank's RankDesync swallowed, a RankDesync naming no fix, one before
any RankLoss, and a loss read from the wrong output.
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import HealthCheck, given, settings

from paramfsm.errors import RankDesync
from paramfsm.verify import runner
from paramfsm.verify.search import probe
from paramfsm.verify.frequencies import frequencies
from paramfsm.verify.mirror import Mirror
from paramfsm.verify.ops import Backward, Forward, RankLoss, Step, SubForward
from paramfsm.verify.programs import CANONICAL, canonical, programs
from paramfsm.verify.rank_loss import problems
from paramfsm.verify.reproduction import render, run_saved
from paramfsm.verify.runner import Options, run_program
from paramfsm.verify.subject import global_batch, load_subject, split

SUBJECTS = "paramfsm.testing.subjects:"
GAN = SUBJECTS + "gan_pair"
ONE_UNIT = SUBJECTS + "mlp_one_unit"
#: The canonical program of RankLoss.
RANK_LOSS = next(i for i, (_, intents) in enumerate(CANONICAL) if any(kind == "rank_loss" for kind, *_ in intents))


def _rank_loss_program(name: str):
    return canonical(probe(name))[RANK_LOSS]


# ------------------------------------------------------------------ drawn programs (no ranks)

def test_the_rank_loss_program_is_canonical():
    """Two batches' outputs, the root output and a unit run again on its saved inputs, two units on detached
    inputs: each RankLoss reads two outputs and is followed by its backward."""
    ops = _rank_loss_program(GAN).ops
    losses = [i for i, op in enumerate(ops) if isinstance(op, RankLoss)]
    assert len(losses) == 3, ops
    for i in losses:
        assert len(ops[i].outs) == 2 and isinstance(ops[i + 1], Backward) and ops[i + 1].loss == ops[i].loss
    assert isinstance(ops[losses[0] + 2], Step) and isinstance(ops[losses[1] + 2], Step), "a step after each"
    made = {op.out: op for op in ops if isinstance(op, (Forward, SubForward))}
    first, second = (made[o] for o in ops[losses[2]].outs)
    assert isinstance(first, SubForward) and isinstance(second, SubForward) and first.detach and second.detach
    assert first.module != second.module, "the last RankLoss reads two different units"


def test_drawn_rank_losses_run_on_plain_torch():
    """The mirror runs every drawn program holding a RankLoss, and its reproduction compiles."""
    shape = probe(GAN)
    seen = []

    @settings(max_examples=40, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(programs(shape, max_ops=12))
    def draw(program):
        if not any(isinstance(op, RankLoss) for op in program.ops):
            return
        seen.append(program)
        subject = load_subject(GAN, 0)
        mirror = Mirror(subject, 2, program.config)
        slices = {b: tuple(split(part, 2) for part in global_batch(subject, b, 0, 2, 2)) for b in range(4)}
        for op in program.ops:
            mirror.apply(op, slices)
        compile(render(program, GAN, per_rank=2, seed=0, parts=shape.parts), "repro.py", "exec")

    draw()
    assert seen, "no drawn program held a RankLoss"


def test_rank_losses_are_drawn_over_outputs_of_the_same_and_of_different_modules():
    seen = frequencies(probe(GAN), examples=50, seeds=3)
    for pattern in ("RankLoss", "RankLoss over outputs of different modules", "RankLoss over outputs of the same modules"):
        assert seen[pattern], f"no drawn program holds {pattern!r}: {seen}"


def test_a_desync_message_must_name_a_unit_and_a_fix():
    good = RankDesync(rank=0, unit="disc", step=1, detail="ranks [0, 1] issued different collectives",
                      advice="make the module enclosing the branch one unit: units=[GanPair]")
    assert problems(good) == []
    assert "offers no fix" in problems(RankDesync(rank=0, unit="disc", step=1, detail="different"))[0]
    assert "names no unit" in problems(RankDesync(rank=0, unit="", step=1, detail="x", advice="units=[Net]"))[0]


# ------------------------------------------------------------------ on the ranks

def _outcomes(ranks2, name, program, options=Options()):
    return ranks2.run(run_program, name, program, options)


@pytest.mark.parametrize("subject", ["gan_pair", "structured_outputs", "view_outputs", "mlp_one_unit"])
def test_the_canonical_rank_loss_program_trains_or_desyncs_on_every_rank(ranks2, subject):
    """Every rank ends alike: the whole program passed, or every rank stopped with RankDesync at the backward
    of a RankLoss, whose message names that rank's unit and the fix."""
    name = SUBJECTS + subject
    program = _rank_loss_program(name)
    outcomes = _outcomes(ranks2, name, program)
    assert not any(o.failed for o in outcomes), [(o.kind, o.op, o.message[:400]) for o in outcomes]
    kinds = {(o.kind, o.op) for o in outcomes}
    assert len(kinds) == 1, kinds
    if subject == "mlp_one_unit":  # one unit: every rank's backward reaches it, so it trains like plain torch
        assert kinds == {("", None)}
        return
    for o in outcomes:
        assert o.kind == "desync", o
        assert isinstance(program.ops[o.op], Backward) and isinstance(program.ops[o.op - 1], RankLoss)
        assert "unit '" in o.message and "units=[" in o.message, o.message
    if subject == "gan_pair":  # the first two RankLoss ops reach the same units on both ranks: they trained
        assert outcomes[0].op == max(i for i, op in enumerate(program.ops) if isinstance(op, Backward))


@pytest.mark.parametrize("factory", [GAN, ONE_UNIT])
def test_the_saved_rank_loss_reproduction_passes(ranks2, tmp_path, factory):
    """The script exits 0 on both ranks: it trained, or every rank raised RankDesync and the script stopped."""
    path = tmp_path / "repro_rank_loss.py"
    path.write_text(render(_rank_loss_program(factory), factory, per_rank=2, seed=0, world=2,
                           parts=probe(factory).parts), encoding="utf-8")
    results = ranks2.run(run_saved, str(path))
    assert [status for status, _ in results] == [0, 0], results
    if factory == GAN:
        assert all("every rank raised RankDesync at op 16" in output for _, output in results), results
    else:
        assert results == [(0, ""), (0, "")]


def _planted(rank, world, name, program, plant):
    """``run_program`` with a bug planted in how the ops run on the ranks (the checker is left alone)."""
    original = runner.Run._apply

    def swallowed(self, op):  # rank 1's runtime swallows its RankDesync and trains on
        try:
            original(self, op)
        except RankDesync:
            if self.rank != 1:
                raise

    def without_fix(self, op):  # a RankDesync whose message offers no fix
        try:
            original(self, op)
        except RankDesync as exc:
            raise RankDesync(rank=exc.rank, unit=exc.unit, step=exc.step, detail=exc.detail) from None

    def early(self, op):  # a RankDesync on every rank before any RankLoss ran
        if isinstance(op, Backward):
            raise RankDesync(rank=self.rank, unit="gen", step=0, detail="planted", advice="units=[GanPair]")
        original(self, op)

    def wrong_output(self, op):  # every rank's loss reads the first output
        original(self, attrs.evolve(op, outs=op.outs[:1]) if isinstance(op, RankLoss) else op)

    runner.Run._apply = {"swallowed": swallowed, "without_fix": without_fix, "early": early,
                         "wrong_output": wrong_output}[plant]
    try:
        outcome = run_program(rank, world, name, program, Options())
    finally:
        runner.Run._apply = original
    return outcome.failed, outcome.kind, outcome.op, outcome.message


def test_a_rank_desync_on_one_rank_only_fails(ranks2):
    program = _rank_loss_program(GAN)
    results = ranks2.run(_planted, GAN, program, "swallowed")
    assert all(failed for failed, *_ in results), results
    assert results[0][1] == "desync" and "not on every rank" in results[0][3], results[0]
    assert results[0][2] == results[1][2] == 16, results


def test_a_rank_desync_naming_no_fix_fails(ranks2):
    results = ranks2.run(_planted, GAN, _rank_loss_program(GAN), "without_fix")
    assert [(failed, kind, op) for failed, kind, op, _ in results] == [(True, "desync", 16)] * 2, results
    assert all("offers no fix" in message for *_, message in results), results


def test_a_rank_desync_before_any_rank_loss_fails(ranks2):
    program = canonical(probe(GAN))[0]  # a forward, two losses, backward passes: the same on every rank
    results = ranks2.run(_planted, GAN, program, "early")
    assert all(failed and kind == "exception" and "RankDesync" in message for failed, kind, _, message in results)


def test_a_loss_read_from_the_wrong_output_fails(ranks2):
    """Rank 1 reads the first output instead of its own: its loss is not plain torch's for its slice."""
    results = ranks2.run(_planted, GAN, _rank_loss_program(GAN), "wrong_output")
    assert all(failed and op == 2 for failed, _, op, _ in results), results
    assert results[1][1] == "output", results[1]
