"""Runs the residency machine's effects: page-ins on a background thread, write-backs, page-outs.

The schedule (:mod:`paramfsm.engine.schedule.residency`) steps each offloaded
value's residency and hands the effects here, with the placements they apply
to; this module never looks at a residency state.

* ``start_read``: a working buffer is allocated and the tier copy is read into
  it; for the disk tier on a background thread (the read releases the GIL, so
  the forward or the optimizer step keeps computing), for the host tier at once.
* ``finish_read``: waits for that read, refuses a tier copy older than the
  working value (:class:`~paramfsm.errors.StaleOffloadCopy`) and installs the
  buffer as the tensor's storage.
* ``write_tier``: copies the working value to its slot, recording its version.
* ``drop_resident``: frees the working storage; the tensor becomes a paged-out
  one (:mod:`paramfsm.engine.storage.paged`).

[Note: CUDA working copies]
A working copy on a CUDA device is read from the host tier with a
``non_blocking`` copy on the current stream (ordered before the gather or
step that reads it) and written back with a blocking copy; the disk tier
stages through host memory. With ``Offload(copy_stream=True)`` the host
tier's copies run on a copy lane of their own instead (below).

[Note: the copy lane]
With a lane (:mod:`paramfsm.engine.effects.streams`, lane ``PAGE``), both
directions of a host-tier copy are side work, ordered as the gathers are:
* ``start_read`` launches the copy into the working buffer; the lane first
  waits for compute, so the buffer (allocated on compute's stream) is not
  written before compute is done with what it reused. ``finish_read`` joins
  the ticket before the buffer is installed: compute waits for the copy
  before any use of the value. A page-in ahead of use thus overlaps the
  compute between ``start_read`` and ``finish_read``.
* ``write_tier`` launches the copy out. The lane's wait for compute orders it
  after the step that produced the value, and the ticket keeps an alias of the
  working storage, so ``drop_resident`` freeing the tensor's storage cannot
  hand that memory to compute while the copy still reads it. The slot's
  version is set when the copy is launched: a later read of the slot is on the
  same lane, after the write.
* A write's ticket is joined before the host reads the slot (``peek``), when
  more than ``MAX_WRITES_IN_FLIGHT`` are pending (bounding the working memory
  they keep), before the next read of the same value, and at ``close``.
The CPU suite drives this logic through ``RecordingStreams``, whose deferred
work makes a missing join read an empty buffer (``tests/test_copy_lane.py``).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from paramfsm.engine.effects.streams import PAGE
from paramfsm.engine.storage import paged
from paramfsm.errors import StaleOffloadCopy

#: Copies to the host tier pending on the copy lane at most, each keeping its working storage alive.
MAX_WRITES_IN_FLIGHT = 4


#: Devices whose tensors a tier reads and writes as they are: the host, and the meta device of a memory
#: plan's rehearsal (paramfsm.planning.rehearsal), whose tier (RehearsalTier) moves nothing.
_IN_PLACE = ("cpu", "meta")


class Pager:
    """The effects of one tier (see the module docstring); counts the bytes it moves."""

    def __init__(self, tier, rank: int, lane=None):
        self.tier, self.rank = tier, rank
        self._pool = (ThreadPoolExecutor(1, thread_name_prefix=f"paramfsm-page-in-{rank}")
                      if tier.where == "disk" else None)
        # The copy lane of a host tier (see [Note: the copy lane]); None: copies on the current stream.
        self.lane = lane if tier.where == "cpu" else None
        self._reads: dict = {}  # placement -> [(tensor, buffer, target, slot, future or ticket or None)]
        self._writes: dict = {}  # slot key -> the copy lane's ticket of its pending write, oldest first
        self.bytes_read = self.bytes_written = 0

    # ------------------------------------------------------------------ effects
    def start_read(self, placements) -> None:
        with _normal_tensors():
            self._start_read(placements)

    def _start_read(self, placements) -> None:
        for p in placements:
            reads = []
            for key, tensor in p.values():
                slot = self.tier.slots[key]
                buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device)
                target = buffer if buffer.device.type in _IN_PLACE else torch.empty(
                    tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
                if self.lane is not None:
                    self._settle(key)
                    future = self.lane.launch(PAGE, self.tier.read, slot, buffer, p.name)
                elif self.tier.where == "cpu":
                    self.tier.read(slot, buffer, p.name)
                    future = None
                else:
                    future = self._pool.submit(self.tier.read, slot, target, p.name)
                reads.append((tensor, buffer, target, slot, future))
                self.bytes_read += slot.nbytes
            self._reads[p] = reads

    def finish_read(self, placements) -> None:
        with _normal_tensors():
            self._finish_read(placements)

    def _finish_read(self, placements) -> None:
        for p in placements:
            for tensor, buffer, target, slot, future in self._reads.pop(p, ()):
                if self.lane is not None:
                    self.lane.join(future)
                elif future is not None:
                    future.result()
                self._check_version(p, slot)
                if target is not buffer:
                    buffer.copy_(target, non_blocking=True)
                paged.reveal(tensor, buffer)

    def write_tier(self, placements) -> None:
        for p in placements:
            for key, tensor in p.values():
                value = paged.working(tensor)
                if value.device.type not in _IN_PLACE and self.tier.where == "disk":
                    value = value.to("cpu")
                slot = self.tier.place(key, value, p.name)
                if self.lane is not None:
                    self._settle(key)
                    self._writes[key] = self.lane.launch(PAGE, self.tier.write, slot, value.contiguous(),
                                                         p.version, p.name, True)
                    while len(self._writes) > MAX_WRITES_IN_FLIGHT:
                        self._settle(next(iter(self._writes)))
                else:
                    self.tier.write(slot, value.contiguous(), p.version, p.name)
                self.bytes_written += slot.nbytes

    def _settle(self, key, *, host: bool = False) -> None:
        """Join the pending copy-lane write of ``key``'s slot, if any (``host``: the host reads it next)."""
        ticket = self._writes.pop(key, None)
        if ticket is not None:
            (self.lane.finish if host else self.lane.join)(ticket)

    def peek(self, p, key, tensor) -> torch.Tensor:
        """A copy of ``tensor``'s tier copy in host memory, read now (see ``Residency.peek``); no effect."""
        slot = self.tier.slots[key]
        if self.lane is not None:
            self._settle(key, host=True)
        self._check_version(p, slot)
        with _normal_tensors():
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
            self.tier.read(slot, buffer, p.name)
        return buffer.to(tensor.device)

    def _check_version(self, p, slot) -> None:
        """Refuse a tier copy older than the value it stands for."""
        if slot.version != p.version:
            raise StaleOffloadCopy(
                f"the {p.what} of parameter '{p.name}' (unit '{p.unit}', rank {self.rank}) was about to be read "
                f"from a tier copy of version {slot.version}, older than its working value (version {p.version}): "
                "a write-back was lost. Nothing was read. What to do: this is a bug in paramfsm's offload "
                "schedule; report it with the trace dump.")

    def drop_resident(self, placements) -> None:
        for p in placements:
            for _, tensor in p.values():
                paged.conceal(tensor)

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Wait for reads in flight, stop the thread and remove the tier's file."""
        for reads in self._reads.values():
            for *_, future in reads:
                if self.lane is not None:
                    self.lane.finish(future)
                elif future is not None:
                    future.result()
        self._reads.clear()
        for key in list(self._writes):
            self._settle(key, host=True)
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.tier.close()


def _normal_tensors():
    """Working buffers are normal tensors even when a page-in runs under ``torch.inference_mode()`` (an
    evaluation): an inference tensor could never be updated in place by the optimizer step after it."""
    return torch.inference_mode(False)
