"""Gather/scatter packing for one unit's coalesced collectives.

A unit all-gathers its parameters in one collective and reduce-scatters their
gradients in one collective. These functions move data between the parameters'
own storages and the flat ``[rank][param-shard]`` collective buffers described
by :class:`ShardLayout`:

* :func:`pack_shards` - this rank's shards into the all-gather send buffer;
* :func:`unpack_gathered` - the all-gather result into the full parameters;
* :func:`pack_grads` - full gradients into the reduce-scatter input.

Each call dispatches on device: CUDA tensors use the CuPy kernels in
:mod:`paramfsm.engine.effects.kernels.cupy_impl` (one launch per unit) when CuPy and a CUDA
device are available, everything else uses :mod:`paramfsm.engine.effects.kernels.torch_impl`.
Both give the same bits: dtype changes go through fp32 and round to nearest
even, as torch's ``copy_`` does.
"""

from __future__ import annotations

import functools
import logging
from typing import Optional, Sequence

import torch
from torch import Tensor

from . import cupy_impl, torch_impl
from .layout import ShardLayout, shard_layout

__all__ = [
    "ShardLayout",
    "cupy_impl",
    "kernels_available",
    "pack_grads",
    "pack_shards",
    "shard_layout",
    "torch_impl",
    "unpack_gathered",
    "unpack_to_views",
]

logger = logging.getLogger(__name__)


@functools.cache
def kernels_available() -> bool:
    """Whether the CuPy kernels can run: CuPy imports and a CUDA device is present."""
    if not torch.cuda.is_available():
        return False
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception as exc:
        logger.info("CuPy kernels unavailable, using torch packing: %s", exc)
        return False


def pack_shards(shards: Sequence[Tensor], out: Tensor) -> Tensor:
    """Concatenate this rank's 1-D shards (lengths ``s_i``) into ``out``.

    ``out`` is 1-D with ``sum(s_i)`` elements; values are cast to its dtype (e.g.
    fp32 shards into a bf16 send buffer). Returns ``out``.
    """
    if out.is_cuda and kernels_available():
        return cupy_impl.pack_shards(shards, out)
    return torch_impl.pack_shards(shards, out)


def unpack_gathered(
    gathered: Tensor, outs: Sequence[Tensor], shard_numels: Sequence[int], world: int
) -> None:
    """Write each parameter's unpadded value from a ``[rank][param-shard]`` buffer.

    ``gathered`` is 1-D with ``world * sum(shard_numels)`` elements. ``outs[i]``
    is a contiguous tensor of any shape with ``n_i`` elements, where
    ``shard_numels[i] == ceil(n_i / world)``; it receives the first ``n_i``
    elements of parameter ``i``'s padded flat value, cast to its dtype.
    """
    if gathered.is_cuda and kernels_available():
        cupy_impl.unpack_gathered(gathered, outs, shard_numels, world)
    else:
        torch_impl.unpack_gathered(gathered, outs, shard_numels, world)


def unpack_to_views(gathered: Tensor, layout: ShardLayout, shapes: Sequence[torch.Size]) -> list[Tensor]:
    """Unpack a gathered bucket into ONE new buffer and return each parameter's full tensor as a view.

    One allocation per bucket instead of one per parameter. On the CPU, one op
    unpacks the whole bucket: an ``index_select`` when it holds many small
    parameters (below :data:`~paramfsm.engine.effects.kernels.torch_impl.SMALL_NUMEL`
    elements on average), else a ``torch.split_with_sizes_copy`` into a buffer
    of the parameters' padded values in turn
    (:func:`~paramfsm.engine.effects.kernels.torch_impl.unpack_padded_views`).
    """
    strides = [_contiguous_strides(shape) for shape in shapes]
    if not gathered.is_cuda:
        many = len(shapes) >= torch_impl.MANY_PARAMS
        if not many or sum(layout.numels) >= len(shapes) * torch_impl.SMALL_NUMEL:
            return torch_impl.unpack_padded_views(gathered, layout, shapes, strides)
    flat = torch.empty(sum(layout.numels), dtype=gathered.dtype, device=gathered.device)
    views, offset = [], 0
    for numel, shape, stride in zip(layout.numels, shapes, strides):
        views.append(flat.as_strided(shape, stride, offset))
        offset += numel
    if not gathered.is_cuda:
        torch_impl.unpack_gathered_flat(gathered, layout, flat)
    else:
        unpack_gathered(gathered, views, layout.shard_numels, layout.world)
    return views


@functools.lru_cache(maxsize=4096)
def _contiguous_strides(shape: tuple) -> tuple:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def pack_grads(
    grads: Sequence[Optional[Tensor]], shard_numels: Sequence[int], world: int, out: Tensor
) -> Tensor:
    """Pack full gradients into a ``[rank][param-shard]`` reduce-scatter input.

    ``grads[i]`` is a contiguous tensor with ``n_i`` elements or ``None`` (zeros);
    ``out`` is 1-D with ``world * sum(shard_numels)`` elements. Padding is written
    as zeros and values are cast to ``out.dtype``. Returns ``out``. On the CPU,
    non-empty gradients of ``out``'s dtype are packed by one ``torch._chunk_cat``
    (:func:`~paramfsm.engine.effects.kernels.torch_impl.pack_grads_chunked`).
    """
    if out.is_cuda and kernels_available():
        return cupy_impl.pack_grads(grads, shard_numels, world, out)
    dtype = out.dtype
    if not out.is_cuda and grads and all(g is not None and g.dtype == dtype and g.numel() for g in grads):
        layout = shard_layout(tuple([g.numel() for g in grads]), world)
        if layout.shard_numels == tuple(shard_numels) and out.dim() == 1 and out.numel() == layout.gathered_numel:
            return torch_impl.pack_grads_chunked(grads, world, out)
    return torch_impl.pack_grads(grads, shard_numels, world, out)
