"""Gradient accumulation at world 2: what one optimizer step costs with and without gradient sync per micro-batch.

For accumulation 1, 4 and 8 micro-batches per optimizer step, on the tiny
model (200 x Linear(8, 8)) and the big one (16 x Linear(1024, 1024)), batch 32
per micro-batch and rank, SGD: reduce-scatters and their input bytes per
optimizer step, all-gathers per step, the median step time and the peak
resident memory of rank 0 above its baseline. Six ways:

* ``pfsm sync``: paramfsm, every micro-batch's backward reduce-scatters;
* ``pfsm no_sync``: the first K-1 micro-batches under ``rt.no_sync()``;
* ``pfsm no_sync keep``: the same with ``reshard_after_forward=False``;
* ``FSDP2 sync``, ``FSDP2 no-sync`` (``set_requires_gradient_sync(False)``
  for the first K-1), ``FSDP2 no-sync keep`` (``reshard_after_forward=False``
  per layer): ``fully_shard`` per layer and on the root.

Ratios are against FSDP2 with the same recipe, measured in the same run. Each
way runs in a fresh pair of processes (accumulation 1, 4, 8 in turn), whose
baseline is taken after imports and before the model is built; the peak is
reset (``/proc/self/clear_refs``) after one unmeasured step, so it is the
high-water mark (``VmHWM``) of the measured steps. FSDP2's collectives are
counted by wrapping ``torch.distributed``'s ``all_gather_single`` and ``reduce_scatter_single``.

A second table (``--root``) answers whether keeping the root unit gathered
from its forward to its backward (FSDP2's default) pays off here: one
micro-batch per step, every unit resharded against the root kept, with the
default units and with ``units=paramfsm.by_size(min_bytes=1 MiB)``.

    python benchmarks/accumulation.py [--steps 3] [--models a,b] [--root]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory import _reset_peak, _status_kib  # noqa: E402 - the same peak measurement as memory.py
from step_overhead import BATCH, MODELS, build  # noqa: E402 - the same models

from paramfsm.verify.launch import RankPool  # noqa: E402

ACCUMULATION = (1, 4, 8)
WAYS = ("pfsm sync", "pfsm no_sync", "pfsm no_sync keep", "FSDP2 sync", "FSDP2 no-sync", "FSDP2 no-sync keep")


def _baseline():
    import paramfsm.runtime  # noqa: F401 - every job imports the same modules before its baseline
    from torch.distributed.fsdp import fully_shard  # noqa: F401

    return _status_kib("VmRSS")


def _counting_fsdp2():
    """Count FSDP2's all-gathers and reduce-scatters (calls and input bytes) by wrapping torch.distributed."""
    import torch.distributed as dist

    counts = {"all_gathers": 0, "reduce_scatters": 0, "reduced_bytes": 0}
    gather, scatter = dist.all_gather_single, dist.reduce_scatter_single

    def all_gather_single(*args, **kwargs):
        counts["all_gathers"] += 1
        return gather(*args, **kwargs)

    def reduce_scatter_single(*args, **kwargs):
        inp = kwargs["input"] if "input" in kwargs else args[1]
        counts["reduce_scatters"] += 1
        counts["reduced_bytes"] += inp.numel() * inp.element_size()
        return scatter(*args, **kwargs)

    dist.all_gather_single, dist.reduce_scatter_single = all_gather_single, reduce_scatter_single
    return counts


def _prepare(way: str, name: str, world: int):
    """The model, its optimizer, a no-sync context factory and a counter reader for one way."""
    model = build(name)
    if way.startswith("pfsm"):
        import paramfsm

        rt = paramfsm.shard(model, reshard_after_forward=not way.endswith("keep"))
        quiet = rt.no_sync if "no_sync" in way else contextlib.nullcontext
        return model, torch.optim.SGD(model.parameters(), lr=1e-3), quiet, lambda: dict(rt.counters), rt.close
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    counts = _counting_fsdp2()
    mesh = init_device_mesh("cpu", (world,))
    keep = way.endswith("keep")
    for layer in model:
        fully_shard(layer, mesh=mesh, reshard_after_forward=not keep)
    fully_shard(model, mesh=mesh, reshard_after_forward=not keep)

    @contextlib.contextmanager
    def no_sync():
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)

    quiet = no_sync if "no-sync" in way else contextlib.nullcontext
    return model, torch.optim.SGD(model.parameters(), lr=1e-3), quiet, lambda: dict(counts), lambda: None


def way_job(rank, world, way: str, name: str, steps: int) -> list:
    """Every accumulation of ``ACCUMULATION`` for one way: (k, seconds, per-step counts, peak MiB)."""
    baseline = _baseline()
    rows = []
    width = MODELS[name][1]
    for k in ACCUMULATION:
        model, opt, quiet, counters, close = _prepare(way, name, world)
        x = torch.randn(BATCH, width)
        times, before = [], None
        for i in range(steps + 1):
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            for micro in range(k):
                with quiet() if micro < k - 1 else contextlib.nullcontext():
                    model(x).pow(2).mean().backward()
            opt.step()
            if i == 0:
                _reset_peak()
                before = counters()
            else:
                times.append(time.perf_counter() - start)
        after = counters()
        per_step = {key: (after[key] - before[key]) / steps for key in ("all_gathers", "reduce_scatters",
                                                                          "reduced_bytes")}
        rows.append((k, statistics.median(times), per_step, (_status_kib("VmHWM") - baseline) / 1024))
        close()
        del model, opt
    return rows


def root_job(rank, world, name: str, by_size: bool, keep_root: bool, steps: int):
    import paramfsm

    model = build(name)
    units = paramfsm.by_size(min_bytes=1 << 20) if by_size else None
    policy = (lambda unit, module: unit != "") if keep_root else True
    rt = paramfsm.shard(model, units=units, reshard_after_forward=policy)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(BATCH, MODELS[name][1])
    times = []
    for i in range(steps + 3):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        opt.step()
        if i == 2:
            before = rt.counters["all_gathers"]
        elif i > 2:
            times.append(time.perf_counter() - start)
    gathers = (rt.counters["all_gathers"] - before) / steps
    root = sum(rec.numel for unit in rt.units if unit.module is model for rec in unit.records)
    rt.close()
    return statistics.median(times), gathers, root


def print_root(args) -> None:
    print(f"\n{'model, units':<34}{'root unit':>12}{'resharded ms':>14}{'root kept ms':>14}{'kept/resh':>11}"
          f"{'AG/step':>9}{'AG kept':>9}")
    with RankPool(2) as two:
        for name in args.models:
            for by_size in (False, True):
                rounds = {False: [], True: []}
                for _ in range(3):  # interleaved rounds, best of each
                    for keep in (False, True):
                        rounds[keep].append(two.run(root_job, name, by_size, keep, 20 if name == "a" else 5)[0])
                (resh, ag, _), (kept, ag_kept, root) = (min(rounds[k]) for k in (False, True))
                label = f"({name}) {'by_size(1 MiB)' if by_size else 'a unit per Linear'}"
                print(f"{label:<34}{root:>12}{resh * 1e3:>14.2f}{kept * 1e3:>14.2f}{kept / resh:>11.2f}"
                      f"{ag:>9.1f}{ag_kept:>9.1f}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="measured optimizer steps per accumulation")
    parser.add_argument("--models", default="a,b", help="comma-separated: a (tiny), b (big)")
    parser.add_argument("--root", action="store_true", help="also the root-exception table")
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    results = {}
    for name in args.models:
        for way in WAYS:
            print(f"model ({name}): {way} ...", file=sys.stderr, flush=True)
            with RankPool(2) as two:
                results[name, way] = two.run(way_job, way, name, args.steps)[0]
    print(f"{'model':<6}{'way':<20}{'K':>3}{'RS/step':>9}{'RS MiB/step':>13}{'AG/step':>9}{'step ms':>10}"
          f"{'vs FSDP2':>10}{'peak MiB':>10}{'vs FSDP2':>10}")
    for name in args.models:
        for way in WAYS:
            twin = way if way.startswith("FSDP2") else "FSDP2 " + {"pfsm sync": "sync", "pfsm no_sync": "no-sync"}.get(
                way, "no-sync keep")
            for (k, seconds, per_step, peak), (_, base_s, _, base_peak) in zip(results[name, way],
                                                                              results[name, twin]):
                print(f"({name})  {way:<20}{k:>3}{per_step['reduce_scatters']:>9.1f}"
                      f"{per_step['reduced_bytes'] / 2 ** 20:>13.2f}{per_step['all_gathers']:>9.1f}"
                      f"{seconds * 1e3:>10.1f}{seconds / base_s:>10.2f}{peak:>10.1f}"
                      f"{peak / base_peak if base_peak > 0 else float('nan'):>10.2f}")
    if args.root:
        print_root(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
