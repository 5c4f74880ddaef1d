"""Pure-torch gather/scatter packing: the reference and the CPU / no-CuPy path.

Each function issues a fixed, small number of torch calls per parameter (no
per-element Python): the collective buffer is viewed as ``[world, S]`` and split
along dim 1 into per-parameter ``[world, s_i]`` blocks, and all block copies are
handed to one ``torch._foreach_copy_`` (and ``torch._foreach_zero_`` for padding)
call. A parameter whose numel is not a multiple of ``world`` contributes two
copies: its full rank rows and the partial last row, so only the first ``n_i``
elements of the padded value are ever read or written.

All functions run under ``torch.no_grad()``: packing is never part of autograd.
"""

from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch
from torch import Tensor

from .layout import check_buffer, shard_layout

__all__ = ["pack_shards", "unpack_gathered", "pack_grads", "unpack_gathered_flat", "unpack_padded_views",
           "pack_grads_chunked", "element_index"]

#: From this many parameters on, one index_select over the whole bucket beats
#: one copy per parameter (per-op dispatch dominates for small parameters).
MANY_PARAMS = 16
#: ... as long as they average fewer elements than this; larger ones unpack faster by one
#: ``split_with_sizes_copy`` (measured at world 2 on the CPU: 32 x 1,024 elements 178 us against
#: 227 us; 32 x 256, 230 us against 71 us).
SMALL_NUMEL = 1024


def _copy_all(dsts: list[Tensor], srcs: list[Tensor]) -> None:
    if dsts:
        torch._foreach_copy_(dsts, srcs)


def _zero_all(dsts: list[Tensor]) -> None:
    if dsts:
        torch._foreach_zero_(dsts)


@torch.no_grad()
def pack_shards(shards: Sequence[Tensor], out: Tensor) -> Tensor:
    """Concatenate this rank's 1-D shards into ``out``, casting to ``out.dtype``."""
    total = sum(s.numel() for s in shards)
    if out.dim() != 1 or out.numel() != total:
        raise ValueError(f"out must be 1-D with {total} elements, got shape {tuple(out.shape)}")
    if not shards:
        return out
    flat = [s if s.dim() == 1 else s.reshape(-1) for s in shards]
    if all(s.dtype == out.dtype for s in flat):
        torch.cat(flat, out=out)
    else:
        # cat into a buffer of another dtype converts through a slower generic
        # path; copying into the split views casts inside each copy instead.
        sizes = [s.numel() for s in flat]
        _copy_all(list(torch.split_with_sizes(out, sizes)), flat)
    return out


@torch.no_grad()
def unpack_gathered(
    gathered: Tensor, outs: Sequence[Tensor], shard_numels: Sequence[int], world: int
) -> None:
    """Scatter a ``[rank][param-shard]`` all-gather result into full parameters.

    ``outs[i]`` receives the first ``numel(outs[i])`` elements of parameter
    ``i``'s padded flat value, cast to its dtype; padding is dropped.
    """
    layout = shard_layout([o.numel() for o in outs], world)
    check_buffer(layout, shard_numels, gathered, "gathered")
    if not outs:
        return
    blocks = torch.split_with_sizes(gathered.view(world, layout.total), layout.shard_numels, dim=1)
    dsts: list[Tensor] = []
    srcs: list[Tensor] = []
    for out, block, n, s in zip(outs, blocks, layout.numels, layout.shard_numels):
        if n == 0:
            continue
        flat = out.view(-1)
        rows, rem = divmod(n, s)
        if rows:
            dsts.append(flat[: rows * s].view(rows, s))
            srcs.append(block[:rows])
        if rem:
            dsts.append(flat[rows * s :])
            srcs.append(block[rows, :rem])
    _copy_all(dsts, srcs)


@torch.no_grad()
def unpack_padded_views(gathered: Tensor, layout, shapes: Sequence, strides: Sequence) -> list[Tensor]:
    """A ``[rank][param-shard]`` buffer unpacked by one ``torch.split_with_sizes_copy`` (FSDP2's
    copy-out) into a new buffer that holds each parameter's padded value in turn (``world * s_i``
    elements from ``world * offsets[i]``); parameter ``i`` is the view of its first ``n_i`` elements,
    with ``shapes[i]`` and ``strides[i]``. No per-parameter copies: two views per parameter, one op.
    """
    world = layout.world
    padded = torch.empty(gathered.numel(), dtype=gathered.dtype, device=gathered.device)
    starts = [world * offset for offset in layout.offsets]
    torch.split_with_sizes_copy(gathered.view(world, layout.total), layout.shard_numels, dim=1,
                                out=[padded.as_strided((world, s), (s, 1), start)
                                     for s, start in zip(layout.shard_numels, starts)])
    return [padded.as_strided(shape, stride, start) for shape, stride, start in zip(shapes, strides, starts)]


@torch.no_grad()
def pack_grads(
    grads: Sequence[Optional[Tensor]], shard_numels: Sequence[int], world: int, out: Tensor
) -> Tensor:
    """Pack full gradients into a ``[rank][param-shard]`` reduce-scatter input.

    ``grads[i]`` (``None`` meaning zeros) is padded to ``world * s_i`` elements
    and rank ``r``'s ``s_i`` elements land at ``out[r * S + offsets[i]:]``;
    padding is written as zeros, values are cast to ``out.dtype``.
    """
    if len(grads) != len(shard_numels):
        raise ValueError(f"got {len(grads)} grads for {len(shard_numels)} shard numels")
    numels = [g.numel() if g is not None else world * s for g, s in zip(grads, shard_numels)]
    layout = shard_layout(numels, world)
    check_buffer(layout, shard_numels, out, "out")
    if not grads:
        return out
    blocks = torch.split_with_sizes(out.view(world, layout.total), layout.shard_numels, dim=1)
    dsts: list[Tensor] = []
    srcs: list[Tensor] = []
    zeros: list[Tensor] = []
    for grad, block, n, s in zip(grads, blocks, layout.numels, layout.shard_numels):
        if s == 0:
            continue
        if grad is None:
            zeros.append(block)
            continue
        flat = grad.reshape(-1)
        rows, rem = divmod(n, s)
        if rows:
            dsts.append(block[:rows])
            srcs.append(flat[: rows * s].view(rows, s))
        if rem:
            dsts.append(block[rows, :rem])
            srcs.append(flat[rows * s :])
            zeros.append(block[rows, rem:])
            rows += 1
        if rows < world:
            zeros.append(block[rows:])
    _copy_all(dsts, srcs)
    _zero_all(zeros)
    return out


@functools.lru_cache(maxsize=256)
def element_index(layout) -> Tensor:
    """For each element of the parameters' unpadded values, concatenated in order, its position
    in the ``[rank][param-shard]`` collective buffer (cached per layout)."""
    pieces = []
    for n, s, offset in zip(layout.numels, layout.shard_numels, layout.offsets):
        if n:
            e = torch.arange(n, dtype=torch.int64)
            pieces.append(torch.div(e, s, rounding_mode="floor") * layout.total + offset + e % s)
    return torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.int64)


@torch.no_grad()
def unpack_gathered_flat(gathered: Tensor, layout, out: Tensor) -> Tensor:
    """All parameters' unpadded values, concatenated, from a ``[rank][param-shard]`` buffer: one op."""
    index = element_index(layout)
    if out.dtype == gathered.dtype:
        return torch.index_select(gathered, 0, index, out=out)
    return out.copy_(gathered.index_select(0, index))


@torch.no_grad()
def pack_grads_chunked(grads: Sequence[Tensor], world: int, out: Tensor) -> Tensor:
    """:func:`pack_grads` in one ``torch._chunk_cat`` (FSDP2's packing): each flattened gradient is cut
    into ``world`` chunks of ``ceil(n_i / world)`` elements, the last ones padded with zeros, and chunk
    ``r`` of every gradient lands in row ``r`` of ``out`` viewed ``[world, S]``.

    Every gradient must be non-empty and of ``out``'s dtype (the caller checks); no per-gradient
    views, copies or zero fills in Python.
    """
    torch._chunk_cat([g.view(-1) if g.is_contiguous() else g.reshape(-1) for g in grads], 0, world,
                     out=out.view(world, -1))
    return out
