"""Cost of the rank-order check (paramfsm.rankcheck): median time per training step, 2 gloo ranks.

Three settings of the check on the same model and loop: off, the default
in-bucket tag, and the ``debug=True`` header all-gather before every
collective. Two bucket sizes: the default (few large collectives) and
``bucket_bytes=0`` (one collective per unit: the worst case for a per-collective check).

    python benchmarks/rank_check_cost.py [--steps 40] [--warmup 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from paramfsm.launch import RankPool

DEPTH, WIDTH, BATCH = 64, 64, 32


def job(rank, world, mode, bucket_bytes, steps, warmup):
    import paramfsm

    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)))
    rt = paramfsm.shard(model, bucket_bytes=bucket_bytes, debug=mode == "header")
    rt.executor.rank_check = {"off": None, "tag": "tag", "header": "header"}[mode]
    opt = torch.optim.SGD(rt.shard_parameters(), lr=1e-3)
    x = torch.randn(BATCH, WIDTH)
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    counts = rt.counters
    rt.close()
    passes = warmup + steps
    return statistics.median(times), counts["all_gathers"] // passes, counts["reduce_scatters"] // passes


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
