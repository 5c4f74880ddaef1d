"""Throughput of the gather/scatter packing ops for one unit's collectives.

Measures pack_shards (fp32 shards -> wire-dtype send buffer), unpack_gathered
(wire-dtype gathered buffer -> full parameters in the wire dtype) and
pack_grads (wire-dtype gradients -> fp32 reduce-scatter input) for

* ``small``: 1,000 parameters of 4K-64K elements (fixed seed), where per-tensor
  launch and Python overhead dominates, and
* ``large``: 8 parameters, 64M elements in total (times ``--scale``), where
  memory bandwidth dominates,

with four methods: the CuPy kernel (CUDA with CuPy only), the torch path, a
naive per-tensor loop (one pad/narrow/copy per parameter, as FSDP2-style
per-tensor packing does), and one contiguous copy of the same number of
elements and dtypes (the practical limit). Reported bandwidth counts the bytes
each op must read and write; "vs copy" is the single copy's time divided by the
method's time.

Usage: python benchmarks/gather_scatter.py [--device cpu|cuda] [--world 2]
       [--scale S] [--repeats N] [--wire-dtype bfloat16] [--threads N]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

try:
    import paramfsm  # noqa: F401
except ImportError:
    # Allow running from a source checkout that is not installed.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paramfsm.engine.effects.kernels import cupy_impl, kernels_available, shard_layout, torch_impl  # noqa: E402

LARGE_TOTAL = 64 * 1024 * 1024


@dataclass
class Case:
    """One unit's tensors for every op, preallocated outside the timed region."""

    name: str
    world: int
    shards: list[torch.Tensor]
    send: torch.Tensor
    gathered: torch.Tensor
    outs: list[torch.Tensor]
    grads: list[torch.Tensor]
    reduce_in: torch.Tensor

    @property
    def layout(self):
        return shard_layout([o.numel() for o in self.outs], self.world)


def make_case(name: str, numels: list[int], world: int, wire: torch.dtype, device: str) -> Case:
    layout = shard_layout(numels, world)
    gen = torch.Generator().manual_seed(1)
    shards = [torch.randn(s, generator=gen).to(device) for s in layout.shard_numels]
    return Case(
        name=name,
        world=world,
        shards=shards,
        send=torch.empty(layout.total, dtype=wire, device=device),
        gathered=torch.randn(layout.gathered_numel, generator=gen).to(device, wire),
        outs=[torch.empty(n, dtype=wire, device=device) for n in numels],
        grads=[torch.randn(n, generator=gen).to(device, wire) for n in numels],
        reduce_in=torch.empty(layout.gathered_numel, dtype=torch.float32, device=device),
    )


def small_numels() -> list[int]:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(4096, 65537, (1000,), generator=gen).tolist()


def large_numels(scale: float) -> list[int]:
    # Four big matrices and four smaller ones; the +1s make most sizes odd so
    # padding is exercised.
    weights = [6, 6, 6, 6, 3, 3, 1, 1]
    total = int(LARGE_TOTAL * scale)
    return [max(1, total * w // sum(weights) + (i % 2)) for i, w in enumerate(weights)]


# --------------------------------------------------------------------------- naive per-tensor loops


def naive_pack_shards(case: Case) -> None:
    dsts = torch.split_with_sizes(case.send, case.layout.shard_numels)
    for shard, dst in zip(case.shards, dsts):
        dst.copy_(shard)


def naive_unpack_gathered(case: Case) -> None:
    layout = case.layout
    g2d = case.gathered.view(case.world, layout.total)
    for out, n, s, off in zip(case.outs, layout.numels, layout.shard_numels, layout.offsets):
        out.view(-1).copy_(g2d[:, off : off + s].reshape(-1)[:n])


def naive_pack_grads(case: Case) -> None:
    layout = case.layout
    o2d = case.reduce_in.view(case.world, layout.total)
    for grad, n, s, off in zip(case.grads, layout.numels, layout.shard_numels, layout.offsets):
        padded = F.pad(grad.reshape(-1), (0, case.world * s - n))
        o2d[:, off : off + s].copy_(padded.view(case.world, s))


# --------------------------------------------------------------------------- op table


Methods = dict[str, Callable[[], object]]


def op_methods(case: Case, use_kernel: bool) -> dict[str, tuple[int, Methods, tuple]]:
    """Per op: useful bytes moved, the methods to time, and the single-copy shape."""
    layout = case.layout
    sn, world = layout.shard_numels, case.world
    n_params = sum(layout.numels)
    wire, src32 = case.send.element_size(), 4
    ops = {
        "pack_shards": (
            layout.total * (src32 + wire),
            {
                "kernel": lambda: cupy_impl.pack_shards(case.shards, case.send),
                "torch": lambda: torch_impl.pack_shards(case.shards, case.send),
                "naive": lambda: naive_pack_shards(case),
            },
            (layout.total, torch.float32, case.send.dtype),
        ),
        "unpack_gathered": (
            n_params * 2 * wire,
            {
                "kernel": lambda: cupy_impl.unpack_gathered(case.gathered, case.outs, sn, world),
                "torch": lambda: torch_impl.unpack_gathered(case.gathered, case.outs, sn, world),
                "naive": lambda: naive_unpack_gathered(case),
            },
            (n_params, case.gathered.dtype, case.gathered.dtype),
        ),
        "pack_grads": (
            n_params * wire + layout.gathered_numel * 4,
            {
                "kernel": lambda: cupy_impl.pack_grads(case.grads, sn, world, case.reduce_in),
                "torch": lambda: torch_impl.pack_grads(case.grads, sn, world, case.reduce_in),
                "naive": lambda: naive_pack_grads(case),
            },
            (layout.gathered_numel, case.send.dtype, torch.float32),
        ),
    }
    if not use_kernel:
        for _, methods, _ in ops.values():
            del methods["kernel"]
    return ops


def check_outputs(case: Case) -> bool:
    """Kernel results equal the torch path's, bit for bit (CUDA only)."""
    ok = True
    send = torch_impl.pack_shards(case.shards, case.send.clone())
    ok &= torch.equal(cupy_impl.pack_shards(case.shards, case.send), send)
    refs = [o.clone() for o in case.outs]
    torch_impl.unpack_gathered(case.gathered, refs, case.layout.shard_numels, case.world)
    cupy_impl.unpack_gathered(case.gathered, case.outs, case.layout.shard_numels, case.world)
    ok &= all(torch.equal(a, b) for a, b in zip(case.outs, refs))
    sn, w = case.layout.shard_numels, case.world
    ref = torch_impl.pack_grads(case.grads, sn, w, case.reduce_in.clone())
    ok &= torch.equal(cupy_impl.pack_grads(case.grads, sn, w, case.reduce_in), ref)
    return bool(ok)


def time_ms(fn: Callable[[], object], device: str, repeats: int, warmup: int = 2) -> float:
    """Median wall time of one call, synchronising the device around each call."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def run(device: str, world: int, scale: float, repeats: int, wire: torch.dtype) -> None:
    use_kernel = device == "cuda" and kernels_available()
    torch.manual_seed(0)
    print(
        f"device={device} world={world} wire={str(wire)[6:]} repeats={repeats} "
        f"scale={scale} threads={torch.get_num_threads()}"
    )
    if not use_kernel:
        why = "not a CUDA run" if device != "cuda" else "CuPy or a CUDA device is missing"
        print(f"CuPy kernels skipped ({why}); timing torch paths only")
    cases = [
        make_case("small(1000)", small_numels(), world, wire, device),
        make_case(
            f"large(8, {int(LARGE_TOTAL * scale) / 2**20:.1f}M)",
            large_numels(scale),
            world,
            wire,
            device,
        ),
    ]
    header = f"{'case':<18}{'op':<17}{'method':<8}{'ms':>10}{'GB/s':>10}{'vs copy':>9}"
    print(header)
    print("-" * len(header))
    for case in cases:
        if use_kernel and not check_outputs(case):
            print(f"{case.name}: kernel output differs from the torch path")
        for op, (nbytes, methods, (n, src, dst)) in op_methods(case, use_kernel).items():
            a = torch.randn(n, device=device).to(src)
            b = torch.empty(n, dtype=dst, device=device)
            base_ms = time_ms(lambda: b.copy_(a), device, repeats)
            del a, b
            rows = [(m, time_ms(fn, device, repeats)) for m, fn in methods.items()]
            rows.append(("copy", base_ms))
            for method, ms in rows:
                gbps = nbytes / (ms * 1e-3) / 1e9
                ratio = base_ms / ms
                print(f"{case.name:<18}{op:<17}{method:<8}{ms:>10.3f}{gbps:>10.1f}{ratio:>9.2f}")
        del case


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", choices=("cpu", "cuda"), default=default_device)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument(
        "--scale",
        type=float,
        default=None,
        help="fraction of the 64M-element large case (default: 1 on cuda, 1/8 on cpu)",
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="timed calls per method (median reported)"
    )
    parser.add_argument(
        "--wire-dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads (default: torch's choice); 1 gives stable CPU timings "
        "on a loaded machine, where multi-threaded copies wait on descheduled workers",
    )
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda requested but torch sees no CUDA device")
    scale = args.scale if args.scale is not None else (1.0 if args.device == "cuda" else 0.125)
    repeats = args.repeats if args.repeats is not None else (20 if args.device == "cuda" else 5)
    run(args.device, args.world, scale, repeats, getattr(torch, args.wire_dtype))


if __name__ == "__main__":
    main()
