"""Mutation run: does ``paramfsm verify`` kill every bug of the catalogue (:mod:`paramfsm.verify.faults`)?

``python -m paramfsm.testing.mutants`` first verifies the unmutated runtime
with the same budget (a baseline: if it fails, a "kill" would mean nothing
and the run stops), then runs verification once per catalogued fault,
injected on the ranks, and prints one row per fault: the bug, its source,
whether verify killed it, how many programs it needed (the canonical patterns
run first, see :data:`paramfsm.verify.programs.CANONICAL`), the seconds to the
first failing program, and which check caught it. The programs a seed draws
are the same with and without a fault until the first failure, so a kill
within the baseline's budget is the fault's doing. A fault in what
``paramfsm trace check`` reads (one with a ``trace_scenario``) is killed
through ``trace check`` instead: its scenario's trace, made and checked with
the fault active, must still be rejected, as it is without the fault. The
exit status is 1 when the baseline fails or a fault survives.

[Note: a fault's pattern]
Every fault the search kills today is killed by one of the canonical programs, which run first and in
order. :data:`PATTERNS` names that program for each (its index in
:data:`~paramfsm.verify.canonical.CANONICAL`: a kill at example k of the full run's table is pattern
k - 1). ``--patterns`` (and the CI test, ``tests/test_mutants.py``) runs each fault's pattern alone, and
the unmutated runtime on the same patterns first. That is enough: verify runs the canonical programs
first, each program runs on a new model and runtime, and the unmutated runtime passes every one, so a
search that reaches pattern k kills the fault there unless an earlier program already did. What it does
not show is a drawn program's kill; ``test_drawn_programs_alone_kill_the_direct_faults`` checks the search
itself, and ``make mutants`` runs the whole search for every fault. A fault whose pattern no longer kills
it (the canonical list or the fault changed) fails the test by name: run ``make mutants`` again and name
the new pattern here. On two cores the patterns alone take about a tenth of the full run.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import sys
import tempfile
import time

import attrs

from paramfsm import cli
from paramfsm.core.trace import Trace
from paramfsm.verify.launch import RankPool
from paramfsm.verify import faults
from paramfsm.verify.faults import CATALOGUE, Fault
from paramfsm.verify.search import Finding, verify

log = logging.getLogger(__name__)

SUBJECT = "paramfsm.testing.subjects:branchy_lm"

#: The canonical program that kills each fault first in the full search (see [Note: a fault's pattern]); the
#: faults killed through ``trace check`` have none.
PATTERNS: dict[str, int] = {
    "release_in_retained_window": 0, "tied_reduced_twice": 0, "release_before_last_holder": 0,
    "grads_summed_not_averaged": 0, "deferred_reuse_regathers": 0, "released_data_not_emptied": 0,
    "final_callback_once_per_process": 0, "missing_grads_out_of_order": 0, "on_demand_never_released": 0,
    "deferred_never_flushed": 1, "recompute_not_gathered": 1, "retained_graph_drop_not_returned": 2,
    "preprocess_once_per_process": 3, "once_per_forward_flag": 3, "abandoned_prefetch_left_inflight": 6,
    "no_grad_forward_left_gathered": 6, "retain_lost_in_higher_order": 7, "found_inf_not_agreed": 8,
    "unscaled_once_per_backward": 8, "scale_not_backpropagated": 8, "clip_without_clamp": 8,
    "batch_norm_in_param_dtype": 8, "checkpoint_offset_unpadded": 9, "tied_aliases_compared_by_identity": 9,
    "late_grads_dropped": 9, "nested_task_sends_staged": 9, "kept_grad_not_folded": 10, "sync_read_at_forward": 10,
    "kept_unit_resharded_after_forward": 10, "no_grad_forward_kept_gathered": 10, "stale_copy_after_step": 11,
    "writeback_dropped": 12, "page_in_skipped": 17, "writeback_lost": 17, "tier_read_after_step": 17,
    "grad_accumulation_unwritten": 17, "tier_file_shared": 17, "state_dict_copies": 17,
    "placement_follows_the_optimizer": 17, "step_checked_before_closure": 19, "interrupted_grads_kept": 20,
    "member_call_unhooked": 20, "kept_read_unnoticed": 21, "whole_params_as_shards": 22, "plain_clip_partial": 22,
    "resident_write_dropped": 23, "hooks_per_unit": 23, "write_in_forward_dropped": 24,
    "compiler_reads_shard_grad": 25, "parent_step_restores": 26, "writeback_agreement_skips_first_element": 28,
    "nested_attach_unnoticed": 29,
}


@attrs.frozen(slots=True)
class Row:
    """One fault's verification: killed or not, programs and seconds to the kill, the check, the finding."""

    fault: Fault
    killed: bool
    examples: int | None
    seconds: float
    check: str
    finding: Finding | None = None


def run_catalogue(*, subject: str = SUBJECT, examples: int = 25, seed: int = 0, world_size: int = 2,
                  pool: RankPool | None = None, faults=CATALOGUE, canonical_first: bool = True,
                  baseline: bool = True, patterns: bool = False) -> tuple[str | None, list[Row]]:
    """Baseline, then one verification per fault; returns (baseline failure message or None, rows).

    ``baseline=False`` skips the unmutated runs, for a caller that runs them apart (tests/test_mutants.py).
    ``patterns``: each fault runs its pattern alone, and each baseline the patterns of its subject's faults
    (see [Note: a fault's pattern])."""
    own_pool = pool is None
    pool = pool or RankPool(world_size)
    try:
        # A fault names its own subject when the default one cannot exercise it; each subject's
        # unmutated baseline must pass first.
        for each in (dict.fromkeys(fault.subject or subject for fault in faults) or (subject,)) if baseline else ():
            only = subject_patterns(faults, each, subject) if patterns else None
            if only == ():
                continue
            baseline = verify(each, world_size=world_size, examples=examples, seed=seed, pool=pool, shrink=False,
                              canonical_first=canonical_first, canonical_only=only)
            if baseline.failure is not None:
                finding = baseline.failure
                return (f"the unmutated runtime fails on {each} ({finding.kind} at op {finding.op}: "
                        f"{finding.message.splitlines()[0][:300]})\n{finding.reproduction}"), []
        unsound = [fault.name for fault in faults if fault.trace_scenario is not None and trace_check(fault, None) != 1]
        if unsound:
            return f"the unmutated trace check accepts the bad traces of {', '.join(unsound)}", []
        rows = []
        for fault in faults:
            start = time.perf_counter()
            if fault.trace_scenario is not None:
                killed = trace_check(fault, fault.name) != 1  # the bad trace got through
                rows.append(Row(fault, killed, 1, time.perf_counter() - start, "trace check" if killed else ""))
                continue
            report = verify(fault.subject or subject, world_size=world_size, examples=examples, seed=seed,
                            pool=pool, fault=fault.name, shrink=False, canonical_first=canonical_first,
                            canonical_only=(PATTERNS[fault.name],) if patterns else None)
            finding = report.failure
            rows.append(Row(fault, finding is not None, report.examples_to_failure,
                            report.seconds_to_failure if finding else time.perf_counter() - start,
                            finding.kind if finding else "", finding))
            log.info("%s: %s", fault.name, "killed" if finding else "survived")
        return None, rows
    finally:
        if own_pool:
            pool.close()


def subject_patterns(faults, each: str, subject: str = SUBJECT) -> tuple[int, ...]:
    """The patterns of the verify-killed ``faults`` whose subject is ``each``, in order."""
    return tuple(sorted({PATTERNS[f.name] for f in faults
                         if (f.subject or subject) == each and f.trace_scenario is None}))


def trace_check(fault: Fault, active: str | None) -> int:
    """The exit status of ``paramfsm trace check`` on ``fault``'s scenario trace, made and checked with the
    fault ``active`` (None: the unmutated code). A sound check rejects every scenario (status 1)."""
    with faults.activate(active), tempfile.TemporaryDirectory(prefix="paramfsm-mutant-trace-") as folder:
        path = Trace(0, fault.trace_scenario()).dump(os.path.join(folder, f"{fault.name}.jsonl"))
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return cli.main(["trace", "check", str(path)])


def format_table(rows: list[Row]) -> str:
    """A markdown table: bug, source, killed?, examples needed, seconds, check."""
    lines = ["| bug | source | killed? | examples | seconds | check |", "|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| `{row.fault.name}`: {row.fault.bug} | {row.fault.source} | "
                     f"{'yes' if row.killed else 'NO'} | {row.examples if row.killed else '-'} | "
                     f"{row.seconds:.1f} | {row.check or '-'} |")
    killed = sum(row.killed for row in rows)
    lines.append("")
    lines.append(f"{killed}/{len(rows)} killed")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m paramfsm.testing.mutants", description=__doc__.split("\n\n")[0])
    parser.add_argument("--subject", default=SUBJECT, help=f"verify factory (default {SUBJECT})")
    parser.add_argument("--examples", type=int, default=25, help="programs per fault (and for the baseline)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--only", nargs="+", metavar="FAULT", help="run only these faults")
    parser.add_argument("--random-only", action="store_true",
                        help="skip the canonical patterns: drawn programs only (a harder test of the search)")
    parser.add_argument("--patterns", action="store_true",
                        help="each fault's pattern alone, the canonical program that kills it (PATTERNS)")
    parser.add_argument("--list", action="store_true", help="list the catalogue and exit")
    parser.add_argument("-v", "--verbose", action="store_true", help="one line per program on stderr")
    args = parser.parse_args(argv)
    if args.list:
        for fault in CATALOGUE:
            print(f"{fault.name}\t{fault.kind}\t{fault.bug}\t[{fault.source}]")
        return 0
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    chosen = CATALOGUE
    if args.only:
        unknown = set(args.only) - {f.name for f in CATALOGUE}
        if unknown:
            parser.error(f"unknown fault(s): {', '.join(sorted(unknown))}")
        chosen = tuple(f for f in CATALOGUE if f.name in args.only)
    # Every injected fault makes the flight recorder dump on purpose: those dumps go to a temporary
    # folder, not the working directory, unless PARAMFSM_TRACE_DIR says where.
    dumps = os.environ.get("PARAMFSM_TRACE_DIR") or tempfile.mkdtemp(prefix="paramfsm-mutant-dumps-")
    os.environ["PARAMFSM_TRACE_DIR"] = dumps
    start = time.perf_counter()
    problem, rows = run_catalogue(subject=args.subject, examples=args.examples, seed=args.seed,
                                  world_size=args.world_size, faults=chosen, canonical_first=not args.random_only,
                                  patterns=args.patterns)
    if problem is not None:
        print(f"mutants: {problem}", file=sys.stderr)
        return 1
    print(format_table(rows))
    programs = ("each fault's pattern alone" if args.patterns else "drawn programs only" if args.random_only
                else "the canonical patterns, then drawn programs")
    subjects = ", ".join(dict.fromkeys(fault.subject or args.subject for fault in chosen))
    drawn = "" if args.patterns else f" (at most {args.examples} drawn per fault)"
    print(f"subjects {subjects}, {programs}{drawn}, seed {args.seed}, "
          f"world size {args.world_size}, {time.perf_counter() - start:.0f}s in all; flight-recorder dumps in {dumps}")
    return 0 if all(row.killed for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
