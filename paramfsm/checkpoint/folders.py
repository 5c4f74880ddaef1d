"""Checkpoint folders on disk: staging beside the target, the atomic swap, completeness, ``latest`` and pruning.

Nothing here touches a process group: :mod:`paramfsm.checkpoint.saving`
decides which rank runs each step (rank 0 alone renames and removes) and
agrees the outcome among the ranks.

[Note: an atomic save]
A save never writes into ``path``. Every rank writes into a staging folder
beside it, ``.<name>.staging-<token>`` in the same parent (so a rename
between them never crosses file systems). Once every rank's data files and
DCP's ``.metadata`` are written, rank 0 adds the :data:`MANIFEST`, checks the
staging folder is complete (:func:`problem`), and swaps it with ``path`` in
one ``renameat2(RENAME_EXCHANGE)`` call. A crash before the swap leaves
``path`` as it was; after it, ``path`` is the new checkpoint; the swap itself
is atomic. Where the exchange is not available (another OS, a file system
without it) the swap is two renames: ``path`` to ``.<name>.retired-<token>``,
then the staging folder to ``path``. A crash between them leaves no ``path``
but a complete retired folder, which :func:`readable` loads and the next
save puts back. Leftovers (staging, retired and removed folders, all hidden
names) are never loaded and the next save of the same name cleans them.
"""

from __future__ import annotations

import ctypes
import errno
import json
import logging
import os
import shutil
import sys
import time
import uuid
from pathlib import Path

from paramfsm.errors import ArgumentError, ArgumentTypeError, ParamFSMError

logger = logging.getLogger(__name__)

#: File rank 0 writes last into a staging folder: the model shapes of the saved keys and when it was saved.
MANIFEST = "paramfsm.json"
METADATA = ".metadata"
FORMAT = "paramfsm-checkpoint"

#: Called with each named point a save passes (``fault_hook(point)``), on the rank that passes it; tests
#: set it to kill or fail a rank there. The points, in order: ``prepared`` (every rank, staging folder
#: made), ``writing`` (every rank, before DCP reads the state: on the background thread of an
#: asynchronous save), ``data_written`` (every rank, its files written), ``metadata`` (rank 0, before DCP's
#: ``.metadata``), ``written`` (every rank, the DCP save returned), ``manifest_written`` (rank 0),
#: ``retired`` (rank 0, two-rename swap only: ``path`` moved aside), ``committed`` (rank 0, ``path`` is
#: the new checkpoint, the old one not yet removed), ``pruning`` (rank 0, ``keep_last`` mid-removal).
fault_hook = None

#: Use ``renameat2(RENAME_EXCHANGE)`` when the system has it (False forces the two-rename swap).
use_exchange = sys.platform.startswith("linux")


def reach(point: str) -> None:
    """A named point of a save (see :data:`fault_hook`)."""
    if fault_hook is not None:
        fault_hook(point)


def _sibling(path: Path, kind: str, token: str) -> Path:
    return path.parent / f".{path.name}.{kind}-{token}"


def staging(path: Path, token: str) -> Path:
    return _sibling(path, "staging", token)


def new_token() -> str:
    return f"{time.time_ns():x}-{uuid.uuid4().hex[:8]}"


def _leftovers(path: Path, kind: str) -> list[Path]:
    prefix = f".{path.name}.{kind}-"
    try:
        return sorted(p for p in path.parent.iterdir() if p.name.startswith(prefix))
    except (FileNotFoundError, NotADirectoryError):
        return []


def problem(path: Path) -> str | None:
    """Why ``path`` is not a complete DCP checkpoint, or None when it is.

    Complete: ``.metadata`` reads, and every data file it lists exists and
    holds the bytes the metadata places in it.
    """
    if not path.exists():
        return f"'{path}' does not exist"
    if not path.is_dir():
        return f"'{path}' is not a folder"
    meta_file = path / METADATA
    if not meta_file.is_file():
        found = sorted(p.name for p in path.iterdir())[:5]
        return (f"'{path}' has no {METADATA} (DCP writes it last, so the save that made this folder did not "
                f"finish, or it is not a checkpoint; it holds {found or 'nothing'})")
    try:
        metadata = read_metadata(path)
    except Exception as exc:  # noqa: BLE001 - any unreadable metadata is reported the same way
        return f"'{meta_file}' cannot be read ({type(exc).__name__}: {exc})"
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        file = path / name
        if not file.is_file():
            return f"data file '{file}' is missing ({METADATA} lists it)"
        have = file.stat().st_size
        if have < size:
            return f"data file '{file}' is truncated: {have} bytes, {METADATA} needs {size}"
    return None


def read_metadata(path: Path):
    """DCP's metadata of the checkpoint folder ``path``."""
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(str(path)).read_metadata()


def read_manifest(path: Path) -> dict | None:
    """The :data:`MANIFEST` of a checkpoint saved by :func:`paramfsm.checkpoint.save`, or None (an older
    paramfsm checkpoint, or one saved by DCP directly)."""
    try:
        data = json.loads((path / MANIFEST).read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) and data.get("format") == FORMAT else None


def check_extra_files(files) -> dict[str, bytes]:
    """``save(extra_files=...)`` checked before anything is written: plain file names and bytes, none of
    them a name DCP or paramfsm writes."""
    if files is None:
        return {}
    if not isinstance(files, dict):
        raise ArgumentTypeError(f"paramfsm.checkpoint.save(extra_files={type(files).__name__}): expected a dict "
                                "of file name -> bytes")
    for name, data in files.items():
        reserved = name in (MANIFEST, METADATA) or (isinstance(name, str) and name.endswith(".distcp"))
        if not isinstance(name, str) or not name or "/" in name or name.startswith(".") or reserved:
            raise ArgumentError(f"paramfsm.checkpoint.save(extra_files=...): {name!r} is not a file name the "
                                f"checkpoint can hold (a plain name, not hidden, not {MANIFEST}, {METADATA} or "
                                "a DCP data file)")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ArgumentTypeError(f"paramfsm.checkpoint.save(extra_files=...): the value of {name!r} is a "
                                    f"{type(data).__name__}; expected bytes")
    return dict(files)


def write_extra_files(folder: Path, files: dict[str, bytes]) -> None:
    """Rank 0 writes ``save(extra_files=...)`` into the staging folder, before the manifest."""
    for name, data in files.items():
        target = folder / name
        with open(target, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())


def write_manifest(folder: Path, shapes: dict[str, list[int]], world: int, optimizer: bool) -> None:
    data = {"format": FORMAT, "version": 1, "saved_ns": time.time_ns(), "world": world,
            "optimizer": optimizer, "layout": "model", "shapes": shapes}
    file = folder / MANIFEST
    with open(file, "w") as out:
        json.dump(data, out)
        out.flush()
        os.fsync(out.fileno())


def _replaceable(path: Path) -> bool:
    """A save may replace ``path``: a folder holding a checkpoint, or only DCP's files (an unfinished save
    written in place, as saves did before staging), or nothing."""
    if not path.is_dir():
        return False
    if (path / METADATA).exists():
        return True
    return all(p.name.endswith(".distcp") or p.name.startswith((METADATA, "__")) or p.name == MANIFEST
               for p in path.iterdir())


def prepare(path: Path, token: str) -> None:
    """Rank 0, before a save: refuse a ``path`` that is not a checkpoint, clean leftovers, make the staging folder.

    Raises ParamFSMError naming the path when ``path`` holds something other
    than a checkpoint (it is never replaced) or the staging folder cannot be made.
    """
    if path.exists() and not _replaceable(path):
        raise ParamFSMError(f"paramfsm.checkpoint.save: '{path}' exists and is not a checkpoint (no {METADATA}); "
                            "it is never replaced. What to do: save to a new or empty folder, or remove it")
    recover(path)
    for kind in ("staging", "removed"):
        for old in _leftovers(path, kind):
            logger.info("removing %s, left by a save that did not finish", old)
            shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        for old in _leftovers(path, "retired"):
            shutil.rmtree(old, ignore_errors=True)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        staging(path, token).mkdir()
    except OSError as exc:
        raise ParamFSMError(f"paramfsm.checkpoint.save: cannot create a folder beside '{path}' "
                            f"({exc.strerror or exc}); nothing was written. What to do: check that "
                            f"'{path.parent}' is a writable folder with free space") from exc


def recover(path: Path) -> Path | None:
    """Rank 0: put back the checkpoint a two-rename swap moved aside when a crash left no ``path``."""
    retired = None if path.exists() else _moved_aside(path)
    if retired is None:
        return None
    os.rename(retired, path)
    logger.warning("restored %s from %s (a save over it was interrupted)", path, retired)
    return path


def _moved_aside(path: Path) -> Path | None:
    """The newest complete checkpoint a two-rename swap over ``path`` moved aside, or None."""
    for retired in reversed(_leftovers(path, "retired")):
        if problem(retired) is None:
            return retired
    return None


def readable(path: Path) -> Path:
    """The folder to load for ``path``: itself, or the checkpoint an interrupted swap moved aside.

    Raises ParamFSMError naming what is missing when neither is complete.
    """
    why = problem(path)
    if why is None:
        return path
    retired = None if path.exists() else _moved_aside(path)
    if retired is not None:
        logger.warning("loading %s: a save over %s was interrupted before it finished", retired, path)
        return retired
    unfinished = _leftovers(path, "staging")
    hint = (f"; {unfinished[-1].name} beside it is a save that did not finish (never loaded)"
            if unfinished else "")
    raise ParamFSMError(f"paramfsm.checkpoint.load: {why}{hint}. Nothing was loaded. What to do: load a "
                        "complete checkpoint (paramfsm.checkpoint.latest(parent) finds the newest one)")


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: Path, b: Path) -> bool:
    """Swap two folders atomically; False where the system cannot."""
    if not use_exchange:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _sync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def commit(path: Path, token: str) -> None:
    """Rank 0: make the complete staging folder ``path`` (see [Note: an atomic save])."""
    new = staging(path, token)
    why = problem(new)
    if why is not None:
        raise ParamFSMError(f"paramfsm.checkpoint.save to '{path}': the written checkpoint is incomplete "
                            f"({why}); '{path}' was not replaced")
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        os.replace(new, path)
        reach("committed")
    elif _exchange(new, path):
        reach("committed")
        shutil.rmtree(new)  # holds the previous checkpoint now
    else:
        retired = _sibling(path, "retired", token)
        os.rename(path, retired)
        reach("retired")
        os.rename(new, path)
        reach("committed")
        shutil.rmtree(retired)
    _sync_folder(path.parent)


def _saved_ns(folder: Path) -> int:
    manifest = read_manifest(folder)
    if manifest is not None and isinstance(manifest.get("saved_ns"), int):
        return manifest["saved_ns"]
    return (folder / METADATA).stat().st_mtime_ns


def complete_checkpoints(parent: Path) -> list[Path]:
    """The complete checkpoints directly in ``parent``, oldest first, each by the path ``load`` takes."""
    return [name for name, _ in _complete(Path(parent))]


def _complete(parent: Path) -> list[tuple[Path, Path]]:
    """``(name, folder)`` of each complete checkpoint in ``parent``, oldest first.

    [Note: a checkpoint moved aside is still a checkpoint]
    ``name`` is the path ``load`` takes; ``folder`` holds the files. They differ
    for a checkpoint a two-rename swap moved aside (``.<name>.retired-<token>``)
    when a crash between the renames left no ``<name>``: :func:`readable` loads
    it under ``<name>``, so ``latest`` must list it under that name too, or a
    resume would start over from step 0 while the checkpoint sits beside it.
    Every other hidden leftover (staging, removed) is never listed.
    """
    try:
        children = list(parent.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = {p: p for p in children if not p.name.startswith(".") and p.is_dir() and problem(p) is None}
    for p in children:
        head, retired, _ = p.name.partition(".retired-")
        name = parent / head[1:]
        if retired and head.startswith(".") and name not in found and not name.exists():
            folder = _moved_aside(name)
            if folder is not None:
                found[name] = folder
    return sorted(found.items(), key=lambda item: (_saved_ns(item[1]), item[0].name))


def latest(parent) -> Path | None:
    """The newest complete checkpoint in the folder ``parent``, or None when it holds none.

    Newest by the time its save completed (recorded in its manifest; the
    ``.metadata`` file's time for a checkpoint without one). Staging folders
    of unfinished saves and incomplete folders are skipped.
    """
    found = complete_checkpoints(Path(parent))
    return found[-1] if found else None


def prune(parent: Path, keep_last: int, token: str) -> list[Path]:
    """Rank 0: remove all but the newest ``keep_last`` checkpoints in ``parent`` that paramfsm saved.

    Each goes by a rename to a hidden name first, so a crash never leaves a
    half-removed folder that looks like a checkpoint. The hidden leftovers of
    each removed name (a staging folder or a moved-aside checkpoint a killed
    save left) go with it: no later save of that name would clean them.
    Returns what was removed.
    """
    ours = [(name, folder) for name, folder in _complete(parent) if read_manifest(folder) is not None]
    gone = ours[: max(len(ours) - keep_last, 0)]
    for name, folder in gone:
        hidden = _sibling(name, "removed", token)
        os.rename(folder, hidden)
        reach("pruning")
        for leftover in (hidden, *_leftovers(name, "retired"), *_leftovers(name, "staging")):
            shutil.rmtree(leftover, ignore_errors=True)
    return [name for name, _ in gone]
