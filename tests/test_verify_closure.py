"""verify's ``opt.step(closure)`` op: drawn, checked against plain torch, rendered, and killing its fault.

Lightning runs every step as ``opt.step(closure)``, and LBFGS needs one: the
forward and backward run inside the step, after its pre-hook. The
:class:`~paramfsm.verify.ops.ClosureStep` op draws that loop, after
micro-batches under ``rt.no_sync()`` (the closure's backward is the last,
synchronising micro-batch) or zeroing the gradients itself.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from paramfsm.verify.search import probe
from paramfsm.verify.frequencies import frequencies
from paramfsm.verify.mirror import Mirror
from paramfsm.verify.ops import Backward, ClosureStep, Config, Drop, Forward, Loss, NoSync, ZeroGrad
from paramfsm.verify.programs import CANONICAL, canonical, normalise, programs
from paramfsm.verify.reproduction import render, run_saved
from paramfsm.verify.runner import Options, run_program
from paramfsm.verify.subject import global_batch, load_subject, split

SUBJECTS = "paramfsm.testing.subjects:"
LM = SUBJECTS + "tiny_transformer"
#: The canonical program of the closure step.
CLOSURE = next(i for i, (_, intents) in enumerate(CANONICAL) if any(kind == "closure_step" for kind, *_ in intents))


def test_a_closure_after_micro_batches_keeps_their_gradients_and_syncs_them():
    ops = normalise([("closure_step", 1, 1, False)], probe(LM)).ops
    assert ops[:2] == (ZeroGrad(), NoSync(True)) and ops.count(NoSync(False)) == 1
    assert sum(isinstance(op, Backward) for op in ops) == 2, "two micro-batches under no_sync"
    closure = next(op for op in ops if isinstance(op, ClosureStep))
    assert ops.index(NoSync(False)) < ops.index(closure), "the closure's backward runs with sync on"
    assert [type(op) for op in closure.inner] == [Forward, Loss, Backward], "no zero_grad: it is the last micro-batch"
    assert closure.loss == closure.inner[1].loss and closure.batches == (closure.inner[0].batch,)
    assert ops[-1] == Drop(closure.inner[0].out, (closure.loss,))


def test_a_closure_on_its_own_zeroes_the_gradients_first():
    ops = normalise([("closure_step", 2, 0, True)], probe(LM)).ops
    (closure,) = ops[:1]
    assert isinstance(closure, ClosureStep) and closure.inner[0] == ZeroGrad()
    assert closure.inner[1].mode == "checkpoint" and closure.inner[-1] == Backward(closure.loss, False, True)


def test_a_closure_is_drawn_only_where_opt_step_closure_works():
    """Not with one optimizer per part (which would run the closure once each), a loss scaler
    (``GradScaler.step`` refuses a closure), offload (an offloaded step runs unit by unit and refuses a
    closure: ``OffloadError``), gradient sync off or a no_sync window open."""
    intents = [("closure_step", 1, 1, False)]
    assert normalise(intents, probe(LM)).ops
    assert not normalise(intents, probe(SUBJECTS + "gan_pair")).ops
    assert not normalise(intents, probe(LM), Config(param_dtype="float16")).ops
    assert not normalise(intents, probe(LM), Config(offload="cpu")).ops
    assert not normalise([("grad_sync", 0, 0, False)] + intents, probe(LM)).ops[1:-1]
    window = normalise([("no_sync", 0, 0, False)], probe(LM)).ops
    assert not any(isinstance(op, ClosureStep) for op in window)


@pytest.mark.slow  # over 5 s on two cores: make test-slow
def test_drawn_closures_run_in_plain_torch_and_render():
    shape = probe(LM)
    subject = load_subject(LM, 0)
    slices = {b: tuple(split(part, 2) for part in global_batch(subject, b, 0, 2, 2)) for b in range(4)}

    @settings(max_examples=15, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(programs(shape, max_ops=8))
    def draw(program):
        mirror = Mirror(load_subject(LM, 0), 2, program.config)
        for op in program.ops:
            mirror.apply(op, slices)
        assert not mirror.outs and not mirror.losses
        compile(render(program, LM, per_rank=2, seed=0), "repro.py", "exec")

    draw()
    patterns = frequencies(shape, examples=40, seeds=2)
    assert patterns["ClosureStep after micro-batches under no_sync"], patterns
    assert patterns["ClosureStep that zeroes the gradients"], patterns


def test_the_closure_step_moves_the_plain_torch_parameters():
    """The reference's closure really runs: its step changes the parameters like a zero_grad, forward,
    backward and step would."""
    program = normalise([("closure_step", 0, 0, False)], probe(LM))
    closure = program.ops[0]
    plain = normalise([("zero_grad", 0, 0, False)], probe(LM)).ops + closure.inner[1:]
    subject = load_subject(LM, 0)
    slices = {b: tuple(split(part, 2) for part in global_batch(subject, b, 0, 2, 2)) for b in range(4)}
    stepped, by_hand = Mirror(load_subject(LM, 0), 2, Config()), Mirror(load_subject(LM, 0), 2, Config())
    before = {k: v.detach().clone() for k, v in stepped.params.items()}
    stepped.apply(closure, slices)
    for op in plain:
        by_hand.apply(op, slices)
    for opt in by_hand.opts:
        opt.step()
    for name, p in stepped.params.items():
        assert not p.detach().equal(before[name]) or p.grad is None, name
        assert p.detach().equal(by_hand.params[name].detach()), name


def test_the_closure_program_passes_on_2_ranks_and_its_reproduction_too(ranks2, tmp_path):
    program = canonical(probe(LM))[CLOSURE]
    assert sum(isinstance(op, ClosureStep) for op in program.ops) == 2
    for rank, outcome in enumerate(ranks2.run(run_program, LM, program, Options())):
        assert not outcome.failed and not outcome.kind, (rank, outcome.kind, outcome.op, outcome.message[:600])
    path = tmp_path / "repro_closure.py"
    path.write_text(render(program, LM, per_rank=2, seed=0, world=2), encoding="utf-8")
    assert ranks2.run(run_saved, str(path)) == [(0, ""), (0, "")]
