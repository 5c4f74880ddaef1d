"""``make gpu-check``: everything that needs a GPU, as one script with one table at the end.

Stages, each recorded as a row (a failing stage does not stop the next):

1. environment: a CUDA device, and the ``cuda`` extra (CuPy) and test packages,
   installed with pip when missing;
2. ``pytest -m gpu``: the kernel tests (NVRTC compile, launch on torch's stream,
   bit identity with the torch path) and the runtime's device tests;
3. the two-loss retained-graph loop against plain torch on one GPU: one rank
   over NCCL, as users get it and with collectives forced (kernels, NCCL,
   side streams); then two ranks on the same GPU over gloo;
4. ``benchmarks/gather_scatter.py --device cuda``, with the kernel targets;
5. ``benchmarks/step_gpu.py``, the two-loss step against plain torch and FSDP2.

Exit status: 0 when every stage passes, 1 when one fails, 2 when there is no
GPU to check or it does not run in a checkout (one line says why). ``--quick``
runs stages 1-3 only.
"""

from __future__ import annotations

import importlib
import json
import re
import subprocess
import sys
import tempfile
import time
import tomllib
from functools import partial
from pathlib import Path

# The checkout it runs in (make gpu-check runs from its root): its tests/ and benchmarks/ are not in the package.
REPO = Path.cwd()
#: Modules the check imports, and the pyproject extra that provides each.
NEEDED = {"cupy": "cuda", "transitions": None, "attrs": None, "hypothesis": "verify", "pytest": "test"}
UNPACK_SMALL_VS_PER_TENSOR = 3.0  # the unpack kernel against a per-tensor torch loop, 1,000 small parameters
UNPACK_LARGE_VS_COPY = 0.8  # the unpack kernel's bandwidth against one device-to-device copy


class Table:
    """Rows of (stage, result, detail), printed at the end; result is "pass", "FAIL" or "n/a"."""

    def __init__(self):
        self.rows: list[tuple[str, str, str]] = []

    def add(self, stage: str, ok: bool | None, detail: str) -> None:
        """``ok=None``: not applicable here (a limit of the platform, said in ``detail``)."""
        result = "n/a" if ok is None else ("pass" if ok else "FAIL")
        self.rows.append((stage, result, detail))
        print(f"[gpu-check] {result} {stage}: {detail}", flush=True)

    def print(self) -> None:
        width = max(len(stage) for stage, _, _ in self.rows)
        print(f"\n{'stage':<{width}}  result  detail")
        for stage, result, detail in self.rows:
            print(f"{stage:<{width}}  {result:<6}  {detail}")

    @property
    def ok(self) -> bool:
        return all(result != "FAIL" for _, result, _ in self.rows)


def requirement(module: str) -> str:
    """The pip requirement for ``module``, read from pyproject.toml (its one source)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extra = NEEDED[module]
    pool = project["optional-dependencies"][extra] if extra else project["dependencies"]
    return next(req for req in pool if req.lower().startswith(module))


def environment(table: Table) -> bool:
    import torch

    missing = []
    for module in NEEDED:
        try:
            importlib.import_module(module)
        except ImportError:
            missing.append(module)
    if missing:
        reqs = [requirement(m) for m in missing]
        print(f"[gpu-check] installing {' '.join(reqs)}", flush=True)
        done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", *reqs])
        if done.returncode != 0:
            table.add("environment", False, f"pip could not install {' '.join(reqs)}")
            return False
    import cupy

    props = torch.cuda.get_device_properties(0)
    table.add("environment", True, f"{props.name}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
                                   f"CuPy {cupy.__version__}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}")
    return True


def run_pytest(table: Table) -> None:
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests"],
                          cwd=REPO, capture_output=True, text=True)
    sys.stdout.write(done.stdout[-6000:] + done.stderr[-2000:])
    summary = (done.stdout.strip().splitlines() or ["no output"])[-1].strip("= ")
    ran = re.search(r"(\d+) passed", summary)
    ok = done.returncode == 0 and ran is not None
    table.add("pytest -m gpu", ok, f"{summary} ({time.monotonic() - start:.0f}s)")


def two_loss_runs(table: Table) -> None:
    from paramfsm.verify.launch import RankFailure, RankPool
    from paramfsm.testing.scenarios import two_loss_job

    runs = [("1 rank NCCL, as users get it", "defer", False),
            ("1 rank NCCL, collectives forced, defer", "defer", True),
            ("1 rank NCCL, collectives forced, regather", "regather", True)]
    with RankPool(1, timeout=300, device="cuda") as pool:
        for label, retain, forced in runs:
            job = partial(two_loss_job, collectives=forced, dim=256, depth=4, bucket_bytes=1 << 20, atol=1e-4)
            _two_loss(table, label, lambda: pool.run(job, "cuda", retain, 4))
    label = "2 ranks on one GPU over gloo"
    try:
        with RankPool(2, timeout=300, device="cuda", backend="gloo") as pool:
            job = partial(two_loss_job, dim=256, depth=4, atol=1e-4)
            _two_loss(table, label, lambda: pool.run(job, "cuda", "defer", 4), expect=(RankFailure,))
    except RankFailure as exc:
        table.add(label, False, f"the pool did not start: {_last_line(str(exc))}")


def _two_loss(table: Table, label: str, run, expect=()) -> None:
    start = time.monotonic()
    try:
        reports = run()
    except expect as exc:
        # Reported, not hidden: a backend that cannot move CUDA tensors is a limit of the backend.
        table.add(label, None, f"not supported: {_last_line(str(exc))}")
        return
    except Exception as exc:  # noqa: BLE001 - every failure becomes a row
        table.add(label, False, _last_line(str(exc)))
        return
    r = reports[0]
    table.add(label, True, f"max grad err {max(x['grad_err'] for x in reports):.2e}, "
                           f"max param err {max(x['param_err'] for x in reports):.2e}, "
                           f"{r['all_gathers']} all-gathers, {r['backend']}, {r['streams']} "
                           f"({time.monotonic() - start:.0f}s)")


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:200] if lines else "(no message)"


def parse_gather_scatter(stdout: str) -> dict[tuple[str, str, str], tuple[float, float]]:
    """``(case, op, method) -> (ms, vs copy)`` from the benchmark's table; case is "small" or "large"."""
    rows = {}
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) >= 6 and parts[-4] in ("kernel", "torch", "naive", "copy"):
            case, op = " ".join(parts[:-5]), parts[-5]
            rows[(case.split("(")[0], op, parts[-4])] = (float(parts[-3]), float(parts[-1]))
    return rows


def gather_scatter(table: Table) -> None:
    done = subprocess.run([sys.executable, "benchmarks/gather_scatter.py", "--device", "cuda"],
                          cwd=REPO, capture_output=True, text=True)
    sys.stdout.write(done.stdout + done.stderr[-2000:])
    rows = parse_gather_scatter(done.stdout)
    if done.returncode != 0 or "differs" in done.stdout or ("small", "unpack_gathered", "kernel") not in rows:
        table.add("gather_scatter.py --device cuda", False, _last_line(done.stderr or done.stdout))
        return
    table.add("kernels = torch path, bit for bit", True, "pack, unpack and grad pack on both cases")
    small = rows[("small", "unpack_gathered", "naive")][0] / rows[("small", "unpack_gathered", "kernel")][0]
    large = rows[("large", "unpack_gathered", "kernel")][1]
    table.add("unpack kernel, 1,000 small params", small >= UNPACK_SMALL_VS_PER_TENSOR,
              f"{small:.1f}x the per-tensor torch loop (target >= {UNPACK_SMALL_VS_PER_TENSOR}x)")
    table.add("unpack kernel, large params", large >= UNPACK_LARGE_VS_COPY,
              f"{large:.0%} of a device-to-device copy (target >= {UNPACK_LARGE_VS_COPY:.0%})")


def step_benchmark(table: Table) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "step.json"
        done = subprocess.run([sys.executable, "benchmarks/step_gpu.py", "--json", str(out)],
                              cwd=REPO, capture_output=True, text=True)
        sys.stdout.write(done.stdout + done.stderr[-2000:])
        if done.returncode != 0 or not out.exists():
            table.add("step_gpu.py", False, _last_line(done.stderr or done.stdout))
            return
        results = json.loads(out.read_text())
    for model, row in results.items():
        fsdp2, plain = row.get("FSDP2"), row.get("plain")
        for variant in ("paramfsm", "paramfsm+comm"):
            ms = row.get(variant)
            if not isinstance(ms, float):
                table.add(f"two-loss step, {model}, {variant}", False, str(ms))
                continue
            detail = f"{ms:.2f} ms; {ms / plain:.2f}x plain"
            if isinstance(fsdp2, float):
                table.add(f"two-loss step, {model}, {variant}", ms <= fsdp2,
                          f"{detail}; {ms / fsdp2:.2f}x FSDP2 ({fsdp2:.2f} ms; target <= 1x)")
            else:
                table.add(f"two-loss step, {model}, {variant}", False, f"{detail}; FSDP2 {fsdp2}")


def offload_benchmark(table: Table) -> None:
    """Offload against FSDP2's CPUOffloadPolicy (step time, peak device memory) and the plan against
    ``torch.cuda.max_memory_allocated`` (``benchmarks/offload_gpu.py``); figures, not targets."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "offload.json"
        done = subprocess.run([sys.executable, "benchmarks/offload_gpu.py", "--json", str(out)],
                              cwd=REPO, capture_output=True, text=True)
        sys.stdout.write(done.stdout + done.stderr[-2000:])
        if not out.exists():
            table.add("offload_gpu.py", False, _last_line(done.stderr or done.stdout))
            return
        rows = json.loads(out.read_text())
    baseline = rows.get("no offload", {}).get("ms")
    for name, row in rows.items():
        if "error" in row:
            table.add(f"offload, {name}", name.startswith("FSDP2") and None, row["error"])
            continue
        detail = f"{row['ms']:.2f} ms ({row['ms'] / baseline:.2f}x no offload), peak {row['peak'] / 2**20:.0f} MiB"
        if row.get("planned"):
            detail += f", planned {row['planned'] / 2**20:.0f} MiB ({row['planned'] / row['peak']:.3f} of the peak)"
        table.add(f"offload, {name}", None, detail)


def main(argv=None) -> int:
    quick = "--quick" in (sys.argv[1:] if argv is None else argv)  # correctness stages only, no benchmarks
    try:
        import torch
    except ImportError:
        print(f"gpu-check: {sys.executable} has no torch; run with GPU_PYTHON=<a Python whose torch has CUDA>")
        return 2
    if not torch.cuda.is_available():
        print(f"gpu-check: torch {torch.__version__} sees no CUDA device here; nothing to check")
        return 2
    if not (REPO / "tests").is_dir() or not (REPO / "benchmarks").is_dir():
        print(f"gpu-check: {REPO} is not a paramfsm checkout; run make gpu-check from one")
        return 2
    table = Table()
    stages = (run_pytest, two_loss_runs) if quick else (run_pytest, two_loss_runs, gather_scatter, step_benchmark,
                                                        offload_benchmark)
    for stage in (environment, *stages):
        try:
            if stage(table) is False:
                break  # no environment: the other stages cannot run
        except Exception as exc:  # noqa: BLE001 - a broken stage is a failed row, the rest still run
            table.add(stage.__name__, False, f"{type(exc).__name__}: {_last_line(str(exc))}")
            if stage is environment:
                break
    table.print()
    return 0 if table.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
