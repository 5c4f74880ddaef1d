"""CuPy kernels against the torch path on a CUDA device, bit for bit.

Skipped unless CuPy and a CUDA device are available.
"""

from __future__ import annotations

import itertools
import types

import pytest
import torch

import paramfsm.engine.effects.kernels as kernels
from paramfsm.engine.effects.kernels import cupy_impl, shard_layout, torch_impl

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not kernels.kernels_available(), reason="needs CuPy (cupy-cuda13x) and a CUDA device"
    ),
]

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
PAIRS = list(itertools.product(DTYPES, DTYPES))
PAIR_IDS = [f"{str(s)[6:]}->{str(d)[6:]}" for s, d in PAIRS]

_GEN = torch.Generator().manual_seed(0)
SHAPE_SETS = {
    "tiny": [(1,), (2,), (3,), (5,)],
    "odd": [(7, 3), (97,), (1,), (4097,), (12289,), (3, 5, 7)],
    "aligned": [(1024, 64), (4096,), (64,)],
    "many_small": [(n,) for n in torch.randint(1, 3000, (300,), generator=_GEN).tolist()],
    "large": [(1 << 20,), (3 << 18, 5), (999_999,)],
}


@pytest.fixture
def no_fallback(monkeypatch):
    """Make any fallback to the torch path inside cupy_impl fail the test."""

    def refuse(*args, **kwargs):
        raise AssertionError("cupy_impl fell back to the torch path")

    stub = types.SimpleNamespace(pack_shards=refuse, unpack_gathered=refuse, pack_grads=refuse)
    monkeypatch.setattr(cupy_impl, "torch_impl", stub)


def test_every_entry_point_compiles_with_nvrtc():
    cupy_impl.compile_kernels()
    for op in cupy_impl.OPS:
        for src in DTYPES:
            for dst in DTYPES:
                assert cupy_impl._kernel(op, src, dst) is not None


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.int32 if t.element_size() == 4 else torch.int16)


def assert_bits_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.equal(bits(actual), bits(expected))


def random_params(shapes, dtype, seed=0):
    """Random CUDA parameters with infinities and a negative zero mixed in."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.randn(shape, device="cuda", generator=gen) * 16
        flat = p.view(-1)
        flat[0] = float("inf")
        flat[flat.numel() // 2] = -0.0
        flat[-1] = float("-inf") if flat.numel() > 2 else flat[-1]
        params.append(p.to(dtype))
    return params


def shards_of(params, world, rank):
    out = []
    for p in params:
        n = p.numel()
        s = -(-n // world)
        padded = torch.zeros(world * s, dtype=p.dtype, device=p.device)
        padded[:n] = p.view(-1)
        out.append(padded[rank * s : (rank + 1) * s].clone())
    return out


@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("shapes", list(SHAPE_SETS.values()), ids=list(SHAPE_SETS))
@pytest.mark.parametrize("src,dst", PAIRS, ids=PAIR_IDS)
def test_kernels_match_torch_bit_for_bit(src, dst, shapes, world, no_fallback):
    params = random_params(shapes, src)
    layout = shard_layout([p.numel() for p in params], world)

    rank = world - 1
    shards = shards_of(params, world, rank)
    got = torch.full((layout.total,), float("nan"), dtype=dst, device="cuda")
    ref = torch.full_like(got, float("nan"))
    cupy_impl.pack_shards(shards, got)
    torch_impl.pack_shards(shards, ref)
    assert_bits_equal(got, ref)

    gathered = torch.randn(layout.gathered_numel, device="cuda").to(src)
    outs = [torch.full(p.shape, float("nan"), dtype=dst, device="cuda") for p in params]
    refs = [o.clone() for o in outs]
    cupy_impl.unpack_gathered(gathered, outs, layout.shard_numels, world)
    torch_impl.unpack_gathered(gathered, refs, layout.shard_numels, world)
    for o, r in zip(outs, refs):
        assert_bits_equal(o, r)

    grads = [None if i % 5 == 3 else p for i, p in enumerate(params)]
    got = torch.full((layout.gathered_numel,), float("nan"), dtype=dst, device="cuda")
    ref = torch.full_like(got, float("nan"))
    cupy_impl.pack_grads(grads, layout.shard_numels, world, got)
    torch_impl.pack_grads(grads, layout.shard_numels, world, ref)
    assert_bits_equal(got, ref)


@pytest.mark.parametrize("offset", [1, 2, 3])
def test_misaligned_storage_uses_scalar_path_correctly(offset, no_fallback):
    base = torch.randn(50_000 + offset, device="cuda")
    shards = [base[offset : offset + 20_001], base[offset + 20_001 : offset + 50_000]]
    got = torch.empty(50_001, dtype=torch.bfloat16, device="cuda")[1:]
    cupy_impl.pack_shards(shards, got)
    assert_bits_equal(got, torch.cat(shards).to(torch.bfloat16))


def test_mixed_output_dtypes_and_repeated_calls(no_fallback):
    world = 4
    params = random_params([(1001,), (64, 33), (5,), (4096,)], torch.float32, seed=1)
    layout = shard_layout([p.numel() for p in params], world)
    gathered = torch.randn(layout.gathered_numel, device="cuda")
    dtypes = [torch.bfloat16, torch.float32, torch.float16, torch.bfloat16]
    for _ in range(3):
        outs = [
            torch.full(p.shape, float("nan"), dtype=d, device="cuda")
            for p, d in zip(params, dtypes)
        ]
        refs = [o.clone() for o in outs]
        kernels.unpack_gathered(gathered, outs, layout.shard_numels, world)
        torch_impl.unpack_gathered(gathered, refs, layout.shard_numels, world)
        for o, r in zip(outs, refs):
            assert_bits_equal(o, r)
        gathered.mul_(-1)


def test_launch_is_ordered_on_the_current_stream(no_fallback):
    side = torch.cuda.Stream()
    shard = torch.zeros(1 << 20, device="cuda")
    out = torch.empty(1 << 20, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)
        shard.fill_(3.0)
        kernels.pack_shards([shard], out)
    side.synchronize()
    assert torch.all(out == 3.0)


def test_version_counters_are_bumped():
    params = random_params([(10,), (7,)], torch.float32)
    layout = shard_layout([10, 7], 2)
    gathered = torch.randn(layout.gathered_numel, device="cuda")
    before = [p._version for p in params]
    cupy_impl.unpack_gathered(gathered, params, layout.shard_numels, 2)
    assert all(p._version > v for p, v in zip(params, before))


def test_non_contiguous_inputs_fall_back_to_torch():
    base = torch.randn(40, device="cuda")
    shards = [base[::2], base[1::4]]
    got = torch.empty(30, device="cuda", dtype=torch.float16)
    cupy_impl.pack_shards(shards, got)
    assert_bits_equal(got, torch.cat([shards[0], shards[1]]).half())
