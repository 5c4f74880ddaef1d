"""Cost of the rank-order check (paramfsm.engine.effects.rankcheck): median time per training step, 2 gloo ranks.

Four settings of the check on the same model and loop: "off" (no check),
"tag" (the tag riding in each gather bucket alone: the default before sizes
were agreed), "agreed" (the default: the tag, and sizes agreed before every
collective moves, by headers the exchange threads swap, or by none in a
repeating run; see the notes of paramfsm.engine.effects.rankcheck), and "debug"
(``debug=True``: a blocking header all-gather before every collective). The
exchanges made with sizes agreed form their own sequence, so "agreed" steps
reach their runs although other settings run in between. Three models:
64 x Linear(64, 64) at the default bucket size (few large collectives) and
at ``bucket_bytes=0`` (one all-gather per unit and one reduce-scatter per
parameter: the worst case for a per-collective check), and
step_overhead.py's stack of 8 GPT blocks, one unit per block. One runtime
switches its check between steps, so the settings take turns step by step
(off, tag, agreed, debug, off, ...): the table gives each setting's median
step (the slower rank's) and the median of its step divided by the "tag"
step of the same cycle (a paired ratio, with its quartiles), so drift of a
shared machine cancels; and the CPU time both ranks' processes spent per
step (every thread), as a ratio too.

    python benchmarks/rank_check_cost.py [--cycles 30] [--warmup 3] [--rounds 3] [--models linear linear0 gpt]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from step_overhead import GPTBlock, batch_of, build  # benchmarks/ is on sys.path when this file runs as a script
from torch import nn

from paramfsm.verify.launch import RankPool

DEPTH, WIDTH = 64, 64
MODES = ("off", "tag", "agreed", "debug")
#: name -> (what the table calls it, bucket_bytes)
MODELS = {"linear": (f"{DEPTH}x Linear({WIDTH},{WIDTH})", 1 << 20),
          "linear0": (f"{DEPTH}x Linear({WIDTH},{WIDTH}) bucket_bytes=0", 0),
          "gpt": ("8x GPTBlock(128), one unit per block", 1 << 20)}


def _model(name: str):
    """The model, its ``units=`` and one input batch."""
    if name == "gpt":
        return build("t"), [GPTBlock], batch_of("t")
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))), None, torch.randn(32, WIDTH)


def _set(rt, mode: str) -> None:
    """Switch the runtime's check between steps (every rank alike, nothing in flight)."""
    rt.executor.rank_check = {"off": None, "debug": "header"}.get(mode, "tag")
    rt.executor.agree_sizes = mode == "agreed"


def job(rank, world, name, cycles, warmup, modes=MODES):
    """Step times and process CPU times (every thread of the rank) of every setting in ``modes``, the
    settings taking turns step by step (one cycle = one step each)."""
    import paramfsm

    model, units, x = _model(name)
    rt = paramfsm.shard(model, units=units, bucket_bytes=MODELS[name][1])
    opt = torch.optim.SGD(rt.shard_parameters(), lr=1e-3)
    times = {mode: [] for mode in modes}
    cpu = {mode: [] for mode in modes}
    counts = {}
    for i in range(warmup + cycles):
        for mode in modes:
            _set(rt, mode)
            before = rt.counters
            start, start_cpu = time.perf_counter(), time.process_time()
            opt.zero_grad(set_to_none=True)
            model(x).pow(2).mean().backward()
            opt.step()
            if i >= warmup:
                times[mode].append(time.perf_counter() - start)
                cpu[mode].append(time.process_time() - start_cpu)
            after = rt.counters
            counts[mode] = (after["all_gathers"] - before["all_gathers"],
                            after["reduce_scatters"] - before["reduce_scatters"])
    _set(rt, "agreed")
    rt.close()
    return times, cpu, counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=30, help="steps of each setting per round")
    parser.add_argument("--warmup", type=int, default=3, help="cycles not timed")
    parser.add_argument("--rounds", type=int, default=3, help="fresh runtimes (and models) per model")
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=list(MODELS))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="settings to compare (tag always included: the ratios are against it)")
    args = parser.parse_args()
    modes = tuple(m for m in MODES if m in args.modes or m == "tag")
    rows = []
    with RankPool(2) as pool:
        for name in args.models:
            seconds, cpu = {mode: [] for mode in modes}, {mode: [] for mode in modes}
            for round_ in range(args.rounds):
                print(f"{name}: round {round_ + 1}/{args.rounds} ...", file=sys.stderr, flush=True)
                results = pool.run(job, name, args.cycles, args.warmup, modes)
                for mode in modes:  # a step lasts as long as its slower rank; CPU: both ranks' threads
                    seconds[mode] += [max(ts) for ts in zip(*(times[mode] for times, _, _ in results))]
                    cpu[mode] += [sum(ts) for ts in zip(*(used[mode] for _, used, _ in results))]
                counts = results[0][2]
            rows.append((name, seconds, cpu, counts))
    print(f"{'model':<42}{'check':<8}{'AG/step':>8}{'RS/step':>8}{'median ms':>11}{'/ tag':>8}"
          f"{'q25':>7}{'q75':>7}{'CPU ms':>8}{'/ tag':>7}")
    for name, seconds, cpu, counts in rows:
        for mode in modes:
            ratios = sorted(t / base for t, base in zip(seconds[mode], seconds["tag"]))
            q25, q75 = ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]
            cpu_ratio = statistics.median(c / base for c, base in zip(cpu[mode], cpu["tag"]))
            print(f"{MODELS[name][0]:<42}{mode:<8}{counts[mode][0]:>8}{counts[mode][1]:>8}"
                  f"{statistics.median(seconds[mode]) * 1e3:>11.2f}{statistics.median(ratios):>8.3f}"
                  f"{q25:>7.3f}{q75:>7.3f}{statistics.median(cpu[mode]) * 1e3:>8.1f}{cpu_ratio:>7.3f}")


if __name__ == "__main__":
    main()
