"""Offload files and their owners: each file is locked for its life, and a file nobody holds is removed.

[Note: an offload file's owner]
A disk tier's file (:class:`~paramfsm.engine.storage.tiers.DiskTier`) is
scratch space for one rank of one run. ``close()`` removes it, but a run that
is killed, or crashes past its cleanup, leaves it behind at its full reserved
size. Its owner holds an exclusive ``flock`` on it from creation to removal;
the kernel drops the lock when the owning process ends however it ends, on
this host or (through NFS's lock manager) another. So a file whose lock can
be taken has no owner, and removing it loses nothing: it is never read by
another run (its name is unique to its run, see [Note: one file per rank and
run]). Each new disk tier removes the ownerless files of its folder when it
opens its own, and ``paramfsm offload clean PATH`` does the same on demand.

A file is created under a hidden temporary name, locked, and only then
renamed to its final name, so a cleaner never finds a final name unlocked
while its owner lives. Between its creation and its lock a temporary is
unlocked, so a cleaner takes only temporaries older than
:data:`TEMPORARY_AGE_S` (a crash left them; they are empty): one younger
may be another rank's, a moment from its lock.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import time
from pathlib import Path

PREFIX = "paramfsm-offload-"
SUFFIX = ".bin"
#: A temporary (created, not yet locked and renamed) younger than this may belong to a live owner.
TEMPORARY_AGE_S = 60.0


def create(folder: Path, rank: int) -> tuple[Path, int]:
    """Create and lock this rank's new offload file in ``folder``; return its path and open descriptor.

    Raises OSError when the folder cannot hold it (the caller names the setting to change).
    """
    name = f"{PREFIX}rank{rank}-pid{os.getpid()}-{secrets.token_hex(4)}{SUFFIX}"
    temporary = folder / f".{name}.new"
    fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(temporary, folder / name)
    except OSError:
        os.close(fd)
        temporary.unlink(missing_ok=True)
        raise
    return folder / name, fd


def remove_ownerless(folder: Path) -> list[tuple[Path, int]]:
    """Remove the offload files in ``folder`` whose owner is gone; return each one's path and size in bytes.

    A file another live process holds is left alone, as is anything that is not an offload file.
    """
    try:
        now = time.time()
        temporaries = [p for p in folder.glob(f".{PREFIX}*{SUFFIX}.new") if now - p.stat().st_mtime > TEMPORARY_AGE_S]
        candidates = sorted([*folder.glob(f"{PREFIX}*{SUFFIX}"), *temporaries])
    except OSError:  # the folder, or a temporary, went meanwhile: the next tier tries again
        return []
    removed = []
    for path in candidates:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:  # removed meanwhile, or not ours to read
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            size = os.fstat(fd).st_blocks * 512  # what the disk holds: a reserved file is as big as its slots
            path.unlink()
        except OSError:  # held by its owner, or removed by another cleaner first
            continue
        finally:
            os.close(fd)
        removed.append((path, size))
    return removed
