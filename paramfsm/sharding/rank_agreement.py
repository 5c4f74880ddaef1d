"""Same model on every rank: ``shard()`` checks it with one small collective, or makes it so.

Sharding assumes every rank holds the same model: rank r keeps slice r of
every parameter, and the n-th all-gather of every rank is the same gather.
A rank built with another layer count or width would pair collectives of
different sizes (gloo aborts the process, NCCL may hang) or, worse, pair
gathers of the same size for different parameters. A rank whose values
differ (seeded by rank) would silently train a model stitched from every
rank's slices, which no rank ever had.

:func:`agree` runs inside ``paramfsm.shard``, before the shards are cut:

* one all-gather of three 64-bit words per rank: a hash of the structure
  (every parameter's qualified name, shape, dtype and which parameter it is
  tied to) and a fingerprint of the values. Different structures raise
  :class:`ModelMismatch` on every rank (all ranks see every hash, so they all
  raise), naming the first difference after one more exchange of the
  descriptions, which only a failing check pays for. Different values warn
  (:class:`RanksDiffer`): loading weights on one rank and then
  ``rt.load_full_state_dict`` is a legitimate pattern, so it is not an error.
  The warning says how to fix it: the same seed on every rank, or
  ``sync_module_states=True``. Parameters on the meta device have no values
  and are not fingerprinted.
* then ``sync_module_states=True`` broadcasts rank 0's parameters and
  buffers, as FSDP1 and DDP do, so every rank starts from rank 0's values.
  The structures are checked first: ranks holding different models would
  pair broadcasts of different tensors (gloo aborts or blocks), where the
  check raises ModelMismatch on every rank.

Hybrid sharding checks the shard group and the replicate group alike.
"""

from __future__ import annotations

import hashlib
import struct

import torch
import torch.distributed as dist
from torch import nn

from paramfsm.errors import ModelMismatch, warn_at_caller


class RanksDiffer(UserWarning):
    """The ranks hold the same model with different values."""


def describe(model: nn.Module) -> list[tuple]:
    """(name, shape, dtype, tied-to) for every parameter, duplicates included, in model order."""
    first: dict[int, str] = {}
    rows = []
    for name, param in model.named_parameters(remove_duplicate=False):
        tied = first.setdefault(id(param), name)
        rows.append((name, tuple(param.shape), str(param.dtype), tied if tied != name else ""))
    return rows


def fingerprint(model: nn.Module) -> float:
    """A cheap summary of the parameter values: equal on ranks whose values are bit-identical."""
    sums = []
    for i, param in enumerate(model.parameters()):
        if param.device.type == "meta" or not param.is_floating_point():
            continue  # no values yet, or a parameter shard() refuses anyway
        data = param.detach()
        sums.append((i + 1) * data.sum(dtype=torch.float64) + torch.linalg.vector_norm(data, 1, dtype=torch.float64))
    return float(torch.stack([s.cpu() for s in sums]).sum()) if sums else 0.0


def agree(model: nn.Module, groups, device, *, sync_module_states: bool) -> None:
    """Check that every rank of ``groups`` holds this model, then broadcast rank 0's values (when asked).

    ``groups``: process groups (None: the default group) over which the model is sharded or replicated.
    """
    groups = [g for g in groups if dist.get_world_size(g) > 1]
    if not groups:
        return
    rows = describe(model)
    digest = hashlib.sha256(repr(rows).encode()).digest()
    words = list(struct.unpack("<qq", digest[:16])) + list(struct.unpack("<q", struct.pack("<d", fingerprint(model))))
    mine = torch.tensor(words, dtype=torch.int64, device=device if device.type != "meta" else "cpu")
    for group in groups:
        world = dist.get_world_size(group)
        gathered = [torch.empty_like(mine) for _ in range(world)]
        dist.all_gather(gathered, mine, group=group)
        rank = dist.get_rank(group)
        if any(not torch.equal(g[:2], mine[:2]) for g in gathered):
            _raise_mismatch(rows, rank, world, group)
        if any(not torch.equal(g[2:], mine[2:]) for g in gathered) and not sync_module_states:
            differing = [r for r, g in enumerate(gathered) if not torch.equal(g[2:], gathered[0][2:])]
            warn_at_caller(RanksDiffer(
                f"paramfsm.shard: the ranks hold the same model with different values (ranks {differing} differ "
                "from rank 0), so each rank would keep its slice of its own values and the model trained "
                "would be stitched together from several. What to do: seed every rank alike before "
                "building the model (torch.manual_seed(seed), the same seed everywhere), or pass "
                "paramfsm.shard(model, sync_module_states=True) to start from rank 0's values; if you load "
                "weights afterwards (rt.load_full_state_dict), ignore this warning."))
    if sync_module_states:  # only once the structures agree: different models would pair different broadcasts
        for group in groups:
            broadcast_states(model, group)


def broadcast_states(model: nn.Module, group) -> None:
    """Every parameter and buffer of ``model`` takes the values of the group's rank 0."""
    src = dist.get_global_rank(group, 0) if group is not None else 0
    seen: set[int] = set()
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            if id(tensor) in seen or tensor.device.type == "meta":
                continue
            seen.add(id(tensor))
            dist.broadcast(tensor.data, src=src, group=group)


def _raise_mismatch(rows: list[tuple], rank: int, world: int, group) -> None:
    everyone: list = [None] * world
    dist.all_gather_object(everyone, rows, group=group)
    for other in range(world):
        if everyone[other] != rows:
            difference = first_difference(rows, everyone[other])
            raise ModelMismatch(
                f"paramfsm.shard: rank {rank} and rank {other} hold different models: {difference}. "
                "Every rank must build the same model (the same layer count, widths, dtypes and tied "
                "weights) before paramfsm.shard; build it from the same configuration on every rank.")


def first_difference(mine: list[tuple], theirs: list[tuple]) -> str:
    """The first parameter where two descriptions differ, in words."""
    for a, b in zip(mine, theirs):
        if a == b:
            continue
        if a[0] != b[0]:
            return f"parameter #{mine.index(a)} is '{a[0]}' here and '{b[0]}' there"
        what = ("shape", "dtype", "tying")
        for field, x, y in zip(what, a[1:], b[1:]):
            if x != y:
                return f"parameter '{a[0]}' has {field} {x or 'untied'} here and {y or 'untied'} there"
    if len(mine) != len(theirs):
        longer, here = (mine, "here") if len(mine) > len(theirs) else (theirs, "there")
        extra = longer[min(len(mine), len(theirs))][0]
        return (f"{len(mine)} parameters here and {len(theirs)} there; the first extra one, '{extra}', "
                f"exists only {here}")
    return "their descriptions differ"
