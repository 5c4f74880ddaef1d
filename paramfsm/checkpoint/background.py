"""Asynchronous saves: the staged copy, the handle, and the process group the writes run on.

[Note: what an asynchronous save runs where]
``save(..., async_save=True)`` does on the calling thread everything that
must happen before the next optimizer step: it waits for the runtime's
previous save, agrees the staging folder among the ranks, and copies this
rank's shards (and optimizer state) into a staging copy (:func:`stage`). Then
a thread writes the copy and commits the folder, exactly as a synchronous
save does. Its collectives (DCP's plan exchange, the agreement of the
outcome) run on a gloo group of the same ranks made for background saves
(:func:`background_group`), so they never interleave with the training
loop's collectives on the runtime's group. The copy is released when the
thread ends.

One save at a time per runtime: a second ``save`` (or a ``load``) first waits
for the first. A failed background save raises from ``handle.wait()``, and,
if ``wait()`` was not called, from the next ``save`` or ``load`` of that
runtime; it is also logged when it happens.
"""

from __future__ import annotations

import copy
import logging
import threading
import weakref

import torch
import torch.distributed as dist

from paramfsm.checkpoint import layout
from paramfsm.errors import ParamFSMError

logger = logging.getLogger(__name__)

_pending: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # runtime -> its save in progress
_groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # runtime -> gloo group for background saves


class SaveHandle:
    """A save in progress, returned by ``paramfsm.checkpoint.save(..., async_save=True)``.

    ``done()`` says whether the write has ended (successfully or not);
    ``wait()`` blocks until it has, and raises :class:`ParamFSMError` naming
    the path if it failed. ``staged_bytes`` is the size of the staging copy
    this rank holds until the write ends.
    """

    __slots__ = ("path", "staged_bytes", "_thread", "_error", "_reported", "__weakref__")

    def __init__(self, path, staged_bytes: int, write):
        self.path = path
        self.staged_bytes = staged_bytes
        self._error: BaseException | None = None
        self._reported = False
        self._thread = threading.Thread(target=self._run, args=(write,), name=f"paramfsm-save {path}")

    def _run(self, write) -> None:
        try:
            write()
        except BaseException as exc:  # noqa: BLE001 - kept for wait(); a background thread has no caller
            self._error = exc
            logger.error("asynchronous paramfsm.checkpoint.save to %s failed: %s", self.path, exc)

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> None:
        """Block until the save has ended; raise its failure (every time it is asked)."""
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise ParamFSMError(f"the asynchronous save to '{self.path}' is still writing after {timeout} s")
        if self._error is not None:
            self._reported = True
            if isinstance(self._error, ParamFSMError):
                raise ParamFSMError(str(self._error)) from self._error.__cause__
            raise ParamFSMError(f"the asynchronous save to '{self.path}' failed: "
                                f"{type(self._error).__name__}: {self._error}") from self._error

    def __repr__(self) -> str:
        state = "writing" if not self.done() else ("failed" if self._error is not None else "done")
        return f"<SaveHandle {self.path} {state}>"


def start(rt, handle: SaveHandle) -> None:
    _pending[rt] = handle
    handle._thread.start()


def pending(rt) -> SaveHandle | None:
    """The runtime's latest asynchronous save (until the next save, load or close waits for it), or None."""
    return _pending.get(rt)


def staging_bytes(rt) -> int:
    """The bytes of the staged copy the runtime's asynchronous save holds while it writes (0 once it ended)."""
    handle = _pending.get(rt)
    return 0 if handle is None or handle.done() else handle.staged_bytes


def settle(rt, what: str) -> None:
    """Before a save or load: wait for the runtime's save in progress; raise its failure if nobody saw it."""
    handle = _pending.pop(rt, None)
    if handle is None:
        return
    seen = handle._reported  # wait() raised it to the caller already
    try:
        handle.wait()
    except ParamFSMError as exc:
        if not seen:
            raise ParamFSMError(f"{exc}. This {what} did not start; call it again to retry") from exc


def _host_copy(tensor: torch.Tensor, on_device: list) -> torch.Tensor:
    """A copy of ``tensor`` in host memory: a clone on the CPU, a pinned buffer filled asynchronously from an
    accelerator (``on_device`` collects the devices to wait for)."""
    tensor = tensor.detach()
    if tensor.device.type == "cpu":
        return tensor.clone()
    copy_ = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
    copy_.copy_(tensor, non_blocking=True)
    on_device.append(tensor.device)
    return copy_


def stage(state: dict) -> tuple[dict, int]:
    """A copy of a state dict that later writes to the shards cannot change, and its size in bytes.

    Model-shaped pieces keep their boxes over a copied shard range (a tied
    parameter's two keys share one copy); other tensors are copied; other
    values deep-copied.

    [Note: the staged copy lives in host memory]
    GPU shards are copied into pinned host buffers with ``non_blocking``
    copies on the current stream, then that stream is synchronised once: the
    background thread reads the buffers only after every copy has landed, and
    an optimizer step queued later on the same stream runs after the copies,
    so it cannot change what is written. The copy costs host memory (one copy
    of this rank's shards and optimizer state, ``SaveHandle.staged_bytes``),
    never accelerator memory, and is freed when the write ends.
    """
    copies: dict[tuple[int, int], torch.Tensor] = {}
    on_device: list = []
    out, nbytes = {}, 0
    for key, value in state.items():
        if isinstance(value, layout.ShardPieces):
            ident = (value.flat.data_ptr(), value.flat.numel())
            copied = copies.get(ident)
            if copied is None:
                copied = copies[ident] = _host_copy(value.flat, on_device)
                nbytes += copied.numel() * copied.element_size()
            out[key] = value.with_flat(copied)
        elif isinstance(value, torch.Tensor):
            out[key] = _host_copy(value, on_device)
            nbytes += value.numel() * value.element_size()
        else:
            out[key] = copy.deepcopy(value)
    for device in set(on_device):
        torch.cuda.current_stream(device).synchronize()
    return out, nbytes


def background_group(rt, group):
    """The runtime's gloo group for background saves, over the ranks of ``group``; made at its first
    asynchronous save (collective over those ranks)."""
    made = _groups.get(rt)
    if made is None:
        ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
        made = _groups[rt] = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
    return made


def release_group(rt) -> None:
    """Destroy the runtime's background-save group (``rt.close()`` / ``rt.detach()``), unless a save still
    writes on it: a group left registered keeps its gloo threads and sockets for the life of the process."""
    handle = _pending.get(rt)
    if handle is not None and not handle.done():
        return
    made = _groups.pop(rt, None)
    if made is not None and made in dist.distributed_c10d._world.pg_map:
        dist.destroy_process_group(made)
