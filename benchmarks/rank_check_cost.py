"""Cost of the rank-order check (paramfsm.engine.rankcheck): median time per training step, 2 gloo ranks.

Three settings of the check on the same model and loop: off, the default
in-bucket tag, and the ``debug=True`` header all-gather before every
collective. Two bucket sizes: the default (few large collectives) and
``bucket_bytes=0`` (one all-gather per unit and one reduce-scatter per
parameter: the worst case for a per-collective check). The timed loop is
:func:`step_overhead.time_steps`.

    python benchmarks/rank_check_cost.py [--steps 40] [--warmup 5]
"""

from __future__ import annotations

import argparse

import torch
from step_overhead import time_steps  # benchmarks/ is on sys.path when this file runs as a script
from torch import nn

from paramfsm.launch import RankPool

DEPTH, WIDTH = 64, 64


def job(rank, world, mode, bucket_bytes, steps, warmup):
    import paramfsm

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)))
    rt = paramfsm.shard(model, bucket_bytes=bucket_bytes, debug=mode == "header")
    rt.executor.rank_check = {"off": None, "tag": "tag", "header": "header"}[mode]
    seconds = time_steps(model, rt.shard_parameters(), steps, warmup, WIDTH)
    counts = rt.counters
    rt.close()
    passes = warmup + steps
    return seconds, counts["all_gathers"] // passes, counts["reduce_scatters"] // passes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3, help="the modes run interleaved; the best round counts")
    args = parser.parse_args()
    modes = ("off", "tag", "header")
    with RankPool(2) as pool:
        for bucket_bytes in (1 << 20, 0):
            best, shape = {}, None
            for _ in range(args.rounds):
                for mode in modes:
                    t, gathers, reduces = pool.run(job, mode, bucket_bytes, args.steps, args.warmup)[0]
                    best[mode] = min(best.get(mode, t), t)
                    shape = (gathers, reduces)
            for mode in modes:
                print(f"{DEPTH}x Linear({WIDTH},{WIDTH}) bucket_bytes={bucket_bytes:>7} ({shape[0]} all-gathers, "
                      f"{shape[1]} reduce-scatters per step) check={mode:<6} {best[mode] * 1e3:7.2f} ms/step "
                      f"({best[mode] / best['off'] - 1:+.1%} vs off)")


if __name__ == "__main__":
    main()
