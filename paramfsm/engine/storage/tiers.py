"""Where an offloaded value's tier copy lives: host memory or a file on disk.

A tier stores fixed-size slots, one per offloaded tensor (a parameter's shard,
one optimizer state tensor of it), and copies whole slots in and out. It knows
nothing of lifetimes: the residency machine (``[residency]`` in the spec)
decides when a slot is written or read, and :mod:`paramfsm.engine.effects.paging`
runs those effects. Each slot remembers the version it was last written at, so
a read of a copy older than the working one is caught
(:class:`~paramfsm.errors.StaleOffloadCopy`), never returned.

[Note: one file per rank and run]
The disk tier writes one file per rank, created with ``O_EXCL`` under a name
made of the rank, the process id and a random token, so two runs on one
machine (or two runtimes in one process) never share a file, and a file left
by a crashed run is never read as ours; such a file is removed by the next
run that opens the folder ([Note: an offload file's owner] in
:mod:`paramfsm.engine.storage.tier_files`). Its space is reserved
(``posix_fallocate``) when a slot is first placed, so a full disk fails at
placement, before any value depends on the file, not halfway through a step.
``close()`` removes it. The file is scratch space, not a checkpoint: it holds
no layout anyone else can read.
"""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import torch

from paramfsm.engine.storage import tier_files
from paramfsm.errors import OffloadError

logger = logging.getLogger(__name__)

#: Slot offsets on disk are aligned to this many bytes (page size: direct, unsplit reads).
ALIGN = 4096


class Slot:
    """One tensor's place in a tier: its size, where it is, and the version last written to it."""

    __slots__ = ("nbytes", "offset", "host", "version")

    def __init__(self, nbytes: int, offset: int = 0, host: torch.Tensor | None = None):
        self.nbytes, self.offset, self.host = nbytes, offset, host
        self.version = -1  # never written


class HostTier:
    """Tier copies in host memory (pinned when CUDA is available and ``pin_memory``)."""

    where = "cpu"

    def __init__(self, rank: int, pin_memory: bool = True):
        self.rank = rank
        self.pin = pin_memory and torch.cuda.is_available()
        self.slots: dict = {}

    @property
    def nbytes(self) -> int:
        return sum(slot.nbytes for slot in self.slots.values())

    def place(self, key, tensor: torch.Tensor, owner: str) -> Slot:
        slot = self.slots.get(key)
        if slot is None:
            host = torch.empty(tensor.numel(), dtype=tensor.dtype, device="cpu", pin_memory=self.pin)
            slot = self.slots[key] = Slot(tensor.numel() * tensor.element_size(), host=host)
        return _same_size(slot, tensor, owner)

    def write(self, slot: Slot, tensor: torch.Tensor, version: int, owner: str, non_blocking: bool = False) -> None:
        """Copy ``tensor`` into ``slot``; ``non_blocking``: on a copy lane, which the host waits for before
        it reads the slot (see [Note: the copy lane] in paramfsm.engine.effects.paging)."""
        slot.host.copy_(tensor.reshape(-1), non_blocking=non_blocking and tensor.is_cuda and self.pin)
        slot.version = version

    def read(self, slot: Slot, out: torch.Tensor, owner: str) -> None:
        out.reshape(-1).copy_(slot.host, non_blocking=out.is_cuda and self.pin)

    def close(self) -> None:
        self.slots.clear()


class RehearsalTier(HostTier):
    """A tier that keeps sizes and versions only: a memory plan's rehearsal over meta tensors
    (:mod:`paramfsm.planning.rehearsal`) counts what ``where`` would hold and allocates nothing."""

    def __init__(self, where: str, rank: int):
        super().__init__(rank, pin_memory=False)
        self.where = where

    def place(self, key, tensor: torch.Tensor, owner: str) -> Slot:
        slot = self.slots.get(key)
        if slot is None:
            slot = self.slots[key] = Slot(tensor.numel() * tensor.element_size())
        return _same_size(slot, tensor, owner)

    def reserve(self, nbytes: int, owner: str) -> None:
        """Nothing to reserve: no disk is written."""

    def write(self, slot: Slot, tensor: torch.Tensor, version: int, owner: str, non_blocking: bool = False) -> None:
        slot.version = version

    def read(self, slot: Slot, out: torch.Tensor, owner: str) -> None:
        """A meta tensor has no values to read into."""


class DiskTier:
    """Tier copies in one file per rank under ``folder`` (see [Note: one file per rank and run])."""

    where = "disk"

    def __init__(self, folder, rank: int, first_owner: str = "<none>"):
        self.folder = Path(folder).expanduser()
        self.rank = rank
        self.slots: dict = {}
        self._end = 0
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.path, self.fd = tier_files.create(self.folder, rank)
        except OSError as exc:
            raise OffloadError(
                f"cannot create the offload file for '{first_owner}' (rank {rank}) in '{self.folder}': "
                f"{exc.strerror or exc}. What to do: pass paramfsm.Offload(path=...) a folder this process "
                "can write, on a disk with room for this rank's offloaded shards and optimizer state.") from None
        removed = tier_files.remove_ownerless(self.folder)
        if removed:
            logger.warning("rank %d removed %d offload file(s), %d bytes, that runs which ended without closing "
                           "left in %s", rank, len(removed), sum(size for _, size in removed), self.folder)

    @property
    def nbytes(self) -> int:
        return self._end

    def place(self, key, tensor: torch.Tensor, owner: str) -> Slot:
        slot = self.slots.get(key)
        if slot is not None:
            return _same_size(slot, tensor, owner)
        nbytes = tensor.numel() * tensor.element_size()
        offset = self._end
        reserve = -(-nbytes // ALIGN) * ALIGN
        try:
            if reserve:
                os.posix_fallocate(self.fd, offset, reserve)
        except OSError as exc:
            raise self._io_error(owner, "reserve", nbytes, exc) from None
        self._end = offset + reserve
        slot = self.slots[key] = Slot(nbytes, offset)
        return slot

    def reserve(self, nbytes: int, owner: str) -> None:
        """Allocate ``nbytes`` more past the last slot, for slots placed later (see [Note: a first step that
        cannot finish changes nothing] in :mod:`paramfsm.optim.step_space`); a full disk raises here."""
        try:
            if nbytes:
                os.posix_fallocate(self.fd, self._end, nbytes)
        except OSError as exc:
            raise self._io_error(owner, "reserve", nbytes, exc) from None

    def write(self, slot: Slot, tensor: torch.Tensor, version: int, owner: str) -> None:
        view = _bytes(tensor)
        try:
            done = os.pwrite(self.fd, view, slot.offset)
            while done < slot.nbytes:  # a short write: carry on from where it stopped
                step = os.pwrite(self.fd, view[done:], slot.offset + done)
                if step == 0:
                    raise OSError(errno.ENOSPC, "no space left on device")
                done += step
        except OSError as exc:
            raise self._io_error(owner, "write", slot.nbytes, exc) from None
        slot.version = version

    def read(self, slot: Slot, out: torch.Tensor, owner: str) -> None:
        view = _bytes(out)
        try:
            done = os.preadv(self.fd, [view], slot.offset)
            while done < slot.nbytes:
                step = os.preadv(self.fd, [view[done:]], slot.offset + done)
                if step == 0:
                    raise OSError(errno.EIO, "the offload file ended early")
                done += step
        except OSError as exc:
            raise self._io_error(owner, "read", slot.nbytes, exc) from None

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)
            self.path.unlink(missing_ok=True)
        self.slots.clear()

    def _io_error(self, owner: str, what: str, nbytes: int, exc: OSError) -> OffloadError:
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT)
        advice = ("free space there or choose a folder on a larger disk (paramfsm.Offload(path=...))" if full
                  else "check the folder and its disk (paramfsm.Offload(path=...) chooses another)")
        return OffloadError(
            f"could not {what} {nbytes} bytes of '{owner}' (rank {self.rank}) in the offload file "
            f"'{self.path}': {exc.strerror or exc}. "
            + ("Nothing was written to it. " if what == "reserve" else
               "The working copy is kept, so no value is lost or stale. ")
            + f"What to do: {advice}.")


def _same_size(slot: Slot, tensor: torch.Tensor, owner: str) -> Slot:
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes != slot.nbytes:
        raise OffloadError(
            f"'{owner}' now has {nbytes} bytes, but its offload slot holds {slot.nbytes}: an offloaded value "
            "cannot change its size. What to do: keep shapes and dtypes of offloaded parameters and optimizer "
            "state fixed, or shard the model again.")
    return slot


def _bytes(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's storage, without a copy."""
    return memoryview(tensor.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")
