"""Offload at world 2: step time, tier traffic, the I/O floor and peak anonymous memory, in one table.

Two models, each sharded over 2 gloo ranks and trained with AdamW:

* ``stack``: 16 x Linear(1024, 1024) (64 MiB of fp32 parameters);
* ``big``: 16 x Linear(4096, 4096), built on the meta device and initialised
  by ``rt.init_weights`` (1 GiB of fp32 parameters: parameters, gradients and
  AdamW state come to 2 GiB per rank).

Rows: no offload; the optimizer state offloaded to disk; parameters and
optimizer state offloaded to disk; parameters, their gradients and optimizer
state offloaded to disk (``max_resident_bytes=None``: only the values in use
and one unit paged in ahead are resident); the same with ``prefetch=0`` (no
unit gathered ahead of use: the least memory, no overlap). Columns, per rank 0:

* **step**: median seconds of the measured steps (forward, backward,
  ``opt.step()``, ``zero_grad``), after one unmeasured step;
* **read / written**: bytes the tiers moved per step (``rt.offload.traffic()``);
* **floor**: those bytes divided by this disk's sequential bandwidth, measured
  in the same run with the tier's own I/O (buffered ``pwrite`` then
  ``pread`` of a 1 GiB file in the same folder);
* **x floor**: step time over the floor;
* **peak anon**: the largest, over the ranks, of the ``VmHWM`` high-water mark
  minus the file-backed and shared resident pages (``RssFile + RssShmem``:
  code and libraries, never the page cache of the offload file), reset
  (``/proc/self/clear_refs``) before the measured steps: the anonymous memory
  the run holds at its peak, in MiB;
* **above process**: the largest, over the ranks, of that peak minus the
  process's anonymous memory (``RssAnon``) before the model was built (torch,
  gloo and paramfsm themselves);
* **plan + allowance**: the bound on that figure, the memory plan's peak of the same row
  (``paramfsm.plan`` of the meta build: every byte paramfsm holds at its largest, plus the activations
  saved for backward on the same input) + :data:`ALLOWANCE` for what is neither (autograd's temporaries,
  gloo's buffers, the allocator's own slack);
* **vs none**: step time over the row without offload of the same model.

Buffers of 64 KiB and more are mapped and unmapped one by one (``MALLOC_MMAP_THRESHOLD_``, as
``default_units.py`` does), so RSS follows the live tensors; ``--glibc-default`` leaves glibc's own
threshold, which rises to 32 MiB after the first such buffer is freed and then keeps freed buffers in its
heap, counted in RSS.

    python benchmarks/offload.py [--steps 3] [--models stack big] [--folder DIR] [--glibc-default]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from paramfsm.verify.launch import RankPool

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory import _reset_peak, _status_kib  # noqa: E402 - the same peak measurement as memory.py

MODELS = {"stack": (16, 1024), "big": (16, 4096)}
#: Row -> (params, optimizer, grads) tiers (None: no offload).
ROWS = {"none": None, "optimizer disk": (None, "disk", None), "params + optimizer disk": ("disk", "disk", None),
        "params + grads + optimizer disk": ("disk", "disk", "disk"),
        "all disk, prefetch=0": ("disk", "disk", "disk")}
#: Rows that change ``paramfsm.shard``'s other arguments: no gather of the next unit ahead of use.
SHARD_ARGS = {"all disk, prefetch=0": {"prefetch": 0}}
MIB = 1 << 20


def _anon_kib() -> int:
    return _status_kib("VmHWM") - _status_kib("RssFile") - _status_kib("RssShmem")


def _build(depth: int, width: int) -> nn.Module:
    with torch.device("meta"):
        return nn.Sequential(*(nn.Linear(width, width) for _ in range(depth)))


def step_job(rank, world, model_name, row, folder, steps):
    """Train ``steps`` measured steps after one unmeasured; (times, traffic per step, peak anon MiB)."""
    import paramfsm

    depth, width = MODELS[model_name]
    process = _status_kib("RssAnon") / 1024  # the process before the model: torch, gloo, paramfsm
    torch.manual_seed(0)
    model = _build(depth, width)
    tiers = ROWS[row]
    offload = None if tiers is None else paramfsm.Offload(params=tiers[0], optimizer=tiers[1], grads=tiers[2],
                                                          path=folder)
    rt = paramfsm.shard(model, device="cpu", offload=offload, **SHARD_ARGS.get(row, {}))
    rt.init_weights()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(4, width, generator=torch.Generator().manual_seed(rank))

    def one_step():
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    one_step()
    dist.barrier()
    _reset_peak()
    before = rt.offload.traffic() if rt.offload is not None else {"read": 0, "written": 0}
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        one_step()
        times.append(time.perf_counter() - began)
    peak = _anon_kib() / 1024
    after = rt.offload.traffic() if rt.offload is not None else {"read": 0, "written": 0}
    traffic = {k: (after[k] - before[k]) / steps for k in after}
    dist.barrier()
    rt.close()
    return times, traffic, peak, process


def bandwidth(folder: str, nbytes: int = 1 << 30) -> float:
    """Bytes per second of a buffered sequential write then read of ``nbytes`` in ``folder``, as the tier does."""
    block = torch.empty(64 * MIB, dtype=torch.uint8).numpy()
    path = Path(folder) / "bandwidth.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        began = time.perf_counter()
        for offset in range(0, nbytes, block.nbytes):
            os.pwrite(fd, block, offset)
        os.fsync(fd)
        for offset in range(0, nbytes, block.nbytes):
            os.preadv(fd, [block], offset)
        return 2 * nbytes / (time.perf_counter() - began)
    finally:
        os.close(fd)
        path.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--folder", default=None, help="where the offload files go (default: a temporary folder)")
    parser.add_argument("--glibc-default", action="store_true",
                        help="leave glibc's mmap threshold alone (freed buffers may stay in its heap and in RSS)")
    args = parser.parse_args()
    if not args.glibc_default:  # before the first RankPool: its ranks fork from a server started with this
        os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 16))  # tensors are mappings: RSS follows them
    folder = args.folder or tempfile.mkdtemp(prefix="paramfsm-offload-bench-")
    speed = bandwidth(folder)
    print(f"sequential bandwidth of {folder}: {speed / MIB:.0f} MiB/s (buffered write + read)", flush=True)
    print(f"{'model':6} {'row':24} {'step s':>8} {'read MiB':>9} {'written MiB':>11} {'floor s':>8} "
          f"{'x floor':>8} {'peak anon MiB':>14} {'above process':>14} {'plan + allowance':>17} {'vs none':>8}")
    for model_name in args.models:
        base = None
        for row in ROWS:
            with RankPool(2, timeout=1800) as pool:
                results = pool.run(step_job, model_name, row, folder, args.steps)
            times, traffic, *_ = results[0]
            step = statistics.median(times)
            peak = max(r[2] for r in results)
            above = max(r[2] - r[3] for r in results)
            moved = traffic["read"] + traffic["written"]
            floor = moved / speed
            base = step if row == "none" else base
            print(f"{model_name:6} {row:24} {step:8.3f} {traffic['read'] / MIB:9.0f} "
                  f"{traffic['written'] / MIB:11.0f} {floor:8.3f} "
                  f"{(step / floor if floor else float('nan')):8.2f} {peak:14.0f} {above:14.0f} "
                  f"{_bound(model_name, row, folder):17.0f} {step / base:8.2f}", flush=True)


#: What the anonymous peak may hold beyond the plan, in MiB: autograd's temporaries (the gradient of each
#: activation), gloo's buffers, threads' stacks, Python objects and the allocator's slack, none of them tensors
#: paramfsm holds. On the stack model here every row measured 74 to 80 MiB above its plan.
ALLOWANCE = 96


def _bound(model_name: str, row: str, folder: str) -> float:
    """The row's memory plan (paramfsm-owned bytes and activations at their peak) + :data:`ALLOWANCE`, in MiB."""
    import paramfsm

    depth, width = MODELS[model_name]
    tiers = ROWS[row]
    offload = None if tiers is None else paramfsm.Offload(params=tiers[0], optimizer=tiers[1], grads=tiers[2],
                                                          path=folder)
    plan = paramfsm.plan(_build(depth, width), 2, example_input=torch.empty(4, width, device="meta"),
                         offload=offload, **SHARD_ARGS.get(row, {}))
    return plan.peak / MIB + ALLOWANCE


if __name__ == "__main__":
    main()
