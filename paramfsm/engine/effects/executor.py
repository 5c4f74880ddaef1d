"""The executor runs the effects that :func:`paramfsm.core.fsm.step` returns.

It owns buffers and collectives, never states: it is handed parameter records
and acts on their tensors (``param.data``, the shard, staged / pending
buffers). Effects of one scheduler decision are merged into one bucket:
one all-gather for every parameter that must be gathered together (one per
dtype when a bucket mixes parameter dtypes), one reduce-scatter for every
gradient bucket. The gather side lives in :mod:`paramfsm.engine.effects.gathers`.

[Note: gradients leave the parameter at once]
``reduce_grad`` takes ``param.grad`` (accumulated by autograd for the current
graph task) into the pending reduce bucket and clears it, so the full gradient
never outlives the hook. Buckets are reduce-scattered asynchronously once they
pass ``bucket_bytes``, with at most ``MAX_REDUCES_IN_FLIGHT`` in flight (the
oldest is completed before another is issued); ``finish_reduces`` (end of
backward) completes the rest. Completing one adds ``1/world`` of each summed
shard into ``shard.grad``, so shard gradients accumulate across backward
passes until the user zeroes them. The packing and the collective run on the
reduce lane, which keeps the gradients alive until it is joined (see
[Note: compute waits at join, and arguments outlive the side work]).
"""

from __future__ import annotations

import functools

import torch

from paramfsm.engine.effects import grad_flags, kernels, rankcheck
from paramfsm.engine.effects.gloo import exchange
from paramfsm.engine.effects.gloo.agreement import Dropped
from paramfsm.engine.effects.collectives import DEFAULT_TIMEOUT_S, coalesced, reduce_scatter_flat, waiter
from paramfsm.engine.effects.gathers import PERSISTENT_BYTES, Gathers
from paramfsm.engine.effects.grad_sync import UnsyncedGrads
from paramfsm.engine.effects.inflight import Counters
from paramfsm.engine.effects.shard_grads import accumulate
from paramfsm.engine.effects.streams import REDUCE, HostStreams
from paramfsm.engine.storage import placeholder
from paramfsm.engine.storage.partitioned import real_grad, set_real_grad
from paramfsm.errors import CollectiveTimeout, RankDesync

# [Note: a big gradient is reduced in place]
# A gradient of at least ``bucket_bytes`` is reduce-scattered at once in a bucket
# of its own; smaller ones keep filling the pending bucket. A lone gradient whose
# size divides by the world is already laid out [rank][shard] (see
# paramfsm.engine.effects.kernels.layout), so it is the collective's input as it is: no
# packed copy. It is ours alone (``take_grad`` cleared ``param.grad``; autograd
# steals a buffer only when nothing else holds it), so it may be divided in
# place; one that is part of a graph (``create_graph=True``) is copied first.

#: Reduce-scatters issued and not yet waited on, at most (each holds a full-size gradient bucket).
MAX_REDUCES_IN_FLIGHT = 1

# [Note: the default bucket is 8 MiB]
# ``paramfsm.shard(bucket_bytes=...)`` cuts both the gather plan (consecutive units gathered by one
# collective) and the gradient buckets. Every collective has a fixed cost (a hand-over to the exchange
# thread and a wake-up on gloo, a launch and a rendezvous on NCCL), so block-sized units of small
# models paid it per block at the old 1 MiB: measured at world 2 on this project's 2-core machine
# (median step, 4-5 interleaved rounds, one run each), the 8 GPT blocks of width 128 took 115 ms at
# 8 MiB against 153 ms at 1 MiB, the tiny Llama 219 against 268 ms; bigger buckets of gathers alone
# or of gradients alone each gave about half of that, and 16 MiB nothing more. The price is memory of
# small units only: up to ``(1 + prefetch)`` buckets of full parameters gathered ahead and one bucket
# of full gradients waiting, so at most about 16 + 8 MiB above the units in use. A unit of 8 MiB or
# more (any block of a model that needs sharding) is its own bucket, and a gradient of 8 MiB or more
# its own reduce, exactly as before.
DEFAULT_BUCKET_BYTES = 8 << 20

__all__ = ["DEFAULT_BUCKET_BYTES", "PERSISTENT_BYTES", "Executor", "MAX_REDUCES_IN_FLIGHT"]


class Executor(Gathers):
    """Runs gather / free / reduce effects for one process group."""

    def __init__(self, group, rank: int, world: int, *, param_dtype=None, reduce_dtype=None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, streams=None, timeout_s: float = DEFAULT_TIMEOUT_S,
                 replicate_group=None, replicas: int = 1, ctx=None, unit_names: tuple[str, ...] = (),
                 rank_check: str | None = "tag"):
        """``ctx``: the step context shared with the scheduler (for the step in tags and messages; None:
        step 0); ``unit_names``: what a rank-order tag can point at, for messages
        (:func:`paramfsm.sharding.full_state.collective_names`); ``rank_check``: see below."""
        self.group, self.rank, self.world = group, rank, world
        # Hybrid sharding: gradients are also summed across replicas ([Note: hybrid reduction]).
        self.replicate_group, self.replicas = replicate_group, replicas
        self.timeout_s = timeout_s  # the limit of every host wait on a collective
        self.streams = streams if streams is not None else HostStreams()
        # World 1 needs no collective: the shard is the parameter. The GPU check turns this
        # off to drive the full path (packing kernels, NCCL, streams) on a single device.
        self.local = world == 1 and replicas == 1
        self.param_dtype = param_dtype
        self.reduce_dtype = reduce_dtype
        self.bucket_bytes = bucket_bytes
        self.counters = Counters()
        self.unsynced = UnsyncedGrads(self)  # gradients kept under rt.no_sync (paramfsm.engine.effects.grad_sync)
        self._empty: dict[tuple, torch.Tensor] = {}
        self._grads: list = []  # (record, grad) waiting for the next reduce bucket
        self._had: dict = {}  # record -> whether this rank had its gradient, for those staged in unit order
        self._unchecked: list = []  # tagged gathers issued and not waited yet, oldest first (see gathers.py)
        self._grad_bytes = 0
        self._reduces: list = []  # (ticket, records, layout) in flight
        # The rank-order check (paramfsm.engine.effects.rankcheck): "tag" rides in the bucket and, with
        # ``agree_sizes``, sizes are agreed before each collective moves (the default); "header" is a
        # separate fixed-size all-gather first (debug=True); None is off.
        self._rank_check: str | None = rank_check
        self._agree_sizes = True
        self._routes: dict = {}  # (collective, device type) -> how its sizes are agreed (collectives.size_agreement)
        self._share_agreement(forget=True)  # a new runtime starts a new sequence of collectives
        self.ctx = ctx
        self.unit_names = unit_names
        # Reduced gradient shards handed back to the schedule, in the order they completed, instead of added
        # into shard.grad here (offloaded shard gradients: see hand_back_reduced); None: added here.
        self.completions = None

    @property
    def rank_check(self) -> str | None:
        return self._rank_check

    @rank_check.setter
    def rank_check(self, mode: str | None) -> None:
        self._rank_check = mode
        self._share_agreement()

    @property
    def agree_sizes(self) -> bool:
        """Whether, with the "tag" check, every collective agrees its sizes across ranks before it moves."""
        return self._agree_sizes and self._rank_check == "tag"

    @agree_sizes.setter
    def agree_sizes(self, on: bool) -> None:
        self._agree_sizes = bool(on)
        self._share_agreement()

    def _share_agreement(self, forget: bool = False) -> None:
        """Every exchange on the group agrees its sizes, or none does (whatever issues it)."""
        if not self.local:
            exchange.agree_sizes(self.group, self.agree_sizes, forget)

    # ------------------------------------------------------------------ effects
    # Each effect takes the records it applies to: one call per unit (see [Note: one lookup for a unit]).
    def install(self, records) -> None:
        """The unpack effect: the staged full tensor becomes ``param.data``."""
        reveal = placeholder.reveal
        for rec in records:
            if rec.staged is None:
                self.wait_gather(rec.pending)
            param = rec.param
            reveal(param)
            param.data = rec.staged
            rec.staged = None
            rec.pending = None

    def discard(self, records) -> None:
        """The discard_gather effect: complete the collective (every rank joined it), drop the result;
        one that never moved, after a desync this rank raised before, is simply dropped."""
        for rec in records:
            if rec.pending is not None:
                try:
                    self.wait_gather(rec.pending)
                except Dropped:
                    pass
            rec.staged = None
            rec.pending = None

    def free(self, records) -> None:
        """The free effect: ``param.data`` becomes an empty placeholder; only the shard stays live.

        The placeholder has the record's compute dtype (``param_dtype``, else the shard's), so a
        parameter's dtype is the same gathered or not and autograd's ``AccumulateGrad``
        always sees gradients of the dtype it recorded. It raises
        :class:`~paramfsm.errors.NotGathered` when used (see :mod:`paramfsm.engine.storage.placeholder`).
        """
        conceal = placeholder.conceal
        for rec in records:
            shard = rec.shard
            key = (rec.compute_dtype, shard.device)
            empty = self._empty.get(key)
            if empty is None:
                empty = self._empty[key] = torch.empty(0, dtype=key[0], device=key[1])
            param = rec.param
            param.data = empty
            conceal(param)
            full = rec.full
            if full is not None:
                storage = full.untyped_storage()
                if storage.nbytes():
                    storage.resize_(0)

    # ------------------------------------------------------------------ reduce
    def take_grad(self, records) -> None:
        """The reduce_grad effect: move each ``param.grad`` into the pending reduce bucket."""
        for rec in records:
            grad = real_grad(rec.param)
            if grad is None:
                continue
            set_real_grad(rec.param, None)
            self._take(rec, grad)

    def detach_grad(self, rec):
        """Take ``param.grad`` off the parameter (None when autograd produced none on this rank)."""
        grad = real_grad(rec.param)
        if grad is not None:
            set_real_grad(rec.param, None)
        return grad

    def take_ordered(self, pairs) -> None:
        """One unit's staged gradients, in the unit's order; None: zeros, flagged as no gradient here
        (see [Note: a unit's gradients go out in the unit's order] in paramfsm.engine.schedule.grad_order)."""
        for rec, grad in pairs:
            had = grad is not None
            if not had:
                grad = torch.zeros(rec.shape, dtype=rec.compute_dtype, device=rec.shard.device)
            self._take(rec, grad, had)

    def _take(self, rec, grad, had=None) -> None:
        """Fold in the micro-batches kept under rt.no_sync (paramfsm.engine.effects.grad_sync), then queue it.

        [Note: sparse gradients]
        ``Embedding(sparse=True)`` and ``EmbeddingBag(sparse=True)`` give a sparse
        COO gradient of the rows the batch looked up. A reduce-scatter packs flat
        dense gradients and every rank's shard gradient covers a slice of all the
        rows, so the sparse gradient is made dense here, once, before it is packed:
        the shard gradient is then the dense gradient plain torch's ``to_dense()``
        would give, and an optimizer over shards steps it as a dense one
        (``torch.optim.SparseAdam``, which takes only sparse gradients, refuses it).
        """
        owned = not grad.requires_grad
        grad = grad if owned else grad.detach()
        if grad.layout is not torch.strided:  # Embedding(sparse=True): see [Note: sparse gradients]
            grad, owned = grad.to_dense(), True
        if self.unsynced:
            folded = self.unsynced.fold(rec, grad)
            if folded is not grad:  # a kept gradient: this rank has one, even when this backward gave none
                grad, owned, had = folded, True, True if had is not None else None
        self.queue_grad(rec, grad, owned, had)

    def queue_grad(self, rec, grad, owned: bool, had=None) -> None:
        """Add one full gradient to the pending reduce bucket (``owned``: referenced nowhere else;
        ``had``: for gradients staged in unit order, whether this rank produced it)."""
        if self.local:
            self._accumulate_all(((rec, grad.reshape(-1)),))
            return
        size = grad.numel() * grad.element_size()
        if had is not None:  # its flag rides in its bucket: [Note: a gradient no rank produced stays None]
            # Zeros and a late gradient of one parameter may share a bucket: this rank had it if either had.
            self._had[rec] = had or self._had.get(rec, False)
        if size >= self.bucket_bytes:  # a bucket of its own: see [Note: a big gradient is reduced in place]
            self._reduce([(rec, grad if owned else grad.clone())])
            return
        self._grads.append((rec, grad))
        self._grad_bytes += size
        if self._grad_bytes >= self.bucket_bytes:
            self.flush_grads()

    def flush_grads(self) -> None:
        """Issue one async reduce-scatter for every pending gradient."""
        if self._grads:
            pending, self._grads, self._grad_bytes = self._grads, [], 0
            self._reduce(pending)

    def _reduce(self, pending) -> None:
        """Issue one async reduce-scatter for ``pending`` (record, gradient) pairs."""
        if self._unchecked:  # [Note: a reduce-scatter follows the check of the gathers before it] in gathers.py
            self.check_gathers()
        payload = sum(-(-rec.numel // self.world) for rec, _ in pending)
        if self._had:
            pending = grad_flags.add_flags(pending, self._had, self.world)
        records = [rec for rec, _ in pending]
        grads = [g for _, g in pending]
        dtype = self.reduce_dtype or grads[0].dtype
        if self.reduce_dtype is None and any(g.dtype != dtype for g in grads):
            dtype = functools.reduce(torch.promote_types, (g.dtype for g in grads))  # mixed: lose no precision
        layout = kernels.shard_layout(tuple(r.numel for r in records), self.world)
        named = None
        if self.rank_check is not None:
            step = self.ctx.step if self.ctx is not None else 0
            unit = records[0].units[0].index if records[0].units else -1
            fields = (self.counters.reduce_scatters, step, unit, layout.total)
            if self.rank_check == "header":
                rankcheck.check_header(fields, self.rank, self.world, self.group, self.unit_names,
                                       "reduce-scatter", self.timed_wait("rank-check header", records))
            else:
                named = self.agree_first("reduce-scatter", fields, grads[0], records)
        # An issued reduce-scatter holds its full-size input until it is waited on: bound how many
        # are in flight (the oldest completes before another is issued) so gradient memory stays bounded.
        while len(self._reduces) >= MAX_REDUCES_IN_FLIGHT:
            self._complete(self._reduces.pop(0))
        ticket = self.streams.launch(REDUCE, self._issue_reduce, layout, dtype, grads, named)
        self._reduces.append((ticket, records, layout))
        self.counters.reduce_scatters += 1
        self.counters.reduced_bytes += payload * self.world * dtype.itemsize

    def finish_reduces(self) -> None:
        """Flush the last bucket, wait for every reduce-scatter, accumulate into shard grads."""
        self.flush_grads()
        reduces, self._reduces = self._reduces, []
        for reduce in reduces:
            self._complete(reduce)
        self.unsynced.settled()

    def _issue_reduce(self, layout, dtype, grads, named=None) -> tuple:
        """Reduce-lane work: pack and pre-divide the gradients, issue the reduce-scatter (``named``: the
        tag fields of its exchange's header, if it agrees sizes).

        Returns ``(out, work)``; on a device the lane waits for the collective
        itself, so ``work`` is None.
        """
        first = grads[0]
        if (len(grads) == 1 and first.dtype == dtype and first.is_contiguous()
                and first.numel() == layout.total * self.world):
            inp = first.view(-1)  # already in [rank][shard] order: see [Note: a big gradient is reduced in place]
        else:
            inp = torch.empty(layout.total * self.world, dtype=dtype, device=first.device)
            kernels.pack_grads(grads, layout.shard_numels, self.world, inp)
        inp.div_(self.world * self.replicas)
        out = torch.empty(layout.total, dtype=dtype, device=inp.device)
        with coalesced(named):
            work = reduce_scatter_flat(out, inp, self.group, async_op=True, replicate_group=self.replicate_group)
        if self.streams.asynchronous:
            work.wait()
            return out, None
        return out, work

    def _join_reduce(self, ticket, records) -> torch.Tensor:
        out, work = self.streams.join(ticket)
        if work is not None:
            self.timed_wait("reduce-scatter", records)(work)
        return out

    def timed_wait(self, what: str, records):
        """A host wait on ``what`` for ``records``; past ``timeout_s`` it raises CollectiveTimeout, and
        RankDesync when the ranks' exchange headers differed."""
        units = ", ".join(dict.fromkeys(rec.unit for rec in records)) if records else "(every unit)"

        def timed_out(waited: float) -> CollectiveTimeout:
            step = self.ctx.step if self.ctx is not None else 0
            return CollectiveTimeout(collective=what, unit=units, step=step, rank=self.rank, waited_s=waited,
                                     limit_s=self.timeout_s)

        def refused(rows) -> RankDesync:
            step = self.ctx.step if self.ctx is not None else 0
            return rankcheck.refused(rows, self.rank, self.unit_names, what, step)

        return waiter(self.timeout_s, timed_out, refused)

    def _complete(self, reduce) -> None:
        ticket, records, layout = reduce
        out = self._join_reduce(ticket, records)
        self._accumulate_all(tuple(grad_flags.without_unproduced(records, out.split(layout.shard_numels))))

    def abort_reduces(self) -> None:
        """Drop the gradients of an interrupted backward: nothing of it reaches the shard gradients.

        Reduce-scatters already issued are waited for (every rank joined them,
        so they must complete) and their results dropped; gradients not yet
        issued are dropped. Accumulating them instead would add a partial
        backward to whatever the user does next, even after ``zero_grad``.
        """
        self._grads, self._grad_bytes = [], 0
        self._had.clear()
        reduces, self._reduces = self._reduces, []
        for ticket, records, _ in reduces:
            try:
                self._join_reduce(ticket, records)
            except (RankDesync, Dropped):
                pass  # it never moved: the ranks desynced, and whatever interrupted the backward says so
        self.unsynced.interrupted()

    def hand_back_reduced(self) -> None:
        """From now on a reduced gradient shard is handed back (:meth:`take_completed`) instead of added into
        ``shard.grad`` here: the schedule adds it, paging offloaded shard gradients in and out around the
        addition (``paramfsm.engine.schedule.grad_paging``), so no effect steps a residency machine."""
        if self.completions is None:
            self.completions = []

    def take_completed(self) -> list:
        """The (record, reduced shard) pairs handed back since the last call, in the order they completed."""
        done, self.completions = self.completions, []
        return done

    def _accumulate_all(self, pieces) -> None:
        """:func:`accumulate` each (record, reduced shard) pair, or hand them back (:meth:`hand_back_reduced`)."""
        if self.completions is None:
            for rec, piece in pieces:
                accumulate(rec, piece)
            return
        # Not a view: a view keeps its base alive even once its data is swapped, so a shard gradient paged
        # out to its tier would still hold the whole reduce-scatter output.
        self.completions.extend((rec, piece.detach() if piece._is_view() else piece) for rec, piece in pieces)
