"""What counting each phase's peak (``rt.reset_peak_memory()``) costs a training step, world 2 (gloo).

The count is a sample per transition (:class:`paramfsm.planning.measure.Tracker`), so it is off until a
reset asks for it. This measures the step with it off and on, on the models of ``step_overhead.py``
whose units are many (``u``: 200 Linear(8, 8), one unit each: the per-transition cost at its worst) and
whose units are few and large (``b``: 16 x Linear(1024, 1024); ``t``: 8 GPT blocks). Off and on run in
the same ranks, in alternating rounds; each figure is the median over rounds of a round's median step.

    python benchmarks/memory_peaks_cost.py [--models u b t] [--steps 20] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from paramfsm.verify.launch import RankPool  # noqa: E402
from step_overhead import build, time_steps, units_of  # noqa: E402


def job(rank, world, name: str, steps: int, warmup: int, rounds: int) -> dict:
    import torch

    import paramfsm

    model = build(name)
    rt = paramfsm.shard(model, units=units_of(name))
    opt = torch.optim.SGD(rt.shard_parameters(), lr=1e-3)
    time_steps(model, opt, 0, warmup, name)
    off, on = [], []
    for i in range(rounds):
        for counting in ((False, True) if i % 2 == 0 else (True, False)):
            if counting:
                rt.reset_peak_memory()
            (on if counting else off).append(time_steps(model, opt, steps, 0, name))
            if counting:
                rt.scheduler.peaks.stop(rt)
                rt.scheduler.peaks = None
    rt.close()
    return {"off": statistics.median(off), "on": statistics.median(on)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["u", "b", "t"])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    print("| model | step, count off (ms) | step, count on (ms) | on / off |")
    print("|---|---:|---:|---:|")
    with RankPool(2) as two:
        for name in args.models:
            results = two.run(job, name, args.steps, args.warmup, args.rounds, timeout=600)
            off = max(r["off"] for r in results) * 1e3
            on = max(r["on"] for r in results) * 1e3
            print(f"| {name} | {off:.2f} | {on:.2f} | {on / off:.3f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
