"""``paramfsm verify MODULE:FACTORY``: property-based verification of training loops from the command line.

The command draws training-loop programs with hypothesis, runs each one on
``--world-size`` local gloo ranks and on an unsharded plain-torch reference,
and checks after every op that gradients and parameters match, that every
parameter satisfies the spec's invariants for its state, that nothing stays
gathered, that communication counts are sane and that the trace replays
through the spec. A failure is shrunk and printed as a runnable script
(stdout); the exit status is then 1.

``FACTORY`` names a callable returning ``(model, make_batch, loss_fn)`` or a
:class:`paramfsm.testing.Subject` (see :mod:`paramfsm.testing.subject` for
the protocol). ``MODULE`` is imported from the current directory too.

:func:`add_parser` is what :mod:`paramfsm.cli` loads (lazily) to add the
command.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_EXAMPLES = 20


def add_parser(subparsers) -> None:
    """Add the ``verify`` command to the ``paramfsm`` command line."""
    parser = subparsers.add_parser(
        "verify", help="check generated training loops on local ranks against plain torch",
        description=__doc__.split("\n\n")[1])
    parser.add_argument("factory", metavar="MODULE:FACTORY",
                        help="callable returning (model, make_batch, loss_fn) or a paramfsm.testing.Subject")
    parser.add_argument("--world-size", type=int, default=2, help="local gloo ranks (default 2)")
    parser.add_argument("--examples", type=int, default=None,
                        help=f"programs to try (default ${{PARAMFSM_VERIFY_EXAMPLES}} or {DEFAULT_EXAMPLES})")
    parser.add_argument("--seed", type=int, default=0, help="seeds the model, the data and the search")
    parser.add_argument("--max-ops", type=int, default=16, help="upper bound on drawn steps per program")
    parser.add_argument("--per-rank", type=int, default=2, help="batch size per rank")
    parser.add_argument("--no-shrink", action="store_true", help="report the first failing program as found")
    parser.add_argument("--shrink-seconds", type=float, default=120.0, help="time budget for shrinking")
    parser.add_argument("--fault", default=None,
                        help="inject a catalogued bug on the ranks (see python -m paramfsm.testing.mutants --list)")
    parser.add_argument("-o", "--output", type=Path, help="also write the reproduction script here")
    parser.set_defaults(func=run)


def run(args) -> int:
    """Handler of ``paramfsm verify``; returns the exit status."""
    from paramfsm.cli import CommandError

    try:
        from paramfsm.testing.verify import examples_from_env, verify
    except ImportError as exc:
        raise CommandError(f"paramfsm verify needs hypothesis ({exc}); install it with "
                           "pip install 'paramfsm[test]'", 2) from None
    if args.world_size < 1:
        raise CommandError(f"--world-size {args.world_size}: need at least 1 rank", 2)
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        examples = args.examples if args.examples is not None else examples_from_env(DEFAULT_EXAMPLES)
    except ValueError as exc:
        raise CommandError(str(exc), 2) from None
    try:
        report = verify(args.factory, world_size=args.world_size, examples=examples, seed=args.seed,
                        fault=args.fault, shrink=not args.no_shrink, shrink_budget_s=args.shrink_seconds,
                        max_ops=args.max_ops, per_rank=args.per_rank)
    except (ImportError, AttributeError, TypeError, ValueError, KeyError) as exc:
        raise CommandError(f"cannot verify {args.factory}: {type(exc).__name__}: {exc}", 2) from None
    finding = report.failure
    if finding is None:
        print(f"OK: {report.examples} programs on {args.world_size} ranks matched plain torch and the spec "
              f"({report.seconds:.1f}s, seed {args.seed})")
        return 0
    print(finding.reproduction, end="")
    if args.output is not None:
        args.output.write_text(finding.reproduction, encoding="utf-8")
    where = f"op {finding.op}" if finding.op is not None else "setup or teardown"
    first = finding.message.splitlines()[0] if finding.message else ""
    log.info("failure detail:\n%s", finding.detail)
    raise CommandError(f"{finding.kind} check failed at {where} after {report.examples} programs: {first[:400]} "
                       f"(reproduction on stdout; run it with torchrun --nproc-per-node {args.world_size})")
