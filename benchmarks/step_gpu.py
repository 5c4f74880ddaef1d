"""Step time of the two-loss retained-graph loop on one GPU, every variant measured in one run.

The loop is the seed pattern: ``out = model(x); zero_grad(); l1.backward(retain_graph=True);
zero_grad(); l2.backward(); opt.step()``. Variants, all in this process on a
one-rank NCCL group:

* ``plain``: the unsharded model (the baseline of every ratio);
* ``paramfsm``: ``paramfsm.shard(model)`` as a one-rank user gets it (no collectives);
* ``paramfsm+comm``: the whole device path forced at world 1 (packing kernels, NCCL
  all-gather and reduce-scatter, gather and reduce streams);
* ``paramfsm+comm, one stream``: the same with every collective on the compute stream,
  to show what the side streams buy;
* ``FSDP2``: ``fully_shard`` per layer and at the root.

Rounds are interleaved and each variant keeps its best round's median, so clock
drift favours none. Prints a table, and with ``--json PATH`` writes the numbers.

    python benchmarks/step_gpu.py [--steps 20] [--warmup 5] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
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

from paramfsm.engine.effects.streams import HostStreams  # noqa: E402
from paramfsm.verify.launch import free_port  # noqa: E402
from paramfsm.testing.scenarios import force_collectives  # noqa: E402

MODELS = {"big": (16, 4096, 1024), "tiny": (200, 8, 32)}  # depth, width, batch
VARIANTS = ("plain", "paramfsm", "paramfsm+comm", "paramfsm+comm, one stream", "FSDP2")


def build(name: str, device: str) -> nn.Module:
    depth, width, _ = MODELS[name]
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(depth))).to(device)


def prepare(variant: str, name: str, device: str):
    """The model and the parameters its optimizer steps, set up as ``variant``."""
    model = build(name, device)
    if variant == "plain":
        return model, list(model.parameters()), None
    if variant == "FSDP2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(device, (dist.get_world_size(),))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, list(model.parameters()), None
    rt = paramfsm.shard(model)
    if variant != "paramfsm":
        force_collectives(rt)
    if variant.endswith("one stream"):
        rt.executor.streams = HostStreams()
    return model, rt.shard_parameters(), rt


def time_loop(model, params, name: str, device: str, steps: int, warmup: int) -> float:
    """Median milliseconds per two-loss step, the device synchronised around each step."""
    opt = torch.optim.SGD(params, lr=1e-4)
    _, width, batch = MODELS[name]
    x = torch.randn(batch, width, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times = []
    for i in range(warmup + steps):
        sync()
        start = time.perf_counter()
        out = model(x)
        l1, l2 = out.pow(2).mean(), out.abs().mean()
        opt.zero_grad(set_to_none=True)
        l1.backward(retain_graph=True)
        opt.zero_grad(set_to_none=True)
        l2.backward()
        opt.step()
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def measure(name: str, device: str, steps: int, warmup: int, rounds: int) -> dict[str, float | str]:
    best: dict[str, float | str] = {}
    for round_ in range(rounds):
        print(f"model {name}: round {round_ + 1}/{rounds}", file=sys.stderr, flush=True)
        for variant in VARIANTS:
            if isinstance(best.get(variant), str):
                continue  # it failed in an earlier round
            try:
                model, params, rt = prepare(variant, name, device)
                ms = time_loop(model, params, name, device, steps, warmup)
            except Exception as exc:  # noqa: BLE001 - a variant that cannot run is reported, not fatal
                best[variant] = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
                continue
            if rt is not None:
                rt.close()
            best[variant] = min(ms, best.get(variant, float("inf")))
            del model, params
            if device == "cuda":
                torch.cuda.empty_cache()
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--only", choices=sorted(MODELS))
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a gloo dry run of the same code (small timings mean nothing)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("step_gpu: torch sees no CUDA device", file=sys.stderr)
        return 2
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    if args.device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo", rank=0, world_size=1)
    results = {}
    try:
        for name in [args.only] if args.only else sorted(MODELS):
            results[name] = measure(name, args.device, args.steps, args.warmup, args.rounds)
    finally:
        dist.destroy_process_group()
    print(f"{'model':<8}{'variant':<28}{'ms/step':>10}{'vs plain':>10}{'vs FSDP2':>10}")
    for name, row in results.items():
        plain, fsdp2 = row.get("plain"), row.get("FSDP2")
        for variant, ms in row.items():
            if isinstance(ms, str):
                print(f"{name:<8}{variant:<28}{ms}")
                continue
            vs_plain = f"{ms / plain:>10.2f}" if isinstance(plain, float) else f"{'-':>10}"
            vs_fsdp = f"{ms / fsdp2:>10.2f}" if isinstance(fsdp2, float) else f"{'-':>10}"
            print(f"{name:<8}{variant:<28}{ms:>10.2f}{vs_plain}{vs_fsdp}")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
