"""``paramfsm offload clean PATH``: remove the offload files of runs that ended (killed, crashed).

A disk tier's file is locked for its owner's life ([Note: an offload file's owner] in
:mod:`paramfsm.engine.storage.tier_files`), so a file whose lock can be taken has no owner and is removed;
a live run's files are kept. The next run that opens a disk tier in the folder does the same by itself; this
command frees the space now. Added to the ``paramfsm`` command line by :mod:`paramfsm.cli` when named.
"""

from __future__ import annotations

from pathlib import Path

from paramfsm.engine.storage import tier_files

HELP = "remove the offload files runs that ended left behind"


def add_parser(subparsers) -> None:
    """Add ``paramfsm offload clean`` to the command line."""
    group = subparsers.add_parser("offload", help=HELP)
    commands = group.add_subparsers(dest="offload_command", required=True, metavar="COMMAND")
    clean = commands.add_parser(
        "clean", help="remove the offload files in PATH whose run has ended (a live run's are kept)")
    clean.add_argument("paths", nargs="+", type=Path, metavar="PATH", help="a paramfsm.Offload(path=...) folder")
    clean.set_defaults(func=_clean)


def _clean(args) -> int:
    from paramfsm.cli import CommandError

    missing = [str(path) for path in args.paths if not path.is_dir()]
    if missing:
        raise CommandError(f"not a folder: {', '.join(missing)}", status=2)
    total = 0
    for path in args.paths:
        for file, size in tier_files.remove_ownerless(path):
            print(f"removed {file} ({size} bytes)")
            total += size
    print(f"{total} bytes freed")
    return 0
