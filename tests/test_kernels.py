"""Tests of the gather/scatter packing ops that run without a GPU.

The torch implementation is checked against a naive per-parameter reference
(pad, chunk, concatenate in plain loops). The CUDA source is checked twice
without a GPU: it must compile to sm_90 PTX with every entry point, and a host
build of it (the kernels use no shared memory or block synchronisation, so
running each thread in turn is a faithful emulation) must match the torch path
bit for bit, driven through the same metadata and pointer tables as the CuPy
path.
"""

from __future__ import annotations

import ctypes
import dataclasses
import re
import shutil
import subprocess
from pathlib import Path
from typing import Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import paramfsm.engine.effects.kernels as kernels
from paramfsm.engine.effects.kernels import ShardLayout, cupy_impl, shard_layout, torch_impl

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
KERNEL_DIR = Path(cupy_impl.__file__).parent

numel_st = st.one_of(
    st.integers(0, 40),
    st.sampled_from([1, 2, 3, 5, 7, 11, 13, 31, 97, 127, 257]),
    st.integers(41, 600),
)
numels_st = st.lists(numel_st, min_size=1, max_size=8)
world_st = st.integers(1, 5)
dtype_st = st.sampled_from(DTYPES)
seed_st = st.integers(0, 2**31 - 1)


def make_params(numels: list[int], dtype: torch.dtype, seed: int) -> list[torch.Tensor]:
    """Random parameters with varied shapes; values exactly representable in dtype."""
    gen = torch.Generator().manual_seed(seed)
    params = []
    for n in numels:
        p = (torch.randn(n, generator=gen) * 8).to(dtype)
        params.append(p.view(n, 1) if n % 2 else p)
    return params


def naive_shards(param: Optional[torch.Tensor], n: int, world: int, dtype: torch.dtype):
    """Rank shards of one parameter: flatten, zero-pad to world * s, chunk."""
    s = -(-n // world)
    flat = torch.zeros(n, dtype=dtype) if param is None else param.reshape(-1).to(dtype)
    padded = torch.cat([flat, torch.zeros(world * s - n, dtype=dtype)])
    return [padded[r * s : (r + 1) * s] for r in range(world)]


def naive_collective_buffer(params, numels, world, dtype) -> torch.Tensor:
    """The [rank][param-shard] buffer built one rank and one parameter at a time."""
    per_param = [naive_shards(p, n, world, dtype) for p, n in zip(params, numels)]
    pieces = []
    for r in range(world):
        for shards in per_param:
            pieces.append(shards[r])
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bit pattern of t, so comparisons distinguish -0.0 and NaN payloads."""
    return t.reshape(-1).view(torch.int32 if t.element_size() == 4 else torch.int16)


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype
    assert actual.numel() == expected.numel()
    assert torch.equal(bits(actual), bits(expected)), (actual, expected)


def nan_filled(shape, dtype) -> torch.Tensor:
    """A NaN-filled buffer, so any position an op fails to write is caught."""
    size = (shape,) if isinstance(shape, int) else shape
    return torch.full(size, float("nan"), dtype=dtype)


# --------------------------------------------------------------------------- layout


@given(numels=numels_st, world=world_st)
@settings(max_examples=50, deadline=None)
def test_shard_layout_matches_definition(numels, world):
    layout = shard_layout(numels, world)
    assert layout.numels == tuple(numels)
    assert layout.world == world
    for n, s in zip(numels, layout.shard_numels):
        assert s * world >= n
        assert s == 0 or (s - 1) * world < n
    offset = 0
    for s, off in zip(layout.shard_numels, layout.offsets):
        assert off == offset
        offset += s
    assert layout.total == offset
    assert layout.gathered_numel == world * offset


def test_shard_layout_is_cached_frozen_and_slotted():
    layout = shard_layout([10, 3], 4)
    assert shard_layout((10, 3), 4) is layout
    assert layout.shard_numels == (3, 1)
    assert layout.offsets == (0, 3)
    assert layout.total == 4
    assert not hasattr(layout, "__dict__")
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.total = 5  # type: ignore[misc]
    assert isinstance(layout, ShardLayout)


def test_shard_layout_rejects_bad_input():
    with pytest.raises(ValueError):
        shard_layout([3], 0)
    with pytest.raises(ValueError):
        shard_layout([-1], 2)


# --------------------------------------------------------------------------- torch path


@pytest.mark.parametrize("impl", [torch_impl, kernels], ids=["torch_impl", "dispatch"])
@given(numels=numels_st, world=world_st, src=dtype_st, dst=dtype_st, seed=seed_st)
@settings(max_examples=40, deadline=None)
def test_pack_shards_matches_reference(impl, numels, world, src, dst, seed):
    params = make_params(numels, src, seed)
    layout = shard_layout(numels, world)
    for rank in range(world):
        shards = [naive_shards(p, n, world, src)[rank] for p, n in zip(params, numels)]
        out = nan_filled(layout.total, dst)
        assert impl.pack_shards(shards, out) is out
        expected = torch.cat(shards).to(dst) if shards else torch.zeros(0, dtype=dst)
        assert_bits_equal(out, expected)


@pytest.mark.parametrize("impl", [torch_impl, kernels], ids=["torch_impl", "dispatch"])
@given(numels=numels_st, world=world_st, src=dtype_st, dst=dtype_st, seed=seed_st)
@settings(max_examples=40, deadline=None)
def test_unpack_gathered_matches_reference(impl, numels, world, src, dst, seed):
    params = make_params(numels, src, seed)
    layout = shard_layout(numels, world)
    gathered = naive_collective_buffer(params, numels, world, src)
    outs = [nan_filled(p.shape, dst) for p in params]
    impl.unpack_gathered(gathered, outs, layout.shard_numels, world)
    for out, p in zip(outs, params):
        assert out.shape == p.shape
        assert_bits_equal(out, p.to(dst))


@given(numels=numels_st, world=world_st, wire=dtype_st, dst=dtype_st, seed=seed_st)
@settings(max_examples=40, deadline=None)
def test_round_trip_through_simulated_all_gather(numels, world, wire, dst, seed):
    params = make_params(numels, torch.float32, seed)
    layout = shard_layout(numels, world)
    sends = []
    for rank in range(world):
        shards = [naive_shards(p, n, world, torch.float32)[rank] for p, n in zip(params, numels)]
        sends.append(kernels.pack_shards(shards, torch.empty(layout.total, dtype=wire)))
    gathered = torch.cat(sends)
    outs = [nan_filled(p.shape, dst) for p in params]
    kernels.unpack_gathered(gathered, outs, layout.shard_numels, world)
    for out, p in zip(outs, params):
        assert_bits_equal(out, p.to(wire).to(dst))
        if wire == dst == torch.float32:
            assert torch.equal(out, p)


@pytest.mark.parametrize("impl", [torch_impl, kernels], ids=["torch_impl", "dispatch"])
@given(
    numels=numels_st,
    world=world_st,
    src=dtype_st,
    dst=dtype_st,
    seed=seed_st,
    missing=st.lists(st.booleans(), min_size=8, max_size=8),
)
@settings(max_examples=40, deadline=None)
def test_pack_grads_matches_per_rank_shards(impl, numels, world, src, dst, seed, missing):
    grads = [None if m else g for g, m in zip(make_params(numels, src, seed), missing)]
    layout = shard_layout(numels, world)
    out = nan_filled(layout.gathered_numel, dst)
    assert impl.pack_grads(grads, layout.shard_numels, world, out) is out
    for rank in range(world):
        mine = out[rank * layout.total : (rank + 1) * layout.total]
        expected = [naive_shards(g, n, world, src)[rank] for g, n in zip(grads, numels)]
        assert_bits_equal(mine, torch.cat(expected).to(dst))
        for g, n, s, off in zip(grads, numels, layout.shard_numels, layout.offsets):
            valid = 0 if g is None else min(max(n - rank * s, 0), s)
            pad = mine[off + valid : off + s]
            assert torch.equal(bits(pad), torch.zeros_like(bits(pad)))


def test_pack_grads_padding_is_zero_for_tiny_params():
    out = nan_filled(4 * 3, torch.bfloat16)
    grads = [torch.tensor([1.0]), torch.tensor([2.0, 3.0]), None]
    torch_impl.pack_grads(grads, [1, 1, 1], 4, out)
    expected = torch.tensor([1, 2, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0], dtype=torch.bfloat16)
    assert_bits_equal(out, expected)


@given(numels=st.lists(st.one_of(st.integers(1, 40), st.integers(41, 600)), min_size=1, max_size=24),
       world=st.integers(2, 5), dtype=dtype_st, seed=seed_st, transposed=st.booleans())
@settings(max_examples=40, deadline=None)
def test_chunked_grad_packing_matches_reference(numels, world, dtype, seed, transposed):
    """The one-op packing (torch._chunk_cat) that the dispatcher takes on the CPU when every gradient
    is non-empty and of the buffer's dtype: the same bits as the per-rank reference, zero padding."""
    grads = make_params(numels, dtype, seed)
    if transposed:  # a non-contiguous gradient is flattened in its logical order
        grads = [g.reshape(2, -1).t() if g.numel() % 2 == 0 else g for g in grads]
    layout = shard_layout(numels, world)
    expected = naive_collective_buffer(grads, numels, world, dtype)
    out = nan_filled(layout.gathered_numel, dtype)
    assert torch_impl.pack_grads_chunked(grads, world, out) is out
    assert_bits_equal(out, expected)
    out = nan_filled(layout.gathered_numel, dtype)
    assert kernels.pack_grads(grads, layout.shard_numels, world, out) is out
    assert_bits_equal(out, expected)


@given(numels=st.lists(numel_st, min_size=1, max_size=40), world=world_st, dtype=dtype_st, seed=seed_st)
@settings(max_examples=40, deadline=None)
def test_unpack_to_views_matches_reference(numels, world, dtype, seed):
    """A gathered bucket unpacked into one buffer (one split_with_sizes_copy, or one index_select for
    many small parameters): every view holds its parameter's value, with its shape, contiguous."""
    params = make_params(numels, dtype, seed)
    layout = shard_layout(numels, world)
    gathered = naive_collective_buffer(params, numels, world, dtype)
    views = kernels.unpack_to_views(gathered, layout, [p.shape for p in params])
    assert len(views) == len(params)
    for view, param in zip(views, params):
        assert view.shape == param.shape and view.is_contiguous()
        assert_bits_equal(view, param)


def test_size_mismatches_raise():
    with pytest.raises(ValueError):
        torch_impl.unpack_gathered(torch.zeros(8), [torch.zeros(5)], [2], 3)
    with pytest.raises(ValueError):
        torch_impl.unpack_gathered(torch.zeros(7), [torch.zeros(5)], [3], 2)
    with pytest.raises(ValueError):
        torch_impl.pack_grads([torch.zeros(5)], [3], 2, torch.zeros(5))
    with pytest.raises(ValueError):
        torch_impl.pack_grads([torch.zeros(5), None], [3], 2, torch.zeros(6))
    with pytest.raises(ValueError):
        torch_impl.pack_shards([torch.zeros(5)], torch.zeros(4))


# --------------------------------------------------------------------------- CUDA source


@pytest.fixture(scope="module")
def nvcc() -> str:
    path = shutil.which("nvcc")
    if path is None:
        pytest.skip("nvcc not found on PATH; cannot check that pack.cu compiles")
    return path


def test_kernel_names_cover_every_op_and_dtype_pair():
    names = cupy_impl.kernel_names()
    suffixes = ("f32", "bf16", "f16")
    expected = {
        f"pfsm_{op}_{s}_{d}"
        for op in ("pack_shards", "unpack_gathered", "pack_grads")
        for s in suffixes
        for d in suffixes
    }
    assert set(names) == expected and len(names) == 27


def test_cuda_source_compiles_to_sm90_ptx(nvcc, tmp_path):
    src = tmp_path / "pack.cu"
    src.write_text(cupy_impl.kernel_source())
    ptx = tmp_path / "pack.ptx"
    options = [o for o in cupy_impl.COMPILE_OPTIONS if o.startswith("-D")]
    cmd = [nvcc, "-ptx", "-arch=sm_90", "-std=c++17", *options, str(src), "-o", str(ptx)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    text = ptx.read_text()
    entries = {line.split()[2].rstrip("(") for line in text.splitlines() if ".entry" in line}
    assert entries >= set(cupy_impl.kernel_names()), sorted(set(cupy_impl.kernel_names()) - entries)
    assert "ld.global.v4" in text or "ld.global.nc.v4" in text, "expected vectorised loads"
    # A register array indexed at run time spills to local memory, which cost the
    # misaligned unpack path half its bandwidth on an H200 (31% -> 71% of a copy once removed).
    assert ".local" not in text, "a kernel uses local memory (a spilled array)"


EMULATION_HARNESS = r"""
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#ifndef __global__
#define __global__
#endif
#ifndef __device__
#define __device__
#endif
#ifndef __forceinline__
#define __forceinline__ inline
#endif
#define __launch_bounds__(n)
#define __builtin_assume(x) ((void)0)
#define __isGlobal(p) true
struct pfsm_emu_dim { unsigned int x; };
static pfsm_emu_dim pfsm_emu_block, pfsm_emu_thread, pfsm_emu_grid, pfsm_emu_bdim;
#define blockIdx pfsm_emu_block
#define threadIdx pfsm_emu_thread
#define gridDim pfsm_emu_grid
#define blockDim pfsm_emu_bdim
#include "pack.cu"
typedef void (*pfsm_emu_fn)(const long long*, long long, const long long*, long long, long long,
                            long long);
extern "C" void pfsm_emu_launch(void* fn, unsigned grid, unsigned block, const long long* meta,
                                long long nparams, const long long* ptrs, long long base,
                                long long total, long long tile) {
    pfsm_emu_grid.x = grid;
    pfsm_emu_bdim.x = block;
    for (unsigned b = 0; b < grid; ++b) {
        for (unsigned t = 0; t < block; ++t) {
            pfsm_emu_block.x = b;
            pfsm_emu_thread.x = t;
            reinterpret_cast<pfsm_emu_fn>(fn)(meta, nparams, ptrs, base, total, tile);
        }
    }
}
"""


class HostKernels:
    """pack.cu built for the host, launched like cupy_impl launches it on a GPU."""

    def __init__(self, lib: ctypes.CDLL, tile: int, grid: int, block: int):
        self.lib, self.tile, self.grid, self.block = lib, tile, grid, block
        self.lib.pfsm_emu_launch.restype = None
        i64, ptr = ctypes.c_longlong, ctypes.c_void_p
        self.lib.pfsm_emu_launch.argtypes = [
            ptr, ctypes.c_uint, ctypes.c_uint, ptr, i64, ptr, i64, i64, i64,
        ]  # fmt: skip

    def launch(self, op, src, dst, layout, tensors, absent, base, default):
        rows, tiles = cupy_impl.build_metadata(layout, self.tile)
        meta = torch.tensor(rows, dtype=torch.int64)
        if tiles[cupy_impl.OPS.index(op)] == 0:
            return
        for dtype, ptrs in cupy_impl._dtype_groups(tensors, absent, default):
            s, d = (dtype, dst) if src is None else (src, dtype)
            fn = ctypes.cast(getattr(self.lib, cupy_impl.kernel_name(op, s, d)), ctypes.c_void_p)
            table = torch.tensor(ptrs, dtype=torch.int64)
            self.lib.pfsm_emu_launch(
                fn, self.grid, self.block, meta.data_ptr(), len(layout.numels),
                table.data_ptr(), base, layout.total, self.tile,
            )  # fmt: skip

    def pack_shards(self, shards, out):
        layout = shard_layout([s.numel() for s in shards], 1)
        self.launch("pack_shards", None, out.dtype, layout, shards, -1, out.data_ptr(), out.dtype)

    def unpack_gathered(self, gathered, outs, world):
        layout = shard_layout([o.numel() for o in outs], world)
        base = gathered.data_ptr()
        self.launch("unpack_gathered", gathered.dtype, None, layout, outs, -1, base, gathered.dtype)

    def pack_grads(self, grads, numels, world, out):
        layout = shard_layout(numels, world)
        self.launch("pack_grads", None, out.dtype, layout, grads, 0, out.data_ptr(), out.dtype)


def cuda_include_dirs(nvcc: str) -> list[str]:
    """Header directories nvcc itself passes to the host compiler."""
    proc = subprocess.run(
        [nvcc, "--dryrun", "-x", "cu", "-c", "/dev/null", "-o", "/dev/null"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    dirs: list[str] = []
    for line in (proc.stdout + proc.stderr).splitlines():
        if "INCLUDES=" in line:
            dirs += re.findall(r'(?:-I|-isystem)\s*"?([^"\s]+)', line.split("INCLUDES=", 1)[1])
    return dirs


@pytest.fixture(scope="module")
def host_lib(tmp_path_factory, nvcc) -> ctypes.CDLL:
    cxx = shutil.which("g++") or shutil.which("c++")
    includes = cuda_include_dirs(nvcc)
    if cxx is None or not any((Path(d) / "cuda_bf16.h").exists() for d in includes):
        pytest.skip("host emulation needs a C++ compiler and the CUDA headers")
    build = tmp_path_factory.mktemp("pack_host")
    (build / "emu.cpp").write_text(EMULATION_HARNESS)
    lib = build / "pack_host.so"
    cmd = [
        cxx, "-O1", "-std=c++17", "-fno-strict-aliasing", "-shared", "-fPIC",
        *(f"-I{d}" for d in includes), f"-I{KERNEL_DIR}", str(build / "emu.cpp"), "-o", str(lib),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return ctypes.CDLL(str(lib))


@given(
    numels=numels_st,
    world=world_st,
    src=dtype_st,
    dst=dtype_st,
    seed=seed_st,
    mixed=st.booleans(),
    missing=st.lists(st.booleans(), min_size=8, max_size=8),
    tile=st.sampled_from([1, 5, 8, 64, 4096]),
    grid=st.integers(1, 7),
    block=st.sampled_from([1, 3, 32]),
)
@settings(max_examples=60, deadline=None)
def test_host_build_of_cuda_source_matches_torch(
    host_lib, numels, world, src, dst, seed, mixed, missing, tile, grid, block
):
    host = HostKernels(host_lib, tile, grid, block)
    layout = shard_layout(numels, world)
    params = make_params(numels, src, seed)
    # With ``mixed`` every other parameter uses another dtype, which takes the
    # one-launch-per-dtype path with skipped entries.
    other = DTYPES[(DTYPES.index(src) + 1) % 3]
    per_param = [other if mixed and i % 2 else src for i in range(len(numels))]
    params = [p.to(t) for p, t in zip(params, per_param)]
    rank = seed % world
    shards = [naive_shards(p, n, world, p.dtype)[rank].clone() for p, n in zip(params, numels)]
    out, ref = nan_filled(layout.total, dst), nan_filled(layout.total, dst)
    host.pack_shards(shards, out)
    assert_bits_equal(out, torch_impl.pack_shards(shards, ref))

    gathered = naive_collective_buffer(params, numels, world, src)
    outs = [nan_filled(p.shape, t) for p, t in zip(params, per_param)]
    refs = [nan_filled(p.shape, t) for p, t in zip(params, per_param)]
    host.unpack_gathered(gathered, outs, world)
    torch_impl.unpack_gathered(gathered, refs, layout.shard_numels, world)
    for o, r in zip(outs, refs):
        assert_bits_equal(o, r)

    grads = [None if m else p for p, m in zip(params, missing)]
    out, ref = nan_filled(layout.gathered_numel, dst), nan_filled(layout.gathered_numel, dst)
    host.pack_grads(grads, numels, world, out)
    torch_impl.pack_grads(grads, layout.shard_numels, world, ref)
    assert_bits_equal(out, ref)


def test_metadata_counts_tiles_per_op():
    layout = shard_layout([10, 0, 1, 9], 4)
    rows, tiles = cupy_impl.build_metadata(layout, tile=2)
    p = len(layout.numels)
    assert rows[:p] == [3, 0, 1, 3]
    assert rows[p : 2 * p] == [10, 0, 1, 9]
    assert rows[2 * p : 3 * p] == [0, 3, 3, 4]
    assert rows[3 * p : 4 * p] == [2, 0, 1, 2]
    # pack: one rank segment each; unpack: only ranks holding data
    # (10 -> ranks of 3,3,3,1 elements = 2+2+2+1 tiles; 1 -> 1; 9 -> 3,3,3 = 6);
    # pack_grads: every rank of every non-empty parameter.
    assert tiles == (5, 7 + 1 + 6, 4 * 5)
    assert len(rows) == 4 * p + 3 * (p + 1)
