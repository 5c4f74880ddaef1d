"""``paramfsm verify``: generated programs, the checks, shrinking, reproductions and our models.

The command line is tested in ``test_verify_cli.py``, the training-loop ops (mixed precision, the loss
scaler, clipping, checkpoints, freezing, reentrant blocks) in ``test_verify_training.py``.

The model runs share one two-rank pool (the ``ranks2`` fixture); one runs at world size 3 (``ranks3``).
``PARAMFSM_VERIFY_EXAMPLES`` raises their budget (programs per model) for longer runs.
"""

from __future__ import annotations

import types

import pytest
import torch
from hypothesis import HealthCheck, given, settings

from paramfsm import State
from paramfsm.core.fsm import default_table
from paramfsm.core.spec import INVARIANTS
from paramfsm.verify import checks
from paramfsm.verify.checker import Mirror
from paramfsm.verify.programs import (
    Backward, Config, Drop, Forward, Gathered, Loss, Penalty, Program, Shape, Step, programs,
)
from paramfsm.verify.reproduction import render
from paramfsm.verify.runner import Options, run_program
from paramfsm.verify.subject import global_batch, load_subject, split
from paramfsm.verify.search import (
    EXAMPLES_ENV, VerificationFailed, examples_from_env, probe, verify, verify_model,
)

SUBJECTS = "paramfsm.testing.subjects:"


# ------------------------------------------------------------------ generated programs

@pytest.mark.slow
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(programs(probe(SUBJECTS + "mlp_regression"), max_ops=16))
def test_generated_programs_are_valid_plain_torch(program):
    """The reference runs every generated program without an autograd error (no backward through a freed graph)."""
    subject = load_subject(SUBJECTS + "mlp_regression", 0)
    mirror = Mirror(subject, 2, program.config)
    slices = {b: tuple(split(part, 2) for part in global_batch(subject, b, 0, 2, 2)) for b in range(4)}
    for op in program.ops:
        mirror.apply(op, slices)
    assert not mirror.outs and not mirror.losses, "the program must end by dropping every output"


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(programs(Shape(modules=("blocks.0", "head")), max_ops=16))
def test_reproductions_are_python(program):
    script = render(program, SUBJECTS + "tiny_transformer", per_rank=2, seed=3, fail_at=len(program.ops) - 1,
                    message="why it failed", fault="tied_reduced_twice")
    compile(script, "repro.py", "exec")
    assert "FAULT = 'tied_reduced_twice'" in script
    assert ("# <- fails here" in script) == bool(program.ops)
    assert script.count("    with check(") == len(program.ops) and "    check.finish()" in script


def test_probe_reads_units_and_output():
    shape = probe(SUBJECTS + "branchy_lm")
    assert "adapter" in shape.modules and "blocks.1.qkv" in shape.modules and shape.tensor_output


# ------------------------------------------------------------------ the checks

def test_every_spec_invariant_is_implemented():
    named = {inv for state in default_table().spec.states.values() for inv in state.invariants}
    assert named <= set(checks.INVARIANTS) <= INVARIANTS


class _Unit:
    def __init__(self, live_graphs):
        self.live_graphs = live_graphs


class _Record:
    """A stand-in for a parameter record, to show each invariant check can fail."""

    def __init__(self, data, pending=None, live_graphs=0):
        self.name, self.param, self.shape = "w", torch.nn.Parameter(data), (2, 3)
        self.shard = torch.nn.Parameter(torch.zeros(3))
        self.shard_numel, self.requires_grad = 3, True
        self.pending, self.units = pending, (_Unit(live_graphs),)


@pytest.mark.parametrize("name, good, bad", [
    ("data_empty", _Record(torch.empty(0)), _Record(torch.zeros(2, 3))),
    ("data_full", _Record(torch.zeros(2, 3)), _Record(torch.empty(0))),
    ("no_handle", _Record(torch.empty(0)), _Record(torch.empty(0), pending=object())),
    ("pending_handle", _Record(torch.empty(0), pending=object()), _Record(torch.empty(0))),
    ("retained_graph_live", _Record(torch.zeros(2, 3), live_graphs=1), _Record(torch.zeros(2, 3))),
])
def test_invariant_checks_can_fail(name, good, bad):
    assert checks.INVARIANTS[name](good) is None
    assert checks.INVARIANTS[name](bad)


def test_shard_intact_check_can_fail():
    rec = _Record(torch.empty(0))
    assert checks.INVARIANTS["shard_intact"](rec) is None
    rec.shard = torch.nn.Parameter(torch.zeros(4))
    assert "shape" in checks.INVARIANTS["shard_intact"](rec)


def test_communication_check():
    counts = {"all_gathers": 3, "reduce_scatters": 1}
    zero = {"all_gathers": 0, "reduce_scatters": 0}
    assert checks.communication("Backward", zero, counts, all_deferred=False, grad_params=4, units=3) == []
    assert checks.communication("Backward", zero, counts, all_deferred=True, grad_params=4, units=3)
    assert checks.communication("Step", zero, counts, all_deferred=False, grad_params=4, units=3)


def test_examples_from_env(monkeypatch):
    monkeypatch.delenv(EXAMPLES_ENV, raising=False)
    assert examples_from_env(7) == 7
    monkeypatch.setenv(EXAMPLES_ENV, "250")
    assert examples_from_env(7) == 250
    monkeypatch.setenv(EXAMPLES_ENV, "many")
    with pytest.raises(ValueError, match=EXAMPLES_ENV):
        examples_from_env(7)


# ------------------------------------------------------------------ on the ranks

@pytest.mark.slow
def test_a_fixed_program_passes_every_check(ranks2):
    """The seed pattern, a gradient penalty, checkpointing and gathered access, against plain torch."""
    ops = (Forward(0, 0, "train"), Loss(0, 0, 0, 0), Loss(1, 0, 0, 1), Backward(0, True, False),
           Backward(1, False, True), Step(), Gathered("blocks.0", 1), Forward(1, 1, "checkpoint"),
           Loss(2, 1, 1, 2), Backward(2, True, False), Backward(2, False, False),
           Forward(2, 2, "eval"), Loss(3, 2, 2, 0), Penalty(3, False),
           Drop(0, (0, 1)), Drop(1, (2,)), Drop(2, (3,)))
    for retain in ("defer", "regather"):
        program = Program(Config(retain=retain), ops)
        outcomes = ranks2.run(run_program, SUBJECTS + "tiny_transformer", program, Options())
        for outcome in outcomes:
            assert not outcome.failed, f"retain={retain}: {outcome.kind} at op {outcome.op}: {outcome.message}"


def test_gathered_after_a_step_sees_the_stepped_parameters(ranks2):
    """Gathered access after a step over a retained graph must see the stepped parameters."""
    ops = (Forward(0, 0, "train"), Loss(0, 0, 0, 0), Backward(0, True, False), Step(),
           Gathered(None, None), Drop(0, (0,)))
    outcome = ranks2.run(run_program, SUBJECTS + "tiny_transformer", Program(Config(), ops), Options())[0]
    assert not outcome.failed, outcome.message


def test_a_failure_shrinks_to_a_reproduction(ranks2):
    report = verify(SUBJECTS + "tiny_transformer_tied", examples=10, pool=ranks2, fault="tied_reduced_twice",
                    shrink_budget_s=120, canonical_first=False)
    finding = report.failure
    assert finding is not None and finding.kind == "reference"
    assert len(finding.program.ops) <= 4, finding.reproduction
    assert "loss0.backward()  # <- fails here" in finding.reproduction
    with pytest.raises(VerificationFailed, match="Reproduction"):
        verify_model(SUBJECTS + "tiny_transformer_tied", examples=10, pool=ranks2, fault="tied_reduced_twice",
                     shrink=False)


# branchy_lm is verified by the fault catalogue's baseline (tests/test_mutants.py), with more programs.
@pytest.mark.slow
@pytest.mark.parametrize("subject", ["tiny_transformer", "tiny_transformer_tied", "mlp_regression"])
def test_verify_our_models(ranks2, subject):
    verify_model(SUBJECTS + subject, world_size=2, examples=12, pool=ranks2, shrink_budget_s=30)


@pytest.mark.slow
def test_verify_at_world_3(ranks3):
    """CI runs verify at world size 3 too (padded shards of another size): canonical, then drawn programs."""
    report = verify_model(SUBJECTS + "branchy_lm", world_size=3, examples=8, pool=ranks3, shrink_budget_s=30)
    assert report.accepted >= 8


# The invariants DESIGN §2/§3 promise per state. A spec edit that drops one must fail here, not pass
# silently because the remaining ones still hold.
PROMISED_INVARIANTS = {
    "NOT_AVAILABLE": {"data_empty", "shard_intact", "no_handle"},
    "INFLIGHT": {"data_empty", "shard_intact", "pending_handle"},
    "AVAILABLE": {"data_full", "shard_intact", "no_handle"},
    "DEFERRED_RELEASE": {"data_full", "shard_intact", "no_handle", "retained_graph_live"},
}
_GOOD_BAD = {  # invariant -> (attributes that satisfy it, attributes that break only it)
    "data_empty": ({"data": torch.empty(0)}, {"data": torch.zeros(2, 3)}),
    "data_full": ({"data": torch.zeros(2, 3)}, {"data": torch.empty(0)}),
    "shard_intact": ({"shard": 3}, {"shard": 4}),
    "no_handle": ({"pending": None}, {"pending": object()}),
    "pending_handle": ({"pending": object()}, {"pending": None}),
    "retained_graph_live": ({"live": 1}, {"live": 0}),
}


def test_the_spec_names_the_promised_invariants():
    spec = default_table().spec
    assert {name: set(state.invariants) for name, state in spec.states.items()} == PROMISED_INVARIANTS


def _record_in(state: str, attrs: dict):
    rec = _Record(attrs.get("data", torch.empty(0)), pending=attrs.get("pending"), live_graphs=attrs.get("live", 0))
    rec.shard = torch.nn.Parameter(torch.zeros(attrs.get("shard", 3)))
    rec.state = State[state]
    return rec


@pytest.mark.parametrize("state, invariant", [(s, i) for s, invs in PROMISED_INVARIANTS.items() for i in sorted(invs)])
def test_a_state_breaking_one_invariant_is_reported_by_name(state, invariant):
    attrs = {}
    for other in PROMISED_INVARIANTS[state]:
        attrs.update(_GOOD_BAD[other][0])
    rt = types.SimpleNamespace(table=default_table(), scheduler=types.SimpleNamespace(records=[]))
    rt.scheduler.records = [_record_in(state, attrs)]
    assert checks.state_invariants(rt) == [], "the all-good record must pass"
    attrs.update(_GOOD_BAD[invariant][1])
    rt.scheduler.records = [_record_in(state, attrs)]
    problems = checks.state_invariants(rt)
    assert len(problems) == 1 and f"breaks invariant {invariant}" in problems[0], problems
