"""The executor runs the effects that :func:`paramfsm.fsm.step` returns.

It owns buffers and collectives, never states: it is handed parameter records
and acts on their tensors (``param.data``, the shard, staged / pending
buffers). Effects of one scheduler decision are merged into one bucket:
one all-gather for every parameter that must be gathered together, one
reduce-scatter for every gradient bucket.

[Note: gather = issue, then wait, then install]
``start_gather`` packs the shards and issues an async all-gather (INFLIGHT).
``wait_gather`` waits for it and unpacks the whole bucket into freshly
allocated full tensors, staging them on the records. The ``unpack`` effect
(on the ``arrive`` transition) installs a staged tensor as ``param.data``.
Splitting wait from install lets one wait complete a bucket that spans
several units while each parameter still moves through the FSM on its own.

[Note: gradients leave the parameter at once]
``reduce_grad`` takes ``param.grad`` (accumulated by autograd for the current
graph task) into the pending reduce bucket and clears it, so the full gradient
never outlives the hook. Buckets are reduce-scattered asynchronously once they
pass ``bucket_bytes``; ``finish_reduces`` (end of backward) waits for all of
them and adds ``1/world`` of each summed shard into ``shard.grad``, so shard
gradients accumulate across backward passes until the user zeroes them.
"""

from __future__ import annotations

import logging

import torch

from paramfsm import kernels
from paramfsm.collectives import all_gather_flat, reduce_scatter_flat

log = logging.getLogger(__name__)


class Gather:
    """One coalesced all-gather in flight: the work handle, the receive buffer, its records."""

    __slots__ = ("work", "recv", "records", "layout")

    def __init__(self, work, recv, records, layout):
        self.work, self.recv, self.records, self.layout = work, recv, records, layout


class Counters:
    """Communication counts, for tests (communication is part of correctness) and benchmarks."""

    __slots__ = ("all_gathers", "gathered_bytes", "reduce_scatters", "reduced_bytes")

    def __init__(self):
        self.all_gathers = self.gathered_bytes = self.reduce_scatters = self.reduced_bytes = 0

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.__slots__}


class Executor:
    """Runs gather / free / reduce effects for one process group."""

    def __init__(self, group, rank: int, world: int, *, param_dtype=None, reduce_dtype=None,
                 bucket_bytes: int = 1 << 20):
        self.group, self.rank, self.world = group, rank, world
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.bucket_bytes = bucket_bytes
        self.counters = Counters()
        self._empty: dict[tuple, torch.Tensor] = {}
        self._grads: list = []  # (record, grad) waiting for the next reduce bucket
        self._grad_bytes = 0
        self._reduces: list = []  # (work, out, records, layout) in flight

    # ------------------------------------------------------------------ gather
    def start_gather(self, records) -> Gather:
        """Pack the shards of ``records`` and issue one async all-gather (the start_gather effect)."""
        dtype = self.param_dtype
        if self.world == 1:
            for rec in records:
                rec.staged = self._local_full(rec, dtype)
            gather = Gather(None, None, records, None)
        else:
            first = records[0].shard
            dtype = dtype or first.dtype
            layout = kernels.shard_layout(tuple(r.numel for r in records), self.world)
            send = torch.empty(layout.total, dtype=dtype, device=first.device)
            kernels.pack_shards([r.shard.detach() for r in records], send)
            recv = torch.empty(layout.total * self.world, dtype=dtype, device=first.device)
            work = all_gather_flat(recv, send, self.group, async_op=True)
            gather = Gather(work, recv, records, layout)
            self.counters.all_gathers += 1
            self.counters.gathered_bytes += recv.numel() * recv.element_size()
        for rec in records:
            rec.pending = gather
        return gather

    @staticmethod
    def _local_full(rec, dtype):
        """World 1: the shard is the whole parameter; gather it as a view (or a cast copy)."""
        if dtype is not None and dtype != rec.shard.dtype:
            return rec.shard.detach().to(dtype).view(rec.shape)
        view = rec.local_view
        if view is None:
            view = rec.local_view = rec.shard.detach().view(rec.shape)
        return view

    def wait_gather(self, gather: Gather) -> None:
        """Wait for a gather and stage every parameter's full tensor (idempotent)."""
        work = gather.work
        if work is None:
            return
        gather.work = None
        work.wait()
        outs = kernels.unpack_to_views(gather.recv, gather.layout, [r.shape for r in gather.records])
        gather.recv = None
        for rec, out in zip(gather.records, outs):
            rec.staged = out

    def install(self, rec) -> None:
        """The unpack effect: the staged full tensor becomes ``param.data``."""
        if rec.staged is None:
            self.wait_gather(rec.pending)
        rec.param.data = rec.staged
        rec.staged = None
        rec.pending = None

    def discard(self, rec) -> None:
        """The discard_gather effect: complete the collective (every rank joined it), drop the result."""
        if rec.pending is not None:
            self.wait_gather(rec.pending)
        rec.staged = None
        rec.pending = None

    def free(self, rec) -> None:
        """The free effect: ``param.data`` becomes an empty tensor; only the shard stays live."""
        data = rec.param.data
        key = (data.dtype, data.device)
        empty = self._empty.get(key)
        if empty is None:
            empty = self._empty[key] = torch.empty(0, dtype=data.dtype, device=data.device)
        rec.param.data = empty

    # ------------------------------------------------------------------ reduce
    def take_grad(self, rec) -> None:
        """The reduce_grad effect: move ``param.grad`` into the pending reduce bucket."""
        grad = rec.param.grad
        if grad is None:
            return
        rec.param.grad = None
        if grad.requires_grad:
            grad = grad.detach()
        if self.world == 1:
            self._accumulate(rec, grad.reshape(-1), owned=True)
            return
        self._grads.append((rec, grad))
        self._grad_bytes += grad.numel() * grad.element_size()
        if self._grad_bytes >= self.bucket_bytes:
            self.flush_grads()

    def flush_grads(self) -> None:
        """Issue one async reduce-scatter for every pending gradient."""
        if not self._grads:
            return
        pending, self._grads, self._grad_bytes = self._grads, [], 0
        records = [rec for rec, _ in pending]
        grads = [g for _, g in pending]
        dtype = self.reduce_dtype or grads[0].dtype
        layout = kernels.shard_layout(tuple(r.numel for r in records), self.world)
        inp = torch.empty(layout.total * self.world, dtype=dtype, device=grads[0].device)
        kernels.pack_grads(grads, layout.shard_numels, self.world, inp)
        inp.div_(self.world)
        out = torch.empty(layout.total, dtype=dtype, device=inp.device)
        work = reduce_scatter_flat(out, inp, self.group, async_op=True)
        self._reduces.append((work, out, records, layout))
        self.counters.reduce_scatters += 1
        self.counters.reduced_bytes += inp.numel() * inp.element_size()

    def finish_reduces(self) -> None:
        """Flush the last bucket, wait for every reduce-scatter, accumulate into shard grads."""
        self.flush_grads()
        reduces, self._reduces = self._reduces, []
        for work, out, records, layout in reduces:
            work.wait()
            # ``out`` is fresh for every reduce and referenced nowhere else, so its
            # pieces can become shard gradients without a copy.
            for rec, piece in zip(records, out.split(layout.shard_numels)):
                self._accumulate(rec, piece, owned=True)

    @property
    def reduces_pending(self) -> bool:
        return bool(self._grads or self._reduces)

    @staticmethod
    def _accumulate(rec, flat_grad, owned: bool) -> None:
        """Add a reduced gradient shard into ``shard.grad`` (created on first use).

        ``owned`` says ``flat_grad`` is referenced nowhere else (a one-rank
        gradient taken from autograd), so it can become ``shard.grad`` as is.
        """
        shard = rec.shard
        if flat_grad.dtype != shard.dtype:
            flat_grad, owned = flat_grad.to(shard.dtype), True
        if shard.grad is None:
            shard.grad = flat_grad if owned else flat_grad.clone()
        else:
            shard.grad.add_(flat_grad)
