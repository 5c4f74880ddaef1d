"""The ``paramfsm`` command line: check and draw specs, check, summarize, export and compare traces.

Usage (also ``python -m paramfsm``)::

    paramfsm spec check [FILE]                 validate a spec, both machines (the shipped one by default)
    paramfsm spec draw [FILE] [-o OUT] [--machine residency]   mermaid state diagram
    paramfsm trace check T.jsonl [--spec FILE] replay a trace; name the first illegal record
    paramfsm trace summary T.jsonl             time per state, gathers, deferred windows, leaks
    paramfsm trace export T.jsonl --perfetto OUT.json
    paramfsm trace diff A.jsonl B.jsonl        first divergence between two ranks' traces
    paramfsm offload clean PATH                remove offload files whose run ended (killed, crashed)

Each command group is added by a ``register(subparsers)`` function, and every
leaf command stores its handler as ``func``; a handler takes the parsed
arguments and returns the exit status. Optional groups live in their own
modules and provide ``add_parser(subparsers)`` (``paramfsm.sharding.offload_command`` for ``paramfsm offload``,
``paramfsm.planning.command`` for ``paramfsm plan``,
``paramfsm.verify.command`` for
``paramfsm verify``); they are imported only when the command line names
them. ``paramfsm --help`` lists them from :data:`OPTIONAL_HELP` without
importing them, so neither ``--help`` nor ``spec`` nor ``trace`` imports torch
(``paramfsm.verify`` does).

Exit status: 0 on success, 1 when the input is wrong (an invalid spec, an
illegal or malformed trace, traces that differ), 2 for a usage error such as
a missing input file, 141 when stdout closes early (``paramfsm trace
summary T.jsonl | head``: the shell's status for a process ended by SIGPIPE,
with nothing on stderr). Results go to stdout; whatever makes the status
nonzero is one message on stderr, never a traceback. ``-v``/``--verbose``
goes before the command.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.machinery
import importlib.util
import logging
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

from paramfsm.errors import SpecError

log = logging.getLogger(__name__)

PROG = "paramfsm"
#: Modules that add a command group with ``add_parser(subparsers)`` when they exist.
OPTIONAL_COMMANDS = {"verify": "paramfsm.verify.command", "offload": "paramfsm.sharding.offload_command",
                     "plan": "paramfsm.planning.command"}
#: The one-line help ``paramfsm --help`` shows for an optional group it has not imported.
OPTIONAL_HELP = {"verify": "check generated training loops on local ranks against plain torch",
                 "offload": "remove the offload files runs that ended left behind",
                 "plan": "the peak memory per rank of each phase of a training step, before launch"}
#: Exit status when stdout is closed before the output is written (128 + SIGPIPE, as the shell reports it).
CLOSED_PIPE = 141


class CommandError(Exception):
    """A handler's way to fail with a message and an exit status (1: bad input, 2: usage)."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


# ------------------------------------------------------------------------ spec


def register_spec(subparsers) -> None:
    """Add ``spec check`` and ``spec draw``."""
    group = subparsers.add_parser("spec", help="validate or draw a lifetime spec")
    commands = group.add_subparsers(dest="spec_command", required=True, metavar="COMMAND")

    check = commands.add_parser("check", help="validate a spec and summarize it")
    check.add_argument("file", nargs="?", type=_input_file, help="spec TOML (default: the shipped spec)")
    check.set_defaults(func=_spec_check)

    draw = commands.add_parser("draw", help="draw a spec as a mermaid state diagram")
    draw.add_argument("file", nargs="?", type=_input_file, help="spec TOML (default: the shipped spec)")
    draw.add_argument("-o", "--output", type=Path, help="write the diagram here instead of stdout")
    draw.add_argument("--machine", choices=("lifetime", "residency"), default="lifetime",
                      help="which machine of the spec to draw (default: lifetime)")
    draw.set_defaults(func=_spec_draw)


def _spec_check(args) -> int:
    """Validate the lifetime machine, and the residency machine when the file declares one."""
    _summarize(_load_spec(args.file))
    if _has_residency(args.file):
        _summarize(_load_spec(args.file, "residency"))
    return 0


def _summarize(spec) -> None:
    kinds = {kind: sum(r.kind == kind for r in spec.rules) for kind in ("transition", "ignore", "error")}
    print(
        f"OK: {spec.file} defines '{spec.name}' with {len(spec.states)} states "
        f"({', '.join(spec.states)}), {len(spec.events)} events ({', '.join(spec.events)}) and "
        f"{len(spec.rules)} rows ({kinds['transition']} transitions, {kinds['ignore']} ignored, "
        f"{kinds['error']} errors) after expanding multi-event rows. Every (state, event) pair is "
        f"covered by exactly one row for every extended state, no two guards overlap, holds never "
        f"go negative, and every state is reachable from {spec.initial}."
    )


def _spec_draw(args) -> int:
    from paramfsm.core.machine import draw_mermaid

    spec = _load_spec(args.file, args.machine)
    text = draw_mermaid(spec)
    if args.output is None:
        sys.stdout.write(text if text.endswith("\n") else text + "\n")
        return 0
    try:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text, encoding="utf-8")
    except OSError as exc:
        raise CommandError(f"cannot write {args.output}: {exc.strerror or exc}") from None
    print(f"wrote {args.output}")
    return 0


def _load_spec(path: Path | None, machine: str = "lifetime"):
    from paramfsm.core.spec import load_residency_spec, load_spec

    try:
        return load_residency_spec(path) if machine == "residency" else load_spec(path)
    except SpecError as exc:
        raise CommandError(f"invalid spec: {exc}") from None


def _has_residency(path: Path | None) -> bool:
    from paramfsm.core.spec import has_residency

    try:
        return has_residency(path)
    except SpecError as exc:
        raise CommandError(f"invalid spec: {exc}") from None


# ----------------------------------------------------------------------- trace


def register_trace(subparsers) -> None:
    """Add ``trace check``, ``trace summary``, ``trace export`` and ``trace diff``."""
    group = subparsers.add_parser("trace", help="check, summarize, export or compare JSONL traces")
    commands = group.add_subparsers(dest="trace_command", required=True, metavar="COMMAND")

    check = commands.add_parser("check", help="replay a trace through the spec; name the first illegal record")
    check.add_argument("file", type=_input_file, help="trace written by rt.trace.dump (JSON Lines)")
    check.add_argument("--spec", type=_input_file, help="spec TOML to replay against (default: the shipped spec)")
    check.add_argument("--allow-open", action="store_true",
                       help="accept a trace that ends with parameters gathered (a flight-recorder dump, a run cut short)")
    check.set_defaults(func=_trace_check)

    summary = commands.add_parser("summary", help="time per state, gathers, deferred windows and leaks")
    summary.add_argument("file", type=_input_file, help="trace (JSON Lines)")
    summary.add_argument("--spec", type=_input_file, help="spec TOML the trace was made under (default: shipped)")
    summary.set_defaults(func=_trace_summary)

    export = commands.add_parser("export", help="convert a trace for ui.perfetto.dev")
    export.add_argument("file", type=_input_file, help="trace (JSON Lines)")
    export.add_argument("--spec", type=_input_file, help="spec TOML the trace was made under (default: shipped)")
    export.add_argument("--perfetto", required=True, type=Path, metavar="OUT",
                        help="write Chrome trace-event JSON here")
    export.set_defaults(func=_trace_export)

    compare = commands.add_parser("diff", help="name the first divergence between two ranks' traces")
    compare.add_argument("a", type=_input_file, help="first trace (JSON Lines)")
    compare.add_argument("b", type=_input_file, help="second trace (JSON Lines)")
    compare.set_defaults(func=_trace_diff)


#: Exit status of ``trace summary`` / ``trace export`` when the trace does not replay through the spec.
NOT_REPLAYING = 3


def _trace_check(args) -> int:
    from paramfsm.core.replay import final_states

    records = _load_records(args.file)
    table, error = _replay(records, args.spec)
    if error is not None:
        raise CommandError(f"{args.file}: illegal {error}")
    gathered = [r for r in final_states(records).values() if r.dst != table.spec.initial]
    if gathered and not args.allow_open:
        first = gathered[0]
        raise CommandError(
            f"{args.file}: the trace replays, but {len(gathered)} parameter(s) end gathered (first: rank "
            f"{first.rank} '{first.param}' ends {first.dst} at step {first.step}); a whole run ends with every "
            "parameter NOT_AVAILABLE. For a flight-recorder dump or a run cut short, pass --allow-open")
    open_note = f", {len(gathered)} parameter(s) end gathered (--allow-open)" if gathered else ""
    print(f"{len(records)} records replay cleanly through {table.spec.file}{open_note}")
    return 0


def _replay(records, spec_path):
    """``(table, first illegal record or None)`` for a trace against a spec (the shipped one by default)."""
    from paramfsm.core.fsm import compile_table
    from paramfsm.core.replay import replay

    table = compile_table(_load_spec(spec_path))
    return table, replay(records, table)


def _warn_unless_replaying(args, records) -> int:
    """Exit status for summary/export: 0, or NOT_REPLAYING with a warning naming the first bad record."""
    _, error = _replay(records, args.spec)
    if error is None:
        return 0
    print(f"{PROG}: warning: {args.file} does not replay through the spec, so the figures may be wrong: "
          f"{error} (paramfsm trace check names the problem)", file=sys.stderr)
    return NOT_REPLAYING


def _trace_summary(args) -> int:
    from paramfsm.core.trace_report import summarize

    records = _load_records(args.file)
    print(summarize(records).format())
    return _warn_unless_replaying(args, records)


def _trace_export(args) -> int:
    from paramfsm.core.perfetto import write_perfetto

    records = _load_records(args.file)
    try:
        write_perfetto(records, args.perfetto)
    except OSError as exc:
        raise CommandError(f"cannot write {args.perfetto}: {exc.strerror or exc}") from None
    print(f"wrote {args.perfetto} ({len(records)} records); open it in ui.perfetto.dev")
    return _warn_unless_replaying(args, records)


def _trace_diff(args) -> int:
    from paramfsm.core.trace_report import diff

    a, b = _load_trace(args.a), _load_trace(args.b)
    divergence = diff(a, b)
    if divergence is None:
        print(f"the traces agree ({len(a)} records)")
        return 0
    raise CommandError(f"{args.a} and {args.b} diverge: {divergence}")


def _load_records(path: Path):
    """The records of a trace that ``check``, ``summary`` and ``export`` read: an empty one is bad input (exit 1)."""
    records = _load_trace(path)
    if not records:
        raise CommandError(f"{path}: the trace has no records, so it shows nothing (was it made with "
                           "trace=0, or dumped before the first forward?)")
    return records


def _load_trace(path: Path):
    from paramfsm.core.trace import Trace

    try:
        return Trace.load(path).records
    except ValueError as exc:  # malformed JSON, a record lacking fields, not UTF-8
        raise CommandError(f"malformed trace: {exc}") from None
    except OSError as exc:
        raise CommandError(f"cannot read {path}: {exc.strerror or exc}") from None


# ------------------------------------------------------------------ the parser


def _input_file(text: str) -> Path:
    """argparse type for an input file: a missing file is a usage error (exit 2)."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"no such file: {text}" if not path.exists() else f"not a file: {text}")
    return path


BUILTIN_COMMANDS: dict[str, Callable] = {"spec": register_spec, "trace": register_trace}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full parser. ``command`` is the first word of the command line, if known.

    An optional command group is imported only when ``command`` names it. For
    any other first word (none, ``--help``, a typo) each optional group that
    is installed is listed with its :data:`OPTIONAL_HELP` line, found without
    importing it: ``paramfsm verify``'s module imports torch, which takes
    seconds, and ``--help`` must not wait for that.
    """
    parser = argparse.ArgumentParser(
        prog=PROG, parents=[_common_parser()],
        description="Check and draw lifetime specs; check, summarize, export and compare traces.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for register in BUILTIN_COMMANDS.values():
        register(subparsers)
    if command in OPTIONAL_COMMANDS:
        _add_optional(subparsers, OPTIONAL_COMMANDS[command])
    elif command not in BUILTIN_COMMANDS:
        for name, module_name in OPTIONAL_COMMANDS.items():
            if _module_exists(module_name):
                subparsers.add_parser(name, help=OPTIONAL_HELP.get(name, f"see {PROG} {name} --help"))
    return parser


def _module_exists(module_name: str) -> bool:
    """Whether ``module_name`` can be imported, found without running any package's ``__init__``.

    ``importlib.util.find_spec("a.b.c")`` imports ``a.b`` to look inside it;
    this walks the search path one level at a time instead.
    """
    head, *rest = module_name.split(".")
    spec = importlib.util.find_spec(head)
    for depth in range(len(rest)):
        if spec is None or spec.submodule_search_locations is None:
            return False
        name = ".".join([head, *rest[:depth + 1]])
        spec = importlib.machinery.PathFinder.find_spec(name, list(spec.submodule_search_locations))
    return spec is not None


def _add_optional(subparsers, module_name: str) -> None:
    if not _module_exists(module_name):
        return
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        log.warning("%s is not available: %s", module_name, exc)
        return
    module.add_parser(subparsers)


def _common_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-v", "--verbose", action="count", default=0,
                        help="log more (-v: info, -vv: debug); quiet by default")
    return common


def _configure_logging(verbose: int) -> None:
    level = logging.WARNING if verbose <= 0 else logging.INFO if verbose == 1 else logging.DEBUG
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status (argparse usage errors return 2)."""
    try:
        status = _run(list(sys.argv[1:] if argv is None else argv))
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's flush at exit
        return status
    except BrokenPipeError:
        _silence_stdout()
        return CLOSED_PIPE


def _run(argv: list[str]) -> int:
    known, rest = _common_parser().parse_known_args(argv)
    _configure_logging(known.verbose)
    command = next((word for word in rest if not word.startswith("-")), None)
    parser = build_parser(command)
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error argparse already reported
        return exc.code if isinstance(exc.code, int) else 2
    log.debug("running %s with %s", command, vars(args))
    try:
        return args.func(args)
    except CommandError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return exc.status


def _silence_stdout() -> None:
    """Point stdout's descriptor at /dev/null, so the interpreter's last flush of what is still buffered does
    not raise a second BrokenPipeError at exit (the recipe of Python's ``signal`` documentation)."""
    try:
        descriptor = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # not a real file (captured output): nothing flushes at exit
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, descriptor)
    os.close(devnull)
