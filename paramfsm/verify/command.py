"""``paramfsm verify MODULE:FACTORY``: property-based verification of training loops from the command line.

The command draws training-loop programs with hypothesis, runs each one on
``--world-size`` local gloo ranks and on an unsharded plain-torch reference,
and checks after every op that gradients and parameters match, that every
parameter satisfies the spec's invariants for its state, that nothing stays
gathered, that communication counts are sane and that the trace replays
through the spec. A failure is shrunk and printed as a runnable script
(stdout) that runs the same checks and exits 1 while the bug is present.
``--examples N`` draws N programs after the canonical patterns, which always
run first (the patterns behind the catalogued bugs), so N + len(CANONICAL)
programs run in all. A program plain torch itself cannot run on the model is rejected, not
reported; the summary counts the rejections by reason.

Exit status: 0 every program passed; 1 a lifetime bug was found; 2 a usage
or factory error (bad arguments; the factory's module is missing or does
not import; the factory raises or returns no usable subject), named in one
line. On long runs a progress line goes to stderr every ``--progress``
seconds.

``FACTORY`` names a callable returning ``(model, make_batch, loss_fn)`` or a
:class:`paramfsm.verify.Subject` (see :mod:`paramfsm.verify.subject` for
the protocol). ``MODULE`` is imported from the current directory too.

:func:`add_parser` is what :mod:`paramfsm.cli` loads (lazily) to add the
command.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_EXAMPLES = 20
PROGRESS_SECONDS = 10.0
HINTS = {"Penalty op": "Subject(create_graph=False) draws no gradient penalties",
         "Forward op": "Subject(checkpoint=False) draws no activation checkpointing, Subject(blocks=()) no "
                       "per-block reentrant checkpointing"}


def add_parser(subparsers) -> None:
    """Add the ``verify`` command to the ``paramfsm`` command line."""
    try:
        from paramfsm.verify.programs import CANONICAL
        canonical = len(CANONICAL)
    except ImportError:  # no hypothesis: the command says so when it runs
        canonical = "the"
    parser = subparsers.add_parser(
        "verify", help="check generated training loops on local ranks against plain torch",
        description=" ".join(__doc__.split("\n\n")[1:3]))
    parser.add_argument("factory", metavar="MODULE:FACTORY",
                        help="callable returning (model, make_batch, loss_fn) or a paramfsm.verify.Subject")
    parser.add_argument("--world-size", type=int, default=2, help="local gloo ranks (default 2)")
    parser.add_argument("--examples", type=int, default=None,
                        help="programs to draw (default ${PARAMFSM_VERIFY_EXAMPLES} or "
                             f"{DEFAULT_EXAMPLES}), run after {canonical} canonical training-loop patterns, "
                             "which always run first")
    parser.add_argument("--seed", type=int, default=0, help="seeds the model, the data and the search")
    parser.add_argument("--max-ops", type=int, default=16, help="upper bound on drawn steps per program")
    parser.add_argument("--per-rank", type=int, default=2, help="batch size per rank")
    parser.add_argument("--no-shrink", action="store_true", help="report the first failing program as found")
    parser.add_argument("--shrink-seconds", type=float, default=120.0, help="time budget for shrinking")
    parser.add_argument("--fault", default=None,
                        help="inject a catalogued bug on the ranks (see python -m paramfsm.testing.mutants --list)")
    parser.add_argument("--progress", type=float, default=PROGRESS_SECONDS, metavar="SECONDS",
                        help=f"a progress line on stderr at most this often (default {PROGRESS_SECONDS:g}; "
                             "0: after every program; negative: never)")
    parser.add_argument("-o", "--output", type=Path, help="also write the reproduction script here")
    parser.set_defaults(func=run)


class ProgressLine:
    """Prints ``verify: 40/208 programs, 3 rejected, 12s`` to a stream at most every ``every`` seconds.

    The first line comes only after ``every`` seconds, so short runs print none.
    """

    def __init__(self, every: float, stream=None):
        self.every, self.stream = every, stream or sys.stderr
        self.last = time.monotonic()

    def __call__(self, progress) -> None:
        now = time.monotonic()
        if self.every < 0 or now - self.last < self.every:
            return
        self.last = now
        if progress.shrinking:
            line = (f"verify: shrinking a failure, {progress.done} programs run, the smallest has "
                    f"{progress.smallest} ops, {progress.seconds:.0f}s")
        else:
            rejected = f", {progress.rejected} rejected" if progress.rejected else ""
            line = f"verify: {progress.done}/{progress.planned} programs{rejected}, {progress.seconds:.0f}s"
        print(line, file=self.stream, flush=True)


def rejections(rejected: dict) -> str:
    """``N programs rejected: plain torch cannot run them on this model: REASON (n); ...``, with hints."""
    total = sum(rejected.values())
    reasons = "; ".join(f"{reason[:300]} ({count})" for reason, count in rejected.items())
    hints = sorted({hint for key, hint in HINTS.items() for reason in rejected if reason.startswith(key)})
    return (f"{total} program{'s' if total != 1 else ''} rejected: plain torch cannot run "
            f"{'them' if total != 1 else 'it'} on this model: {reasons}" + (f" ({'; '.join(hints)})" if hints else ""))


def run(args) -> int:
    """Handler of ``paramfsm verify``; returns the exit status."""
    from paramfsm.cli import CommandError

    try:
        from paramfsm.verify.search import FactoryError, examples_from_env, verify
    except ImportError as exc:
        raise CommandError(f"paramfsm verify needs hypothesis ({exc}); install it with "
                           "pip install 'paramfsm[test]'", 2) from None
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        examples = args.examples if args.examples is not None else examples_from_env(DEFAULT_EXAMPLES)
        report = verify(args.factory, world_size=args.world_size, examples=examples, seed=args.seed,
                        fault=args.fault, shrink=not args.no_shrink, shrink_budget_s=args.shrink_seconds,
                        max_ops=args.max_ops, per_rank=args.per_rank, progress=ProgressLine(args.progress))
    except FactoryError as exc:
        raise CommandError(f"cannot use the verify factory {exc}", 2) from None
    except ValueError as exc:
        raise CommandError(str(exc), 2) from None
    finding = report.failure
    if finding is None:
        if report.examples and not report.accepted:
            raise CommandError(f"nothing verified: {rejections(report.rejected)}", 2)
        print(f"OK: {report.accepted} programs on {args.world_size} ranks matched plain torch and the spec "
              f"({report.seconds:.1f}s, seed {args.seed})"
              + (f"; {rejections(report.rejected)}" if report.rejected else ""))
        return 0
    print(finding.reproduction, end="")
    saved = "on stdout"
    if args.output is not None:
        try:
            args.output.write_text(finding.reproduction, encoding="utf-8")
            saved = f"in {args.output}"
        except OSError as exc:
            saved = f"on stdout; cannot write {args.output}: {exc.strerror or exc}"
    where = f"op {finding.op}" if finding.op is not None else "setup or teardown"
    first = finding.message.splitlines()[0] if finding.message else ""
    log.info("failure detail:\n%s", finding.detail)
    raise CommandError(f"{finding.kind} check failed at {where} after {report.examples} programs: {first[:400]} "
                       f"(the reproduction is {saved}; it runs the same checks under "
                       f"torchrun --nproc-per-node {args.world_size})")
