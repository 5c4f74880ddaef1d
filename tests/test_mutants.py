"""The fault catalogue: every real lifetime bug in it must be killed by ``paramfsm verify`` within the CI budget.

The tests that run the catalogue on ranks carry the ``catalogue`` mark: ``make test`` leaves them out and
``make test-catalogue`` runs them, in parts on two test processes, as its own step of every CI run. Each fault
runs the canonical program that kills it first in the full search, alone (its pattern: see [Note: a fault's
pattern] in :mod:`paramfsm.testing.mutants`); ``make mutants`` runs the whole search for every fault.
"""

from __future__ import annotations

import re

import pytest

from paramfsm import amp, checkpoint, optim
from paramfsm.optim import grad_norm, offload_step
from paramfsm.sharding import assembly, full_state, gathered, model_changes, offload
from paramfsm.checkpoint import layout as checkpoint_layout
from paramfsm.core import replay
from paramfsm.core.trace import Trace
from paramfsm.engine.effects import executor, lost_writes
from paramfsm.engine.effects.executor import Executor
from paramfsm.engine.effects.grad_sync import UnsyncedGrads
from paramfsm.engine.effects.paging import Pager
from paramfsm.engine.events import events, graph_task, hooks, members
from paramfsm.engine.events.higher_order import SecondOrderEntry
from paramfsm.engine.schedule import holds, residency
from paramfsm.engine.schedule.backward import GraphTasks
from paramfsm.engine.schedule.deferral import Deferral
from paramfsm.engine.schedule.grad_paging import GradPaging
from paramfsm.engine.schedule.grad_order import GradRouting
from paramfsm.engine.schedule.on_demand import OnDemand
from paramfsm.engine.schedule.prefetch import Prefetch
from paramfsm.engine.schedule.residency import Residency
from paramfsm.engine.schedule.scheduler import Scheduler
from paramfsm.engine.schedule.shard_writes import ShardWrites
from paramfsm.engine.storage import partitioned
from paramfsm.engine.storage.tiers import DiskTier
from paramfsm.testing.mutants import (PATTERNS, SUBJECT, format_table, main, run_catalogue, subject_patterns,
                                      trace_check)
from paramfsm.verify import faults
from paramfsm.verify.search import examples_from_env, verify
from paramfsm.verify.reproduction import run_saved

#: Drawn programs only (no canonical patterns first): the search alone needs more of them.
DRAWN_EXAMPLES = 60


def test_the_catalogue():
    assert len(faults.CATALOGUE) >= 12
    assert len(faults.FAULTS) == len(faults.CATALOGUE), "fault names must be unique"
    for fault in faults.CATALOGUE:
        assert fault.source and fault.bug and fault.kind in ("correctness", "memory", "performance")
    assert {f.kind for f in faults.CATALOGUE} == {"correctness", "memory", "performance"}


def _methods(cls) -> dict:
    return {name: getattr(cls, name) for name in dir(cls) if not name.startswith("__")}


def _patchable():
    return ([_methods(cls) for cls in (Scheduler, GraphTasks, Deferral, Prefetch, GradRouting, OnDemand)],
            _methods(Executor),
            hooks._post_forward, events.ForwardCall.__del__, graph_task.queue_final_callback,
            executor.reduce_scatter_flat, dict(vars(amp.GradScaler)), grad_norm.clip_grad_norm_,
            checkpoint_layout.valid_range, vars(SecondOrderEntry)["backward"], full_state.load_full_state_dict,
            replay.replay, Trace._snapshot, dict(vars(UnsyncedGrads)), dict(vars(ShardWrites)),
            gathered._write_back, _methods(Residency), _methods(Pager), optim._after_closure,
            _methods(GradPaging), dict(vars(DiskTier)), checkpoint.sharded_state_dict, members.install, holds.watch,
            residency._LEAVING, offload_step._step_only, optim.is_elementwise, grad_norm._owners,
            lost_writes.checked, assembly.compute_dtypes, partitioned.TracingContext, offload_step.within_step,
            gathered.fingerprint, model_changes._on_module, offload._state_values)


@pytest.mark.parametrize("name", list(faults.FAULTS))
def test_a_fault_is_undone_when_its_block_ends(name):
    before = _patchable()
    with faults.activate(name) as fault:
        assert fault.name == name
        assert _patchable() != before, f"{name} patches nothing"
    assert _patchable() == before


def test_an_unknown_fault_is_named():
    with pytest.raises(KeyError, match="known: preprocess_once_per_process"):
        with faults.activate("no_such_bug"):
            pass


#: The catalogue runs in two parts and its baselines apart, spread over the test processes of ``make
#: test-catalogue`` (pytest-xdist groups). A kill means something only while the unmutated runtime passes the
#: same programs: the baselines' test says so in the same run.
PARTS = 2
PART_PARAMS = [pytest.param(part, marks=pytest.mark.xdist_group(f"catalogue-{part}"), id=f"part{part}")
               for part in range(PARTS)]


def part_of(part: int) -> tuple:
    return faults.CATALOGUE[part::PARTS]


_RUNS: dict = {}  # part -> its run: a parametrized fixture may be set up again for each test under pytest-xdist


@pytest.fixture(params=PART_PARAMS)
def catalogue(request, ranks2):
    """One verification per catalogued fault of one part (run once per test process for the tests below)."""
    part = request.param
    if part not in _RUNS:
        _RUNS[part] = run_catalogue(pool=ranks2, faults=part_of(part), baseline=False, patterns=True)
    return _RUNS[part]


@pytest.mark.catalogue
@pytest.mark.xdist_group("catalogue-baseline")
def test_the_unmutated_runtime_passes_the_programs_that_kill_the_catalogue(ranks2):
    """The baseline of every subject the catalogue's faults run on: the patterns of its faults, with their seed."""
    subjects = dict.fromkeys(fault.subject or SUBJECT for fault in faults.CATALOGUE)
    for subject in subjects:
        report = verify(subject, pool=ranks2, shrink=False, canonical_only=subject_patterns(faults.CATALOGUE, subject))
        assert report.failure is None, (subject, report.failure and report.failure.reproduction)


def test_every_fault_verify_kills_names_its_pattern():
    from paramfsm.verify.canonical import CANONICAL

    assert set(PATTERNS) == {f.name for f in faults.CATALOGUE if f.trace_scenario is None}
    assert all(0 <= index < len(CANONICAL) for index in PATTERNS.values())
    assert subject_patterns(faults.CATALOGUE, "paramfsm.testing.subjects:sized_lm") == (
        PATTERNS[next(f.name for f in faults.CATALOGUE if f.subject == "paramfsm.testing.subjects:sized_lm")],)


@pytest.mark.parametrize("only", [(), (-1,), (10 ** 6,), ("0",)])
def test_canonical_only_names_programs_that_exist(only):
    with pytest.raises(ValueError, match="name one or more canonical programs by their index, 0 to "):
        verify(SUBJECT, canonical_only=only)


def test_the_parts_cover_the_catalogue():
    assert sorted(f.name for part in range(PARTS) for f in part_of(part)) == sorted(faults.FAULTS)


@pytest.mark.catalogue
def test_every_fault_is_killed(catalogue):
    problem, rows = catalogue
    assert problem is None, problem
    table = format_table(rows)
    survivors = [row.fault.name for row in rows if not row.killed]
    assert not survivors, table
    # A kill must come from a check, not from the harness dying ("crash" = a rank job itself failed).
    harness_crashes = [row.fault.name for row in rows if row.check == "crash"]
    assert not harness_crashes, table


@pytest.mark.catalogue
def test_every_saved_reproduction_fails_with_the_check(catalogue, ranks2, tmp_path):
    """Each fault's reproduction, saved to a file, exits 1 with the message of the check verify failed,
    and exits 0 once the bug is gone (the same script with ``FAULT = None``)."""
    problem, rows = catalogue
    assert problem is None, problem
    for row in rows:
        if row.fault.trace_scenario is not None:
            continue  # killed through trace check: no program to reproduce
        finding = row.finding
        assert finding is not None, f"{row.fault.name} survived"
        script = tmp_path / f"repro_{row.fault.name}.py"
        script.write_text(finding.reproduction, encoding="utf-8")
        results = ranks2.run(run_saved, str(script), timeout=120)
        where = f"op {finding.op}" if finding.op is not None else "setup or teardown"
        expected = f"{finding.kind} check failed at {where}: {finding.message.splitlines()[0]}"
        assert all(status == 1 for status, _ in results), (row.fault.name, results)
        assert any(expected in output for _, output in results), (row.fault.name, expected, results)
        fixed = tmp_path / f"fixed_{row.fault.name}.py"
        fixed.write_text(re.sub(r"^FAULT = .*$", "FAULT = None", finding.reproduction, flags=re.M), encoding="utf-8")
        # Silent, or stopped at an accepted refusal (a write inside forward: every rank raised WriteToGathered).
        assert all(status == 0 and (not output or "stopped: every rank raised" in output)
                   for status, output in ranks2.run(run_saved, str(fixed), timeout=120)), row.fault.name


@pytest.mark.catalogue
@pytest.mark.xdist_group("catalogue-drawn")
def test_drawn_programs_alone_kill_the_direct_faults(ranks2):
    """Without the canonical patterns, the search itself finds the faults any training loop trips.

    The user-loop ops spread the draws over more kinds of op, so a retained backward followed by a
    second one comes later than it did: the search gets DRAWN_EXAMPLES programs, and its own baseline
    (the same drawn programs on the unmutated code) runs first."""
    direct = [f for f in faults.CATALOGUE if f.name in (
        "tied_reduced_twice", "release_before_last_holder", "grads_summed_not_averaged", "released_data_not_emptied",
        "no_grad_forward_left_gathered", "release_in_retained_window", "recompute_not_gathered")]
    problem, rows = run_catalogue(examples=examples_from_env(DRAWN_EXAMPLES), pool=ranks2, faults=direct,
                                 canonical_first=False)
    assert problem is None, problem
    assert all(row.killed and row.check != "crash" for row in rows), format_table(rows)


TRACED = {"snapshot_accepted_anywhere", "ring_window_forgets_idle"}


def test_the_faults_killed_through_trace_check_are_named():
    assert {fault.name for fault in faults.CATALOGUE if fault.trace_scenario is not None} == TRACED


def test_mutants_lists_the_catalogue(capsys):
    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(fault.name in out for fault in faults.CATALOGUE)


@pytest.mark.catalogue
def test_faults_in_what_trace_check_reads_are_killed_through_trace_check(catalogue):
    """A spliced snapshot and a ring that forgets an idle leak: each scenario's trace is rejected by
    ``paramfsm trace check`` on the unmutated code and accepted with the fault, so the row says killed."""
    problem, rows = catalogue
    assert problem is None, problem
    traced = [row for row in rows if row.fault.trace_scenario is not None]
    assert {row.fault.name for row in traced} == {row.fault.name for row in rows} & TRACED
    for row in traced:
        assert row.killed and row.check == "trace check", format_table(rows)
        assert trace_check(row.fault, None) == 1 and trace_check(row.fault, row.fault.name) == 0
