"""``rt.gathered(*modules, writeback=True)``: full parameters outside forward, and writes that stick.

Inside the block every parameter of the chosen units is AVAILABLE: its
``.data`` is the full tensor, so code written for plain torch reads it and
writes it in place (weight surgery, a manual re-init, an EMA written back).
With ``writeback=True`` (the default, as FSDP's ``summon_full_params``) the
parameters whose full tensor changed are written back into the shards when
the block ends, on every rank:

* a change is an in-place write (it moves the parameter's version counter)
  or ``p.data = t`` with a tensor of the same shape and dtype; a ``.data`` of
  another shape or dtype raises :class:`~paramfsm.errors.ParamFSMError` naming the
  parameter, since a partitioned parameter keeps its shape;
* every rank must make the same change: one small all-gather compares a
  fingerprint of each parameter's new values across ranks, and a parameter
  written differently (or on some ranks only) raises on every rank, naming it,
  with nothing written back;
* under ``param_dtype`` the full tensor is a low-precision compute copy, so
  writing it back would round the shard silently: a change then raises,
  naming :meth:`Runtime.load_full_state_dict` as the way to set full-precision values;
* an exception inside the block writes nothing back on any rank: the rank
  that raised takes part in the agreement with every parameter marked as
  raised, so the other ranks raise too, naming it, instead of waiting for it
  in the all-gather ([Note: an error one rank meets] in
  :mod:`paramfsm.sharding.rank_errors`).

``p.grad`` inside the block stays this rank's shard gradient, as outside it
(see :mod:`paramfsm.engine.storage.partitioned`): zeroing and clamping reach it,
reading it as a full gradient raises ``NotGathered``, and assigning a full-size
gradient raises. ``writeback=False`` is the read-only block, at no cost beyond
the gather (at world 1, where a parameter is a view of its shard, one copy of
the chosen shards: [Note: a block at world 1 writes nothing it should not]).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from paramfsm.core.spec import State
from paramfsm.engine.storage import placeholder
from paramfsm.engine.effects.lost_writes import acknowledge
from paramfsm.engine.storage.units import units_within
from paramfsm.errors import ParamFSMError

UNCHANGED, CHANGED, INVALID, RAISED = 0, 1, 2, 3
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@contextlib.contextmanager
def gathered(rt, modules, writeback: bool = True):
    """Hold the units of ``modules`` (all if none) gathered for the block; see the module docstring."""
    if not isinstance(writeback, bool):
        raise ParamFSMError(f"rt.gathered(writeback={writeback!r}): expected True or False")
    chosen = units_within(rt.model, rt.units, modules)
    held = []
    try:
        for unit in chosen:
            rt.scheduler.hold(unit)
            held.append(unit)
        before = _snapshot(chosen) if writeback else None
        kept = _shard_copies(rt, chosen)
        try:
            yield
        except Exception:
            if writeback:  # the others are about to agree their write-back: they learn of this error there
                _write_back(rt, before, raised=True)
            _put_back(kept)
            raise
        try:
            if writeback:
                _write_back(rt, before)
        except Exception:
            _put_back(kept)
            raise
        if not writeback:
            _put_back(kept)
    finally:
        # A read-only block, or one that raised before its write-back, drops what it wrote, as documented:
        # not a lost write ([Note: a write to a gathered parameter] in paramfsm.engine.effects.lost_writes).
        acknowledge(rec for unit in held for rec in unit.records)
        for unit in reversed(held):
            rt.scheduler.unhold(unit)


# [Note: a block at world 1 writes nothing it should not]
# At world 1 a gathered parameter is a view of its shard (nothing to gather: see Gathers._local_full), so an
# in-place write inside the block lands in the shard at once. A read-only block, a block that raised and a
# write-back refused must still leave the shards as they were, as at any other world size. So at world 1
# the block starts with a copy of the chosen units' shards and puts it back in those three cases: one copy
# of the chosen parameters, what their gather would hold at world 2.
def _shard_copies(rt, units) -> list:
    """At world 1 (the parameters are views of their shards), each chosen shard with a copy of its values."""
    if not rt.executor.local:
        return []
    seen = {}
    for unit in units:
        for rec in unit.records:
            if rec not in seen and rec.shard.dtype == rec.compute_dtype:  # else the view is a cast copy
                seen[rec] = rec.shard.detach().clone()
    return list(seen.items())


def _put_back(kept) -> None:
    with torch.no_grad():
        for rec, values in kept:
            rec.shard.detach().copy_(values)


def _snapshot(units) -> dict:
    """Each distinct parameter's version, storage and shape as the block begins."""
    out = {}
    for unit in units:
        for rec in unit.records:
            if rec not in out:
                data = placeholder.storage(rec.param)
                out[rec] = (rec.param._version, data.data_ptr(), tuple(data.shape), data.dtype)
    return out


def _verdict(rec, seen) -> tuple[int, int, str]:
    """(UNCHANGED | CHANGED | INVALID, fingerprint of the new values, what is wrong) for one parameter."""
    version, ptr, shape, dtype = seen
    if rec.state is not State.AVAILABLE:
        return INVALID, 0, f"it was released inside the block (state {rec.state.name})"
    data = placeholder.storage(rec.param)
    if tuple(data.shape) != shape or data.dtype != dtype:
        return INVALID, 0, (f"its .data was replaced by a {data.dtype} tensor of shape {tuple(data.shape)}; a "
                            f"partitioned parameter keeps its shape {shape} and dtype {dtype}")
    if rec.param._version == version and data.data_ptr() == ptr:
        return UNCHANGED, 0, ""
    if data.dtype != rec.shard.dtype:
        return INVALID, 0, (f"it was changed, but inside the block it is the {data.dtype} compute copy "
                            f"(param_dtype) of a {rec.shard.dtype} shard, so writing it back would round the "
                            "shard; set full-precision values with rt.load_full_state_dict(...) instead")
    return CHANGED, fingerprint(data), ""


def fingerprint(tensor: torch.Tensor) -> int:
    """A 64-bit digest of a tensor's bytes (position-weighted, wrapping): equal values give equal digests."""
    flat = tensor.detach().reshape(-1)
    bits = flat.view(_BITS[flat.element_size()]).to(torch.int64)
    weights = torch.arange(1, bits.numel() + 1, dtype=torch.int64, device=bits.device) * 0x9E3779B1
    return int((bits * weights).sum()) + bits.numel()


def _write_back(rt, before: dict, raised: bool = False) -> None:
    """Agree the changes across ranks, then write each changed parameter's slice into its shard.

    ``raised``: the block raised on this rank; it takes part in the agreement with every parameter marked
    RAISED and writes nothing, and every other rank raises, naming it (nothing is written back anywhere).
    """
    records = list(before)
    verdicts = [(RAISED, 0, "") if raised else _verdict(rec, before[rec]) for rec in records]
    device = records[0].shard.device if records else "cpu"
    codes = torch.tensor([[code, digest] for code, digest, _ in verdicts], dtype=torch.int64,
                         device=device).reshape(-1, 2)
    if rt.world > 1 and records:
        rows = [torch.empty_like(codes) for _ in range(rt.world)]
        with rt._reporting():
            dist.all_gather(rows, codes, group=rt.group)
        every = torch.stack(rows)  # (world, parameters, 2)
    else:
        every = codes.unsqueeze(0)
    if raised:
        return
    failed = [r for r in range(every.shape[0]) if records and int(every[r, 0, 0]) == RAISED]
    if failed:
        raise ParamFSMError(
            f"rt.gathered(): the block raised on rank {failed[0]} (its own error is raised there), so nothing was "
            f"written back on any rank (rank {rt.rank} raises too, instead of waiting for it). What to do: fix "
            "the error on that rank; the parameters hold their values from before the block")
    for i, rec in enumerate(records):
        column = every[:, i]
        if bool((column == column[:1]).all()) and int(column[0, 0]) != INVALID:
            continue
        raise ParamFSMError(_disagreement(rt, rec, column, verdicts[i][2]))
    changed = tuple(rec for rec, (code, _, _) in zip(records, verdicts) if code == CHANGED)
    if changed:
        rt.scheduler.write_back(changed)


def _disagreement(rt, rec, column, detail: str) -> str:
    """The message for a parameter whose write-back cannot be made the same on every rank."""
    what = {UNCHANGED: "left it unchanged", CHANGED: "changed it", INVALID: "cannot write it back"}
    ranks = ", ".join(f"rank {r} {what[int(code)]}" for r, code in enumerate(column[:, 0].tolist()))
    digests = {int(d) for c, d in column.tolist() if c == CHANGED}
    if detail:
        why = detail
    elif len(digests) > 1:
        why = "the ranks wrote different values"
    else:
        why = "only some ranks wrote it"
    return (f"rt.gathered(writeback=True) on rank {rt.rank}: parameter '{rec.name}' (unit '{rec.unit}', state "
            f"{rec.state.name}, event written_back) cannot be written back: {why} ({ranks}). Nothing was written "
            "back. What to do: make the same in-place change on every rank (seed random writes alike, or "
            "broadcast the values first), keep the parameter's shape and dtype, or use "
            "rt.gathered(writeback=False) for read-only access.")
