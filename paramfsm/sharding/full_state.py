"""Full tensors from shards: what ``rt.full_param``, ``full_grad``, ``full_state_dict`` and ``close`` gather.

Every full tensor is one all-gather of the parameter's shard (or shard
gradient), waited for with the runtime's time limit. Two rules make these
collectives as safe as the gathers of forward and backward:

* **Rank-checked.** Each goes through the same rank-order check as a unit's
  gather (see [Note: full-tensor collectives carry a rank-order tag]).
* **One gather per parameter.** A tied parameter (one ``nn.Parameter`` under
  several state-dict keys) is gathered once, and every one of its keys maps to
  the same full tensor, as ``model.state_dict()`` does on a plain model (there
  the aliases share one storage). ``save_pretrained(state_dict=...)`` and
  ``safetensors`` recognise the aliases by their shared storage and write the
  same keys and bytes as a plain save.

[Note: full-tensor collectives carry a rank-order tag]
A full-tensor all-gather is tagged ``(gather number, step, index, elements)``
like a unit's bucket (:mod:`paramfsm.engine.effects.rankcheck`), where ``index``
counts past the units: ``units + 2 * i`` for parameter ``i``'s value and
``units + 2 * i + 1`` for its gradient. So it can never be mistaken for a
unit's gather, for another parameter's full tensor, or for the gradient of
the same parameter. By default on CPU the tag rides in the gathered buffer (no
extra collective): a desync that pairs it with a collective of the same size
on another rank (``rt.full_param`` on one rank while another runs a forward
whose bucket has the same number of elements) raises RankDesync on every
rank. Paired with a collective of another size, gloo aborts the process
before any tag is read. With ``debug=True`` a fixed-size header is
all-gathered first, so every pairing raises RankDesync on every rank before
the payload moves. Gathers count in ``rt.counters`` like any other.

[Note: the runtime's small all-reduces are checked gathers]
``rt.clip_grad_norm_`` and ``paramfsm.amp.GradScaler`` agree a few numbers
across ranks (a norm, a found-inf flag). A plain ``dist.all_reduce`` is a gloo
collective outside the exchanges' size agreement: a rank that skips a step
(``continue`` before its forward) but still clips sits in it while its peers
gather, and both wait until ``CollectiveTimeout``. So :func:`all_reduce`
all-gathers every rank's values with a tag (index ``units + 2 * params`` for
the norm, ``+ 1`` for the scaler), which takes the exchanges' agreement like
any gather, and every rank reduces the rows itself in rank order (the same
bits everywhere). The desync then raises RankDesync on every rank, naming
the norm's collective against the peers' gathers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from paramfsm.sharding import meta
from paramfsm.core.spec import State
from paramfsm.engine.effects import kernels, rankcheck
from paramfsm.engine.effects.collectives import all_gather_flat, coalesced
from paramfsm.engine.effects.gathers import BACKWARD_END
from paramfsm.errors import ParamFSMError
from paramfsm.sharding.rank_errors import agreed, groups_of

PARAMETER, GRADIENT = "parameter", "gradient"
#: The all-reduces of :func:`all_reduce`, in the order of their tag indices after the full tensors'.
REDUCTIONS = ("the gradient norm", "the scaler's found_inf")


def collective_names(units, records) -> tuple[str, ...]:
    """Names of everything a rank-order tag can point at: the units, then each parameter's full tensors."""
    names = [unit.name for unit in units]
    for rec in records:
        names += [f"<full {PARAMETER} '{rec.name}'>", f"<full {GRADIENT} '{rec.name}'>"]
    return tuple(names + [f"<all-reduce of {what}>" for what in REDUCTIONS] + [BACKWARD_END])


def _step(ctx) -> int:
    """The step a full-tensor collective is tagged with: the named one (``rt.set_step``), else the pass's."""
    return ctx.pinned if ctx.pinned is not None else ctx.step


def all_reduce(rt, values: torch.Tensor, op: str, what: str) -> torch.Tensor:
    """``values`` (1-D) summed (``op="sum"``) or maximised (``"max"``) over the ranks, rank-checked.

    ``what`` is one of :data:`REDUCTIONS`. Collective: see [Note: the runtime's
    small all-reduces are checked gathers]. Returns a new tensor, the same on every rank.
    """
    ex, world = rt.executor, rt.world
    flat = values.detach().reshape(-1)
    fields = (ex.counters.all_gathers, _step(rt.ctx), len(rt.units) + 2 * len(rt._index) + REDUCTIONS.index(what),
              flat.numel())
    name = f"all-reduce of {what}"
    tagged, named = ex.rank_check == "tag" and flat.device.type == "cpu", None
    if tagged:  # its exchanges' header names it, so a desync's message does (or a blocking header agrees it)
        named = ex.agree_first("all-gather", fields, flat, ())
    elif ex.rank_check == "header":
        rankcheck.check_header(fields, rt.rank, world, rt.group, ex.unit_names, "all-gather",
                               ex.timed_wait(f"rank-check header of the {name}", ()))
    send = torch.cat([flat, rankcheck.encode(fields, flat.dtype, flat.device)]) if tagged else flat.clone()
    recv = torch.empty(world * send.numel(), dtype=send.dtype, device=send.device)
    with coalesced(named):
        work = all_gather_flat(recv, send, rt.group, async_op=True)
    ex.timed_wait(name, ())(work)
    rows = recv.view(world, -1)
    if tagged:
        rankcheck.check_encoded(rows[:, -rankcheck.TAG_NUMEL:], rt.rank, ex.unit_names)
    rows = rows[:, : flat.numel()]
    total = rows[0].clone()
    for row in rows[1:]:  # rank order, so every rank adds the same numbers in the same order
        total = total + row if op == "sum" else torch.maximum(total, row)
    return total


def gather(rt, rec, tensor: torch.Tensor, kind: str = PARAMETER, keep: bool = True) -> torch.Tensor | None:
    """The full value of the shard-shaped ``tensor`` of ``rec`` (collective, rank-checked).

    ``kind`` is :data:`PARAMETER` or :data:`GRADIENT` (it names the collective
    in errors and tags). With ``keep=False`` the rank takes part in the
    collective and its check but builds no full tensor and returns None.
    """
    return gather_with(rt.executor, rec, tensor, kind, keep, units=len(rt.units), index=rt._index, step=_step(rt.ctx))


def gather_with(ex, rec, tensor: torch.Tensor, kind: str = PARAMETER, keep: bool = True, *, units: int, index: dict,
                step: int) -> torch.Tensor | None:
    """:func:`gather` through the executor ``ex`` alone, given what numbers its tag: the count of ``units``,
    each parameter's ``index`` and the ``step`` (also before a runtime exists: a refused ``shard()`` gives
    the values back with it)."""
    shard = tensor.detach()
    world = ex.world
    if world == 1:
        return shard[: rec.numel].view(rec.shape).clone() if keep else None
    tag_index = units + 2 * index[id(rec)] + (kind == GRADIENT)
    fields = (ex.counters.all_gathers, step, tag_index, rec.shard_numel)
    what = f"all-gather of the full {kind} '{rec.name}'"
    tagged = ex.rank_check == "tag" and shard.device.type == "cpu"
    if ex.rank_check == "header":
        rankcheck.check_header(fields, ex.rank, world, ex.group, ex.unit_names, "all-gather",
                               ex.timed_wait(f"rank-check header of the {what}", (rec,)))
    parts = [shard.reshape(-1)]
    if tagged:
        parts.append(rankcheck.encode(fields, shard.dtype, shard.device))
    layout = kernels.shard_layout((rec.numel,) + ((rankcheck.TAG_NUMEL * world,) if tagged else ()), world)
    send = kernels.pack_shards(parts, torch.empty(layout.total, dtype=shard.dtype, device=shard.device))
    recv = torch.empty(layout.gathered_numel, dtype=shard.dtype, device=shard.device)
    work = all_gather_flat(recv, send, ex.group, async_op=True)
    ex.counters.all_gathers += 1
    ex.counters.gathered_bytes += recv.numel() * recv.element_size()
    ex.timed_wait(what, (rec,))(work)
    if tagged:  # the tag is the last rankcheck.TAG_NUMEL elements of every rank's slice
        rankcheck.check_encoded(recv.view(world, layout.total)[:, -rankcheck.TAG_NUMEL:], ex.rank, ex.unit_names)
    if not keep:
        return None
    full = torch.empty(rec.shape, dtype=shard.dtype, device=shard.device)
    outs = [full]
    if tagged:
        outs.append(torch.empty(rankcheck.TAG_NUMEL * world, dtype=shard.dtype, device=shard.device))
    kernels.unpack_gathered(recv, outs, layout.shard_numels, world)
    return full


def full_state_dict(rt, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """The model's state dict with full tensors, each distinct parameter gathered once (collective).

    Aliases of a tied parameter map to the same tensor object. ``rank0_only``:
    rank 0 gets every full tensor on the CPU and the other ranks an empty dict;
    every rank still takes part in every gather, but only rank 0 keeps a full
    tensor, and only one at a time is on the device (see :func:`gather`).
    """
    keep = not rank0_only or (dist.get_rank() if rt.mesh is not None else rt.rank) == 0  # hybrid: global rank 0
    out: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor | None] = {}  # id(parameter or buffer) -> its full tensor (None: not kept)
    failed: list[Exception] = []  # this rank's first error of its own (a page-in, a copy to the CPU)
    for key, value in rt.model.state_dict(keep_vars=True).items():
        if id(value) not in done:
            rec = rt._by_id.get(id(value))
            full = None
            if rec is not None:
                full = _full_parameter(rt, rec, keep and not failed, failed)
            elif keep and not failed:
                full = _local(failed, lambda: value.detach().clone())
            if full is not None and rank0_only:
                full = _local(failed, lambda: full.to("cpu"))
            done[id(value)] = full
        if keep:
            out[key] = done[id(value)]
    with agreed(groups_of(rt), "rt.full_state_dict()"):  # [Note: a full state dict one rank cannot read]
        if failed:
            raise failed[0]
    return out


def _local(failed: list, make):
    """``make()``, or None with its error appended to ``failed`` (this rank's own failure, agreed later)."""
    try:
        return make()
    except Exception as exc:  # noqa: BLE001 - kept, agreed over the ranks, then raised on every rank
        failed.append(exc)
        return None


def _full_parameter(rt, rec, keep: bool, failed: list) -> torch.Tensor | None:
    """``rec``'s full value (None unless ``keep``); this rank joins the gather even when its shard
    cannot be read, with zeros in its place (see [Note: a full state dict one rank cannot read]).

    [Note: a full state dict one rank cannot read]
    An offloaded shard is paged in for its gather (see [Note: streaming through the tier]), and a
    page-in, or rank 0's copy of a full tensor to the CPU, can fail on one rank only (its disk, its
    memory). That rank does not leave the gathers: the peers would wait in the next one for
    ``collective_timeout``. It sends zeros for every shard it could not read, keeps nothing more, and
    after the last gather the ranks agree the outcome (:func:`paramfsm.sharding.rank_errors.agreed`): every
    rank raises, and none returns a state dict with a stand-in in it. Errors of the gathers
    themselves (RankDesync, CollectiveTimeout) are the ranks' together and are raised at once.
    """
    scope = rt.scheduler.shard_scope((rec,), write=False)  # [Note: streaming through the tier]
    try:
        scope.__enter__()
    except Exception as exc:  # noqa: BLE001 - this rank's page-in: agreed after the last gather
        failed.append(exc)
        gather(rt, rec, torch.zeros(rec.shard_numel, dtype=rec.shard.dtype, device=rec.shard.device),
               PARAMETER, keep=False)
        return None
    try:
        return gather(rt, rec, rec.shard, PARAMETER, keep=keep)
    finally:
        scope.__exit__(None, None, None)


def load_full_state_dict(rt, state_dict) -> None:
    """Load a plain (full) state dict: each rank keeps its slice of every parameter. No collective.

    A tied parameter is loaded from whichever of its keys is present (a file
    written by ``save_pretrained`` keeps only one of them); when several are,
    they must agree. Every key and shape is checked before any value is
    written. Only this rank's slice of each tensor is read, through a view, so
    memory-mapped tensors (``safetensors.safe_open``, ``torch.load(mmap=True)``)
    are not copied whole.
    """
    rt.flush()
    rt.scheduler.release_forward_holds()  # kept for a backward the load makes stale: see paramfsm.engine.schedule.reshard
    busy = [rec.name for rec in rt._by_id.values() if rec.state is not State.NOT_AVAILABLE]
    if busy:
        raise ParamFSMError(f"cannot load a state dict while parameters are gathered: {busy[:5]}; "
                            "call it between iterations")
    own = rt.model.state_dict(keep_vars=True)
    sources: dict[int, tuple[str, torch.Tensor]] = {}
    for key, value in own.items():
        if key in state_dict:
            first = sources.setdefault(id(value), (key, state_dict[key]))
            if first[1] is not state_dict[key] and not torch.equal(first[1], state_dict[key]):
                raise ParamFSMError(f"state dict keys '{first[0]}' and '{key}' name one tied parameter "
                                    "but hold different values; keep one of them")
    missing = [key for key, value in own.items() if id(value) not in sources]
    if missing:
        raise ParamFSMError(f"state dict is missing keys {missing[:5]} (rank {rt.rank})")
    for ident, (key, src) in sources.items():  # every shape first: nothing is written unless all fit
        rec = rt._by_id.get(ident)
        shape = tuple(rec.shape) if rec is not None else tuple(own[key].shape)
        if tuple(src.shape) != shape:
            raise ParamFSMError(f"'{key}': shape {tuple(src.shape)} does not match the "
                                f"{'parameter' if rec is not None else 'buffer'}'s {shape} (rank {rt.rank})")
    records = tuple(rt._by_id.values())
    # Offloaded shards are paged in one at a time below (see [Note: streaming through the tier]).
    rt.scheduler.shards_written(records, records, "rt.load_full_state_dict()", paging=False)
    with meta.setting_values(rt, "rt.load_full_state_dict"), torch.no_grad():
        for ident, (key, src) in sources.items():
            rec = rt._by_id.get(ident)
            if rec is None:
                own[key].copy_(src)
                continue
            lo = min(rt.rank * rec.shard_numel, rec.numel)
            hi = min(lo + rec.shard_numel, rec.numel)
            with rt.scheduler.shard_scope((rec,), write=True):
                rec.shard[hi - lo:].zero_()
                rec.shard[: hi - lo].copy_(src.reshape(-1)[lo:hi])  # a view of a contiguous (memory-mapped) tensor
