"""Offload on one GPU against FSDP2's ``CPUOffloadPolicy``, and the memory plan against the allocator.

One process, a one-rank group (NCCL on CUDA; ``--device cpu`` runs the same code on gloo as a smoke
test, without the memory figures). Every variant trains the same stack of Linear layers with AdamW,
in this run:

* ``no offload``: ``paramfsm.shard(model)`` (the baseline of every ratio);
* ``paramfsm, optimizer+grads on cpu``: ``Offload(optimizer="cpu", grads="cpu")``, copies on the
  current stream;
* the same with ``copy_stream=True`` (host-tier copies on a stream of their own);
* ``FSDP2 CPUOffloadPolicy``: ``fully_shard`` per layer and at the root, parameters, gradients and
  the optimizer step on the host (a one-rank paramfsm cannot move its parameters off the device:
  there a parameter is a view of its shard, so the rows differ in what the device holds; the
  memory column says by how much).

For each: the median step time over ``--steps`` after ``--warmup``, and the peak device memory of
the measured steps (``torch.cuda.max_memory_allocated``, reset before them). Then, for the paramfsm
rows, the plan's peak (``paramfsm.plan`` on the same model, world 1, with the measured activations)
beside that allocator peak, and their ratio.

    python benchmarks/offload_gpu.py [--width 4096] [--depth 8] [--steps 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

try:
    import paramfsm
except ImportError:  # a source checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import paramfsm


def stack(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth)])


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(model, opt, x, device, steps: int, warmup: int) -> tuple[float, int | None]:
    """Median step time (ms) and the device's peak bytes over the measured steps."""
    def step():
        opt.zero_grad(set_to_none=True)
        model(x).float().pow(2).mean().backward()
        opt.step()
    for _ in range(warmup):
        step()
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        _sync(device)
        times.append((time.perf_counter() - start) * 1e3)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    return statistics.median(times), peak


def paramfsm_row(base, x, device, args, offload):
    model = copy.deepcopy(base).to(device)
    rt = paramfsm.shard(model, offload=offload)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ms, peak = timed(model, opt, x, device, args.steps, args.warmup)
    rt.close()
    plan = paramfsm.plan(copy.deepcopy(base), world_size=1, optimizer="adamw", offload=offload,
                         example_input=x.cpu())
    planned = max(plan.with_activations(peak) for peak in plan.phases)
    return {"ms": ms, "peak": peak, "planned": planned}


def fsdp2_row(base, x, device, args):
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    model = copy.deepcopy(base).to(device)
    for layer in model:
        fully_shard(layer, offload_policy=CPUOffloadPolicy())
    fully_shard(model, offload_policy=CPUOffloadPolicy())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ms, peak = timed(model, opt, x, device, args.steps, args.warmup)
    return {"ms": ms, "peak": peak, "planned": None}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    base = stack(args.width, args.depth)
    x = torch.randn(args.batch, args.width, device=device)
    rows = {}
    variants = {
        "no offload": lambda: paramfsm_row(base, x, device, args, None),
        "paramfsm, optimizer+grads on cpu": lambda: paramfsm_row(
            base, x, device, args, paramfsm.Offload(optimizer="cpu", grads="cpu")),
        "paramfsm, optimizer+grads on cpu, copy stream": lambda: paramfsm_row(
            base, x, device, args, paramfsm.Offload(optimizer="cpu", grads="cpu", copy_stream=True)),
        "FSDP2 CPUOffloadPolicy": lambda: fsdp2_row(base, x, device, args),
    }
    for name, run in variants.items():
        try:
            rows[name] = run()
        except Exception as exc:  # noqa: BLE001 - a variant that cannot run is a row that says why
            rows[name] = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    baseline = rows["no offload"].get("ms")
    print(f"| variant | step ms | x no offload | peak device MiB | planned MiB | plan / peak |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, row in rows.items():
        if "error" in row:
            print(f"| {name} | {row['error']} | | | | |")
            continue
        peak, planned = row["peak"], row["planned"]
        mib = lambda n: f"{n / 2**20:.0f}" if n is not None else "-"  # noqa: E731
        ratio = f"{planned / peak:.3f}" if peak and planned else "-"  # the allocator's caching is not planned
        print(f"| {name} | {row['ms']:.2f} | {row['ms'] / baseline:.2f}x | {mib(peak)} | {mib(planned)} | {ratio} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    dist.destroy_process_group()
    return 0 if all("error" not in row for name, row in rows.items() if name != "FSDP2 CPUOffloadPolicy") else 1


if __name__ == "__main__":
    raise SystemExit(main())
