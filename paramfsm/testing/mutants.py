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
                  pool: RankPool | None = None, faults=CATALOGUE,
                  canonical_first: bool = True, baseline: bool = True) -> tuple[str | None, list[Row]]:
    """Baseline, then one verification per fault; returns (baseline failure message or None, rows).

    ``baseline=False`` skips the unmutated runs, for a caller that runs them apart (tests/test_mutants.py)."""
    own_pool = pool is None
    pool = pool or RankPool(world_size)
    try:
        # A fault names its own subject when the default one cannot exercise it; each subject's
        # unmutated baseline must pass first.
        for each in (dict.fromkeys(fault.subject or subject for fault in faults) or (subject,)) if baseline else ():
            baseline = verify(each, world_size=world_size, examples=examples, seed=seed, pool=pool, shrink=False,
                              canonical_first=canonical_first)
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
                            pool=pool, fault=fault.name, shrink=False, canonical_first=canonical_first)
            finding = report.failure
            rows.append(Row(fault, finding is not None, report.examples_to_failure,
                            report.seconds_to_failure if finding else time.perf_counter() - start,
                            finding.kind if finding else "", finding))
            log.info("%s: %s", fault.name, "killed" if finding else "survived")
        return None, rows
    finally:
        if own_pool:
            pool.close()


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
                                  world_size=args.world_size, faults=chosen, canonical_first=not args.random_only)
    if problem is not None:
        print(f"mutants: {problem}", file=sys.stderr)
        return 1
    print(format_table(rows))
    programs = "drawn programs only" if args.random_only else "the canonical patterns, then drawn programs"
    subjects = ", ".join(dict.fromkeys(fault.subject or args.subject for fault in chosen))
    print(f"subjects {subjects}, {programs} (at most {args.examples} drawn per fault), seed {args.seed}, "
          f"world size {args.world_size}, {time.perf_counter() - start:.0f}s in all; flight-recorder dumps in {dumps}")
    return 0 if all(row.killed for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
