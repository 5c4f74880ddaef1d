"""Peak memory of one training step, per rank, all measured in one run.

Model: 16 x Linear(1024, 1024) (64 MiB of fp32 parameters), batch 32, SGD.
For each way to run it (plain torch in one process; paramfsm world 2;
PyTorch FSDP2 ``fully_shard`` per layer world 2) the worker process notes
its resident set before it builds the model, builds, shards and trains one
step, resets its peak (``/proc/self/clear_refs``), trains the measured
steps, and reports the peak resident set above that baseline (``VmHWM``):
what a training step costs at its worst moment (parameters or shards,
gathered parameters, gradients, optimizer state, activations). The peak of
set-up plus the first step is reported separately. The workers run with a fixed glibc mmap
threshold (``MALLOC_MMAP_THRESHOLD_``), so every large tensor is its own
mapping, returned to the system when freed, and RSS follows tensor memory;
the numbers are in MiB, rank 0 shown.

[Note: resident memory counts code pages]
The resident set also holds clean file-backed pages: the code and read-only
data of torch's libraries, mapped in as they are first executed. They are
shared, cost no allocation and are dropped by the kernel under pressure, but
``VmHWM`` counts them, and the baseline decides whose they are. So every job
brings its process to the same state before its baseline: the same modules
imported (paramfsm's and FSDP2's) and FSDP2's device mesh built. When only
FSDP2's job did that, the pages its imports touched were left out of its
figure and the same library pages, touched by paramfsm's first step, counted
in paramfsm's: 3 MiB of its "step peak" (149.2 against 146.0 MiB, the same
run's FSDP2 figure) that was code, not tensors. The "anon" columns leave
file-backed pages out altogether: the anonymous peak is ``VmHWM`` minus the
file-backed and shared pages resident at the end, above the anonymous
resident set at the baseline. Pages are only added while the measured steps
run (nothing here makes the kernel evict them), so the pages resident at the
peak are at most those at the end, and the anonymous peak is exact up to the
file-backed pages first touched during the measured steps, which "code grew"
reports (0.0 when every code path already ran in the first step).

    python benchmarks/memory.py [--steps 3]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch import nn


DEPTH, WIDTH, BATCH = 16, 1024, 32


def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _shared_kib() -> int:
    """Resident pages that are not anonymous: file-backed (code, mapped files) and shared memory."""
    return _status_kib("RssFile") + _status_kib("RssShmem")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w", encoding="ascii") as clear:
        clear.write("5")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)))


def _train(model, params, steps: int, baseline: tuple[int, int]) -> dict:
    """Train ``steps`` measured steps after one unmeasured; MiB above ``baseline`` (:func:`_start`)."""
    baseline_kib, baseline_anon_kib = baseline
    opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    x = torch.randn(BATCH, WIDTH)
    setup_peak = shared_after_first = 0
    for i in range(steps + 1):
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        opt.step()
        if i == 0:  # set-up (building, sharding) and the first step allocate once; measure the rest
            setup_peak = _status_kib("VmHWM")
            shared_after_first = _shared_kib()
            _reset_peak()
    peak, rss, shared = _status_kib("VmHWM"), _status_kib("VmRSS"), _shared_kib()
    return {"peak_mib": (peak - baseline_kib) / 1024,
            "setup_peak_mib": (setup_peak - baseline_kib) / 1024,
            "between_steps_mib": (rss - baseline_kib) / 1024,
            # [Note: resident memory counts code pages]
            "anon_peak_mib": (peak - shared - baseline_anon_kib) / 1024,
            "anon_between_mib": (rss - shared - baseline_anon_kib) / 1024,
            "code_grew_mib": (shared - shared_after_first) / 1024}


def _start(world: int):
    """The same process state for every job, then the baseline: ``((resident KiB, anonymous KiB), mesh)``.

    Every job imports paramfsm's and FSDP2's modules and builds the device mesh
    FSDP2 needs before its baseline, so the pages these touch count for none of
    them (see [Note: resident memory counts code pages]). The peak is reset here.
    """
    import gc

    import paramfsm.runtime  # noqa: F401
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard  # noqa: F401

    mesh = init_device_mesh("cpu", (world,))
    gc.collect()
    baseline = _status_kib("VmRSS"), _status_kib("RssAnon")
    _reset_peak()
    return baseline, mesh


def plain_job(rank, world, steps):
    baseline, _ = _start(world)
    model = _model()
    return _train(model, model.parameters(), steps, baseline)


def paramfsm_job(rank, world, steps):
    import paramfsm

    baseline, _ = _start(world)
    model = _model()
    rt = paramfsm.shard(model)
    return _train(model, rt.shard_parameters(), steps, baseline)


def fsdp2_job(rank, world, steps):
    from torch.distributed.fsdp import fully_shard

    baseline, mesh = _start(world)
    model = _model()
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _train(model, model.parameters(), steps, baseline)


def main(argv=None) -> int:
    from paramfsm.verify.launch import RankPool  # in main only: rank workers import this module for its jobs

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args(argv)
    # Read by glibc when each spawned worker starts; without it glibc raises its threshold
    # after the first large free and keeps later tensors in a heap that RSS never gives back.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    rows = []
    print("measuring peak memory per step ...", file=sys.stderr, flush=True)
    with RankPool(1) as one:
        rows.append(("plain torch (1 process)", one.run(plain_job, args.steps)[0]))
    with RankPool(2) as two:
        rows.append(("paramfsm world 2", two.run(paramfsm_job, args.steps)[0]))
    with RankPool(2) as two:
        rows.append(("FSDP2 world 2", two.run(fsdp2_job, args.steps)[0]))
    base = rows[0][1]["peak_mib"]
    print(f"{'run':<26}{'step peak MiB':>14}{'vs plain':>10}{'between steps MiB':>19}{'set-up peak MiB':>17}"
          f"{'anon peak':>11}{'anon between':>14}{'code grew':>11}")
    for name, r in rows:
        print(f"{name:<26}{r['peak_mib']:>14.1f}{r['peak_mib'] / base:>10.2f}{r['between_steps_mib']:>19.1f}"
              f"{r['setup_peak_mib']:>17.1f}{r['anon_peak_mib']:>11.1f}{r['anon_between_mib']:>14.1f}"
              f"{r['code_grew_mib']:>11.1f}")
    print(f"(parameters: {DEPTH * (WIDTH * WIDTH + WIDTH) * 4 / 2**20:.1f} MiB fp32; rank 0 shown; "
          "anon: without file-backed pages, see [Note: resident memory counts code pages])")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
