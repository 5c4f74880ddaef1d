"""The gather side of the executor: issue a bucket's all-gather, wait for it, stage full tensors.

:class:`Gathers` is a part of :class:`paramfsm.engine.effects.executor.Executor` kept in
its own module; it uses the executor's group, lanes, counters and rank check.

[Note: gather = issue, then wait, then install]
``start_gather`` launches the bucket's gather on the gather lane
(:mod:`paramfsm.engine.effects.streams`): pack the shards, issue an async all-gather
(INFLIGHT). On a device the lane also waits for the collective and unpacks the
whole bucket into full tensors (see [Note: persistent full storage]) without
blocking the host; on the CPU the host does both in ``wait_gather``, which is
where gloo's background thread stops overlapping. ``wait_gather`` joins the
lane (compute waits for its event) and stages the full tensors on the records.
The ``unpack`` effect (on the ``arrive`` transition) installs a staged tensor as
``param.data``. Splitting wait from install lets one wait complete a bucket
that spans several units while each parameter still moves through the FSM on
its own.

[Note: persistent full storage]
Autograd saves views of parameters (``F.linear`` saves ``weight.t()``), and a
view keeps its storage alive: if every gather made a fresh full tensor and
``free`` only swapped ``param.data``, the full weights of every layer would
stay alive from forward to backward through those views, and sharding would
save no memory in between. So a parameter of at least PERSISTENT_BYTES owns
one full tensor for life: ``free`` resizes its storage to zero bytes (the
memory is returned at once; saved views now point at nothing), and the next
gather regrows the same storage and fills it, before any backward node that
saved such a view runs (pre-backward fetches first). Filling it bumps the full
tensor's version counter, not the parameter's (``param.data =`` keeps the
parameter's own counter), so saved views stay valid. Small parameters are
unpacked as views of one buffer per bucket instead: one allocation per
bucket, and what saved views retain is bounded by the bucket.

[Note: a large parameter is gathered in place]
A parameter of at least PERSISTENT_BYTES whose size divides by the world and
that is gathered in its own dtype needs no packing: its shard is a send buffer
as it is, and the ``[rank][shard]`` result is the full parameter's flat layout.
So each such parameter of a bucket is all-gathered straight into its
persistent full tensor, and only the rest of the bucket (small parameters,
ragged ones, and the rank-order tag) is packed into one more all-gather,
issued after them. That saves the full-size receive buffer (memory at the
peak of a step) and two copies of every large parameter per gather; issuing
the collectives back to back costs no measurable time on gloo (a 4 MiB
all-gather with a 256-byte one in flight beside it took as long as alone).
The bucket is still one gather for the FSM, the counters and the rank-order
check (whose tag covers the whole bucket). Which parameters go in place
depends only on their size, dtype and device, so every rank issues the same
collectives in the same order. CPU only: on a device the lanes pack with
the CuPy kernels, and that path is not exercised here.
"""

from __future__ import annotations

import torch

from paramfsm.engine.effects import collectives, kernels, rankcheck
from paramfsm.engine.effects.gloo.agreement import Dropped
from paramfsm.engine.effects.collectives import all_gather_flat, coalesced, size_agreement
from paramfsm.engine.effects.inflight import Gather
from paramfsm.engine.effects.streams import GATHER

#: Parameters from this size on keep one full tensor for life whose storage is freed and regrown.
PERSISTENT_BYTES = 64 * 1024
#: The name the agreement at the end of a backward has among the collectives a tag can point at.
BACKWARD_END = "<agreement at the end of a backward>"


class Gathers:
    """``start_gather`` / ``wait_gather`` of the executor (see the module docstring)."""

    def start_gather(self, records) -> None:
        """Issue the all-gather of ``records`` (the start_gather effect), packing what must be packed.

        Each parameter is gathered in its compute dtype (``param_dtype``, else its
        shard's; batch norms keep their shard's: see ``compute_dtypes`` in
        :mod:`paramfsm.sharding.assembly`). A bucket whose parameters have different
        compute dtypes is gathered as one all-gather per dtype, so each parameter
        comes back in its own (the order of the groups is the same on every rank).
        """
        if self.local:
            for rec in records:
                rec.staged = self._local_full(rec, rec.compute_dtype)
            gather = Gather(records, None)
        else:
            dtype = records[0].compute_dtype
            if any(r.compute_dtype != dtype for r in records):
                by_dtype: dict = {}
                for rec in records:
                    by_dtype.setdefault(rec.compute_dtype, []).append(rec)
                for group in by_dtype.values():
                    self.start_gather(tuple(group))
                return
            first = records[0].shard
            on_cpu = first.device.type == "cpu"
            in_place = None  # which records go in place; only one of PERSISTENT_BYTES or more can
            if any(rec.nbytes >= PERSISTENT_BYTES for rec in records):
                flags = tuple(self._in_place(rec, dtype) for rec in records)
                in_place = flags if any(flags) else None
            packed = records if in_place is None else [rec for rec, direct in zip(records, in_place) if not direct]
            numels = tuple([r.numel for r in packed])
            # The torch packing runs under no_grad, so CPU shards need no detached alias; CuPy needs one.
            shards = [r.shard for r in packed] if on_cpu else [r.shard.detach() for r in packed]
            check, named = self.rank_check, None
            tagged = check == "tag" and on_cpu
            if check == "header" or tagged:
                fields = self._tag_fields(records)
                if tagged:
                    numels += (rankcheck.TAG_NUMEL * self.world,)
                    shards.append(rankcheck.encode(fields, dtype, first.device))
                    named = self.agree_first("all-gather", fields, first, records)
                else:
                    rankcheck.check_header(fields, self.rank, self.world, self.group, self.unit_names,
                                           "all-gather", self.timed_wait("rank-check header", records))
            layout = kernels.shard_layout(numels, self.world) if numels else None
            gather = Gather(records, layout, tagged, in_place)
            gather.ticket = self.streams.launch(GATHER, self._issue_gather, gather, shards, dtype, named)
            if tagged:
                self._unchecked.append(gather)
            self.counters.all_gathers += 1
            self.counters.gathered_bytes += dtype.itemsize * (
                (layout.total * self.world if layout is not None else 0)
                + (sum(rec.numel for rec, direct in zip(records, in_place) if direct) if in_place else 0))
        for rec in records:
            rec.pending = gather

    def _in_place(self, rec, dtype) -> bool:
        """Whether ``rec`` is gathered straight into its full tensor (see [Note: a large parameter is
        gathered in place])."""
        shard = rec.shard
        return (rec.nbytes >= PERSISTENT_BYTES and rec.numel % self.world == 0 and shard.dtype == dtype
                and shard.device.type == "cpu")

    def agree_backward_end(self, device) -> None:
        """Every rank tells the others how many gathers and reduce-scatters it issued, at the end of each
        outermost backward (gloo on the CPU, where collectives agree their sizes; elsewhere ``debug=True``).

        [Note: a backward that reached other units on other ranks]
        A loss that reads different outputs on different ranks (a rank-dependent branch in the loss) makes
        one rank's backward reach units another's does not: that rank regathers or reduces more. Its extra
        collective waits for a peer that has already left the backward. When the peer's next collective is
        paramfsm's, the two meet and the rank check raises RankDesync on both; but when it is the user's
        own (a logged loss all-reduced, a barrier) or another group's, both wait until
        ``collective_timeout``. So each backward ends with this small tagged all-gather of the counters: it
        meets the extra collective, whose tag differs, and every rank raises RankDesync within the
        backward, naming both. It costs one small collective per backward (about 0.25 ms on gloo).
        """
        if self.world == 1 or self.rank_check is None or device.type != "cpu":
            return
        if BACKWARD_END not in self.unit_names:
            return
        fields = (self.counters.all_gathers, self.ctx.step if self.ctx is not None else 0,
                  self.unit_names.index(BACKWARD_END), self.counters.reduce_scatters)
        flat = torch.zeros(1, dtype=torch.float32, device=device)
        named = None
        if self.rank_check == "tag":
            named = self.agree_first("all-gather", fields, flat, ())
        else:
            rankcheck.check_header(fields, self.rank, self.world, self.group, self.unit_names, "all-gather",
                                   self.timed_wait("rank-check header", ()))
        send = torch.cat([flat, rankcheck.encode(fields, flat.dtype, device)])
        recv = torch.empty(self.world * send.numel(), dtype=send.dtype, device=device)
        with coalesced(named):  # a rank check, like a header: not a gather of parameters, so not counted
            work = collectives.all_gather_flat(recv, send, self.group, async_op=True)
        self.timed_wait("agreement at the end of a backward", ())(work)
        rankcheck.check_encoded(recv.view(self.world, -1)[:, 1:], self.rank, self.unit_names)

    def agree_first(self, what: str, fields: tuple[int, ...], tensor, records) -> tuple[int, ...] | None:
        """Agree the sizes of the collective ``what`` (tagged ``fields``) before it moves, by default on
        gloo (see [Note: two ways to carry the tag] in :mod:`paramfsm.engine.effects.rankcheck`): the fields that
        name its exchanges' header, or None after a blocking header (a gloo collective) or where nothing
        is agreed (``agree_sizes`` off, or not gloo on the CPU)."""
        route = None
        if self.agree_sizes:
            key = (what, tensor.device.type)
            route = self._routes.get(key, key)
            if route is key:
                route = self._routes[key] = size_agreement(what, tensor, self.group)
        if route == "header":
            rankcheck.check_header(fields, self.rank, self.world, self.group, self.unit_names, what,
                                   self.timed_wait("rank-check header", records))
        return fields if route == "exchange" else None

    def _tag_fields(self, records) -> tuple[int, ...]:
        """(gather number, step, unit index, elements): the same on every rank running the same program."""
        units = records[0].units
        return (self.counters.all_gathers, self.ctx.step if self.ctx is not None else 0,
                units[0].index if units else -1, sum(r.shard_numel for r in records))

    @staticmethod
    def _local_full(rec, dtype):
        """World 1: the shard is the whole parameter; gather it as a view (or a cast copy)."""
        if dtype != rec.shard.dtype:
            return rec.shard.detach().to(dtype).view(rec.shape)
        view = rec.local_view
        if view is None:
            view = rec.local_view = rec.shard.detach().view(rec.shape)
        return view

    def _issue_gather(self, gather: Gather, shards, dtype, named=None):
        """Gather-lane work: issue the in-place all-gathers, pack and issue the rest; on a device also
        wait and unpack there. ``named``: the tag fields of the exchanges' header, if they agree sizes."""
        with coalesced(named):  # one hand-over to the exchange thread: [Note: a bucket's exchanges are posted together]
            if gather.in_place is not None:
                gather.direct = [
                    all_gather_flat(self._persistent(rec, rec.shard).view(-1), rec.shard.detach(), self.group,
                                    async_op=True)
                    for rec, direct in zip(gather.records, gather.in_place) if direct]
            layout = gather.layout
            if layout is not None:
                device = shards[0].device
                send = torch.empty(layout.total, dtype=dtype, device=device)
                kernels.pack_shards(shards, send)
                gather.recv = torch.empty(layout.total * self.world, dtype=dtype, device=device)
                gather.work = all_gather_flat(gather.recv, send, self.group, async_op=True)
        return self._finish_gather(gather) if self.streams.asynchronous else None

    def wait_gather(self, gather: Gather) -> None:
        """Wait for a gather and stage every parameter's full tensor (idempotent).

        See [Note: gather = issue, then wait, then install] for which side waits.
        """
        ticket = gather.ticket
        if ticket is None:
            return
        gather.ticket = None
        if gather.tagged:
            self._unchecked.remove(gather)
        outs = self.streams.join(ticket)
        if outs is None:
            outs = self._finish_gather(gather)
        for rec, out in zip(gather.records, outs):
            rec.staged = out

    def check_gathers(self) -> None:
        """Wait for (and so check the tags of) every tagged gather issued and not waited for yet.

        [Note: a reduce-scatter follows the check of the gathers before it]
        A rank whose backward reaches other units than its peer's may issue a
        gather it never waits for (a bucket opened by another unit, a prefetch
        abandoned later) and go on to a reduce-scatter. The peer that did wait
        for the paired gather read the tags and raised RankDesync, so it never
        joins that reduce-scatter: posted, it would hang this rank until
        CollectiveTimeout and leave its messages behind for the next exchange.
        Both gathers moved (their sizes agreed), so reading this rank's copy of
        the tags before posting the reduce-scatter raises the same RankDesync
        here, with the same exchanges posted on both ranks. The gathers were
        issued earlier on the same lane, so waiting for them costs little.
        """
        for gather in list(self._unchecked):
            try:
                self.wait_gather(gather)
            except Dropped:
                pass  # a gather of an epoch a refusal ended: recovery drops it, and so does this

    def _finish_gather(self, gather: Gather) -> list:
        """Wait for the all-gather(s) and unpack into full tensors, one per record.

        See [Note: persistent full storage] for where the full tensors live.
        """
        records = gather.records
        works = list(gather.direct or ())
        if gather.work is not None:
            works.append(gather.work)
        gather.work = gather.direct = None
        if self.streams.asynchronous:
            for work in works:
                work.wait()  # on the gather lane: a stream wait, see [Note: every host wait has a limit]
        else:
            wait = self.timed_wait(f"all-gather #{self.counters.all_gathers}", records)
            for work in works:
                wait(work)
        in_place = gather.in_place
        packed = records if in_place is None else [r for r, direct in zip(records, in_place) if not direct]
        outs = self._unpack(gather, packed) if gather.layout is not None else []
        if in_place is None:
            return outs
        rest = iter(outs)
        return [rec.full if direct else next(rest) for rec, direct in zip(records, in_place)]

    def _unpack(self, gather: Gather, records) -> list:
        """The packed all-gather's full tensors for ``records`` (and the rank-order check of its tag)."""
        recv = gather.recv
        gather.recv = None
        tag = torch.empty(rankcheck.TAG_NUMEL * self.world, dtype=recv.dtype, device=recv.device) \
            if gather.tagged else None
        if any(rec.nbytes >= PERSISTENT_BYTES for rec in records):
            outs = [self._persistent(rec, recv) if rec.nbytes >= PERSISTENT_BYTES
                    else torch.empty(rec.shape, dtype=recv.dtype, device=recv.device) for rec in records]
            kernels.unpack_gathered(recv, outs + ([tag] if tag is not None else []),
                                    gather.layout.shard_numels, self.world)
        else:
            shapes = [r.shape for r in records] + ([tag.shape] if tag is not None else [])
            outs = kernels.unpack_to_views(recv, gather.layout, shapes)
            if tag is not None:
                tag = outs.pop()
        if tag is not None:
            rankcheck.check_encoded(tag.view(self.world, -1), self.rank, self.unit_names)
        return outs

    @staticmethod
    def _persistent(rec, like: torch.Tensor) -> torch.Tensor:
        """The parameter's own full tensor, its storage grown back to full size.

        Made outside inference mode even when the gather that first needs it runs inside one (an evaluation
        under ``torch.inference_mode()``): an inference tensor kept for life would refuse every later write,
        a ``rt.gathered(writeback=True)`` block's or the unpack's in a training forward.
        """
        full = rec.full
        if full is None or full.dtype != like.dtype:
            with torch.inference_mode(False):
                full = rec.full = torch.empty(rec.shape, dtype=like.dtype, device=like.device)
        else:
            storage = full.untyped_storage()
            if storage.nbytes() == 0:
                storage.resize_(full.numel() * full.element_size())
        return full
