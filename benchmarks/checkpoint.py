"""Checkpoint save and load at world 2: paramfsm sync and async, against FSDP2's DCP save of the same model.

The model is the stack of ``benchmarks/model_scale.py``: 12 x Linear(2048,
2048), 192 MiB of fp32 parameters, sharded over 2 gloo ranks. One job per
way runs on fresh ranks. For each phase the job resets the peak
(``/proc/self/clear_refs``, as ``benchmarks/memory.py`` does), puts a barrier
before and after, and times the phase on rank 0:

* **sync save**: ``paramfsm.checkpoint.save(rt, path)`` (the loop is blocked
  all along);
* **async save**: ``save(..., async_save=True)``. *blocked* is the time until
  it returns (the copy and the agreement); *total* is until ``handle.wait()``
  returns;
* **load**: ``paramfsm.checkpoint.load`` of the sync save into the same runtime;
* **FSDP2 save**: ``fully_shard`` on each Linear and the root, then
  ``dcp.save(model.state_dict())``.

Peak is ``VmHWM`` during the phase minus ``VmRSS`` before it, in MiB, the
largest over the ranks (for the async save, over the whole save, staging
copy included). The figures are one run each on whatever machine runs the
script; the files go to a temporary folder (the page cache makes a second
run faster).

    python benchmarks/checkpoint.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import gc
import shutil
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

DEPTH, WIDTH = 12, 2048


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)))


def _timed(fn) -> tuple[float, float, object]:
    """(seconds, peak MiB above the start, result) of ``fn()`` between two barriers."""
    gc.collect()
    dist.barrier()
    _reset_peak()
    start_kib = _status_kib("VmRSS")
    began = time.perf_counter()
    result = fn()
    seconds = time.perf_counter() - began
    dist.barrier()
    return seconds, (_status_kib("VmHWM") - start_kib) / 1024, result


def paramfsm_job(rank, world, folder, repeat):
    import paramfsm
    import paramfsm.checkpoint as ck

    rt = paramfsm.shard(_model())
    ck.save(rt, f"{folder}/warm")  # imports DCP and touches its code paths once
    out = {"sync save": [], "async blocked": [], "async total": [], "load": []}
    peaks = {key: 0.0 for key in out}
    for i in range(repeat):
        seconds, peak, _ = _timed(lambda: ck.save(rt, f"{folder}/sync-{i}"))  # noqa: B023
        out["sync save"].append(seconds)
        peaks["sync save"] = max(peaks["sync save"], peak)
        gc.collect()
        dist.barrier()
        _reset_peak()
        start_kib = _status_kib("VmRSS")
        began = time.perf_counter()
        handle = ck.save(rt, f"{folder}/async-{i}", async_save=True)
        out["async blocked"].append(time.perf_counter() - began)
        handle.wait()
        out["async total"].append(time.perf_counter() - began)
        peaks["async blocked"] = peaks["async total"] = max(peaks["async total"],
                                                            (_status_kib("VmHWM") - start_kib) / 1024)
        dist.barrier()
        seconds, peak, _ = _timed(lambda: ck.load(rt, f"{folder}/sync-{i}"))  # noqa: B023
        out["load"].append(seconds)
        peaks["load"] = max(peaks["load"], peak)
    return out, peaks


def fsdp2_job(rank, world, folder, repeat):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    model = _model()
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    dcp.save(model.state_dict(), checkpoint_id=f"{folder}/fsdp2-warm")
    out, peak_max = {"FSDP2 save": []}, 0.0
    for i in range(repeat):
        path = f"{folder}/fsdp2-{i}"
        seconds, peak, _ = _timed(lambda: dcp.save(model.state_dict(), checkpoint_id=path))  # noqa: B023
        out["FSDP2 save"].append(seconds)
        peak_max = max(peak_max, peak)
    return out, {"FSDP2 save": peak_max}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3, help="timed saves and loads per way (the median is shown)")
    args = parser.parse_args(argv)
    folder = tempfile.mkdtemp(prefix="paramfsm-ckpt-bench-")
    rows: dict[str, tuple[float, float]] = {}
    try:
        for job in (paramfsm_job, fsdp2_job):
            with RankPool(2, timeout=1800) as pool:
                results = pool.run(job, folder, args.repeat)
            times, peaks = results[0][0], {k: max(r[1][k] for r in results) for k in results[0][1]}
            for key, values in times.items():
                rows[key] = (sorted(values)[len(values) // 2], peaks[key])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"12 x Linear({WIDTH}, {WIDTH}) (192 MiB fp32), world 2, gloo; median of {args.repeat}")
    print(f"{'phase':<16} {'seconds':>8} {'peak MiB':>9}")
    for key, (seconds, peak) in rows.items():
        print(f"{key:<16} {seconds:>8.3f} {peak:>9.1f}")
    sync, fsdp2 = rows["sync save"][0], rows["FSDP2 save"][0]
    print(f"async blocked / sync save: {rows['async blocked'][0] / sync:.3f}")
    print(f"sync save / FSDP2 save: {sync / fsdp2:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
