"""CuPy RawKernel implementation of the packing ops: one launch per unit.

The CUDA source (``pack.cu``, shipped next to this module) defines one
``extern "C"`` entry point per (op, source dtype, destination dtype), named
``pfsm_<op>_<src>_<dst>``. Each launch covers every parameter of the unit; the
kernel reads per-parameter sizes from an int64 metadata array that is built once
per :class:`~paramfsm.engine.effects.kernels.layout.ShardLayout` and kept on the device, plus a
small table of per-parameter addresses (data pointers are shared with torch, no
copies). See ``pack.cu`` for the tiling scheme.

CuPy is imported lazily, so this module imports on machines without it; the
functions themselves need CuPy and a CUDA device. Anything the kernels do not
cover (non-contiguous tensors, other dtypes, tensors on another device, a
failed compile) is routed to :mod:`paramfsm.engine.effects.kernels.torch_impl`.
"""

from __future__ import annotations

import functools
import importlib.resources
import logging
import threading
import warnings
from collections import OrderedDict
from itertools import accumulate
from typing import Any, Optional, Sequence

import torch
from torch import Tensor
from torch.autograd.graph import increment_version

from . import torch_impl
from .layout import ShardLayout, check_buffer, shard_layout

__all__ = [
    "BLOCK",
    "COMPILE_OPTIONS",
    "DTYPE_SUFFIX",
    "OPS",
    "TILE",
    "build_metadata",
    "compile_kernels",
    "kernel_name",
    "kernel_names",
    "kernel_source",
    "pack_grads",
    "pack_shards",
    "unpack_gathered",
]

logger = logging.getLogger(__name__)

OPS = ("pack_shards", "unpack_gathered", "pack_grads")
DTYPE_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
TILE = 8192
BLOCK = 256
BLOCKS_PER_SM = 8
SKIP = -1
# The fp16/bf16 conversion constructors are not used; disabling them decouples
# cuda_fp16.h (which CuPy bundles) from cuda_bf16.h (taken from the toolkit), a
# known source of NVRTC errors when their versions differ.
COMPILE_OPTIONS = (
    "--std=c++17",
    "-D__CUDA_NO_HALF_CONVERSIONS__",
    "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
)
_POINTER_TABLES_KEPT = 64

_lock = threading.Lock()
_kernels: dict[tuple[str, torch.dtype, torch.dtype], Any] = {}
_compile_failed = False
_device_meta: dict[tuple[int, int], tuple[ShardLayout, Tensor, tuple[int, int, int]]] = {}
_streams: dict[tuple[int, int], Any] = {}
_pointer_tables: OrderedDict[tuple[int, int, tuple[int, ...]], Tensor] = OrderedDict()


def kernel_name(op: str, src: torch.dtype, dst: torch.dtype) -> str:
    """Entry point name in ``pack.cu`` for ``op`` reading ``src`` and writing ``dst``."""
    return f"pfsm_{op}_{DTYPE_SUFFIX[src]}_{DTYPE_SUFFIX[dst]}"


def kernel_names() -> tuple[str, ...]:
    """All entry point names ``pack.cu`` must define."""
    return tuple(kernel_name(op, s, d) for op in OPS for s in DTYPE_SUFFIX for d in DTYPE_SUFFIX)


@functools.cache
def kernel_source() -> str:
    """Text of ``pack.cu``, read from the installed package."""
    return importlib.resources.files(__package__).joinpath("pack.cu").read_text(encoding="utf-8")


def build_metadata(layout: ShardLayout, tile: int = TILE) -> tuple[list[int], tuple[int, int, int]]:
    """Host-side metadata for ``pack.cu`` and the tile count of each op.

    Returns the flat int64 rows ``[seg | numel | offset | tiles-per-rank |
    prefix(pack_shards) | prefix(unpack_gathered) | prefix(pack_grads)]`` and the
    total tiles per op, in ``OPS`` order. A tile is at most ``tile`` elements of
    one rank segment; unpack skips the ranks (and tail tiles) that hold only
    padding, pack_grads covers them because padding must be zeroed.
    """
    segs, numels, world = layout.shard_numels, layout.numels, layout.world
    per_rank = [-(-s // tile) for s in segs]
    unpack_tiles = []
    for n, s, c in zip(numels, segs, per_rank):
        if n == 0:
            unpack_tiles.append(0)
            continue
        ranks = -(-n // s)
        last = n - (ranks - 1) * s
        unpack_tiles.append((ranks - 1) * c + -(-last // tile))
    counts = (per_rank, unpack_tiles, [world * c for c in per_rank])
    prefixes = [[0, *accumulate(c)] for c in counts]
    rows = [*segs, *numels, *layout.offsets, *per_rank]
    for prefix in prefixes:
        rows.extend(prefix)
    return rows, (prefixes[0][-1], prefixes[1][-1], prefixes[2][-1])


@functools.cache
def _max_blocks(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count * BLOCKS_PER_SM


def _metadata(layout: ShardLayout, device: torch.device) -> tuple[Tensor, tuple[int, int, int]]:
    # [Note: metadata lifetime]
    # The upload is a blocking copy (pageable host memory, non_blocking=False),
    # which synchronises the current stream, so once it returns the tensor is
    # valid for kernels on any stream. It is never freed: layouts are cached for
    # the life of the process, and so is their metadata. Freeing it could hand
    # the block to the allocator while a kernel on another stream still reads
    # it, since the caching allocator only orders reuse on the allocating stream.
    key = (id(layout), device.index)
    hit = _device_meta.get(key)
    if hit is not None and hit[0] is layout:
        return hit[1], hit[2]
    rows, tiles = build_metadata(layout)
    meta = torch.tensor(rows, dtype=torch.int64).to(device)
    with _lock:
        _device_meta[key] = (layout, meta, tiles)
    return meta, tiles


def _pointer_table(
    ptrs: tuple[int, ...], device: torch.device, stream: torch.cuda.Stream
) -> Tensor:
    # [Note: pointer table ordering]
    # The table is uploaded with a non-blocking copy from pinned memory on the
    # same stream the kernel is launched on, so the kernel sees it complete
    # without a host sync. torch's pinned-memory allocator records the copy on
    # that stream and does not recycle the host buffer before the copy is done,
    # so the host tensor may be dropped right away. Tables are cached per
    # (device, stream, pointers): units usually pass the same storages every
    # step. A cached table is only ever read on the stream that uploaded it, so
    # evicting (freeing) one is ordered after its last use by the allocator.
    key = (device.index, stream.cuda_stream, ptrs)
    with _lock:
        table = _pointer_tables.get(key)
        if table is not None:
            _pointer_tables.move_to_end(key)
            return table
    host = torch.tensor(ptrs, dtype=torch.int64, pin_memory=True)
    table = host.to(device, non_blocking=True)
    with _lock:
        _pointer_tables[key] = table
        while len(_pointer_tables) > _POINTER_TABLES_KEPT:
            _pointer_tables.popitem(last=False)
    return table


def _compile(op: str, src: torch.dtype, dst: torch.dtype) -> Any:
    import cupy

    kernel = cupy.RawKernel(kernel_source(), kernel_name(op, src, dst), options=COMPILE_OPTIONS)
    kernel.compile()
    with _lock:
        _kernels[(op, src, dst)] = kernel
    return kernel


def _kernel(op: str, src: torch.dtype, dst: torch.dtype) -> Optional[Any]:
    """Compiled kernel for (op, src, dst), or ``None`` once compiling has failed."""
    global _compile_failed
    kernel = _kernels.get((op, src, dst))
    if kernel is not None or _compile_failed:
        return kernel
    try:
        return _compile(op, src, dst)
    except Exception:
        _compile_failed = True
        logger.warning("compiling pack.cu failed; packing falls back to torch ops", exc_info=True)
        return None


def compile_kernels(device: Optional[torch.device] = None) -> None:
    """Compile every entry point for ``device`` now rather than at first use.

    Useful to keep NVRTC out of the first training step. Raises whatever CuPy
    raises if the source does not compile (e.g. missing CUDA headers).
    """
    import cupy

    index = torch.cuda.current_device() if device is None else torch.device(device).index
    with cupy.cuda.Device(index):
        for op in OPS:
            for src in DTYPE_SUFFIX:
                for dst in DTYPE_SUFFIX:
                    _compile(op, src, dst)


def _cupy_stream(cupy: Any, handle: int, device_index: int) -> Any:
    """A cached CuPy wrapper of a torch stream handle, for launching on it.

    ``ExternalStream`` only records the handle (it never destroys the stream),
    so one wrapper per handle can be reused. CuPy 14 deprecates it in favour of
    ``Stream.from_external``; it is kept because it exists in every supported
    CuPy release and its lifetime semantics are plain, and the deprecation
    warning (raised once per wrapper, as wrappers are cached) is silenced.
    """
    key = (device_index, handle)
    wrapper = _streams.get(key)
    if wrapper is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            wrapper = cupy.cuda.ExternalStream(handle, device_index)
        with _lock:
            _streams[key] = wrapper
    return wrapper


def _launch(
    op: str,
    src: torch.dtype,
    dst: torch.dtype,
    layout: ShardLayout,
    ptrs: tuple[int, ...],
    base: int,
    device: torch.device,
) -> bool:
    """Launch ``op`` over the whole layout; ``False`` if no kernel is available."""
    meta, tiles = _metadata(layout, device)
    ntiles = tiles[OPS.index(op)]
    if ntiles == 0:
        return True
    import cupy
    import numpy

    with cupy.cuda.Device(device.index):
        kernel = _kernel(op, src, dst)
        if kernel is None:
            return False
        # [Note: stream]
        # The kernel runs on torch's current stream for the device, so it is
        # ordered after whatever produced its inputs (e.g. the all-gather's
        # wait) and before later torch work, like any torch op would be.
        stream = torch.cuda.current_stream(device)
        table = _pointer_table(ptrs, device, stream)
        args = (
            numpy.uint64(meta.data_ptr()),
            numpy.int64(len(layout.numels)),
            numpy.uint64(table.data_ptr()),
            numpy.int64(base),
            numpy.int64(layout.total),
            numpy.int64(TILE),
        )
        grid = min(ntiles, _max_blocks(device.index))
        with _cupy_stream(cupy, stream.cuda_stream, device.index):
            kernel((grid,), (BLOCK,), args)
    return True


def _fits(t: Tensor, device_index: int) -> bool:
    return (
        t.is_cuda
        and t.get_device() == device_index
        and t.dtype in DTYPE_SUFFIX
        and t.is_contiguous()
    )


def _dtype_groups(
    tensors: Sequence[Optional[Tensor]], absent: int, default: torch.dtype
) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    """One (dtype, pointer table) per distinct dtype, usually exactly one.

    Entries of other dtypes are ``SKIP``; ``None`` entries become ``absent`` in
    the first group and ``SKIP`` in the others.
    """
    dtypes = list(dict.fromkeys(t.dtype for t in tensors if t is not None)) or [default]
    groups = []
    for k, dtype in enumerate(dtypes):
        missing = absent if k == 0 else SKIP
        ptrs = tuple(
            missing if t is None else (t.data_ptr() if t.dtype == dtype else SKIP) for t in tensors
        )
        groups.append((dtype, ptrs))
    return groups


def pack_shards(shards: Sequence[Tensor], out: Tensor) -> Tensor:
    """Kernel version of :func:`paramfsm.engine.effects.kernels.torch_impl.pack_shards`."""
    idx = out.get_device()
    if not (shards and _fits(out, idx) and all(_fits(s, idx) for s in shards)):
        return torch_impl.pack_shards(shards, out)
    layout = shard_layout([s.numel() for s in shards], 1)
    if out.dim() != 1 or out.numel() != layout.total:
        raise ValueError(
            f"out must be 1-D with {layout.total} elements, got shape {tuple(out.shape)}"
        )
    for dtype, ptrs in _dtype_groups(shards, SKIP, out.dtype):
        if not _launch("pack_shards", dtype, out.dtype, layout, ptrs, out.data_ptr(), out.device):
            return torch_impl.pack_shards(shards, out)
    increment_version(out)
    return out


def unpack_gathered(
    gathered: Tensor, outs: Sequence[Tensor], shard_numels: Sequence[int], world: int
) -> None:
    """Kernel version of :func:`paramfsm.engine.effects.kernels.torch_impl.unpack_gathered`."""
    idx = gathered.get_device()
    if not (outs and _fits(gathered, idx) and all(_fits(o, idx) for o in outs)):
        torch_impl.unpack_gathered(gathered, outs, shard_numels, world)
        return
    layout = shard_layout([o.numel() for o in outs], world)
    check_buffer(layout, shard_numels, gathered, "gathered")
    src, base, device = gathered.dtype, gathered.data_ptr(), gathered.device
    for dtype, ptrs in _dtype_groups(outs, SKIP, src):
        if not _launch("unpack_gathered", src, dtype, layout, ptrs, base, device):
            torch_impl.unpack_gathered(gathered, outs, shard_numels, world)
            return
    increment_version(list(outs))


def pack_grads(
    grads: Sequence[Optional[Tensor]], shard_numels: Sequence[int], world: int, out: Tensor
) -> Tensor:
    """Kernel version of :func:`paramfsm.engine.effects.kernels.torch_impl.pack_grads`."""
    idx = out.get_device()
    fits = grads and _fits(out, idx) and all(g is None or _fits(g, idx) for g in grads)
    if not fits:
        return torch_impl.pack_grads(grads, shard_numels, world, out)
    if len(grads) != len(shard_numels):
        raise ValueError(f"got {len(grads)} grads for {len(shard_numels)} shard numels")
    numels = [g.numel() if g is not None else world * s for g, s in zip(grads, shard_numels)]
    layout = shard_layout(numels, world)
    check_buffer(layout, shard_numels, out, "out")
    for dtype, ptrs in _dtype_groups(grads, 0, out.dtype):
        if not _launch("pack_grads", dtype, out.dtype, layout, ptrs, out.data_ptr(), out.device):
            return torch_impl.pack_grads(grads, shard_numels, world, out)
    increment_version(out)
    return out
