"""Seconds of ``rt.init_weights()`` on a meta-built stack of Linear modules, at world 2 (gloo), median of 5.

Each module's outcome is agreed across ranks (one flag all-reduce per module, see [Note: an error one rank
meets] in ``paramfsm.sharding.rank_errors``); this measures what that costs. A/B against another checkout by running
it with that checkout first on ``PYTHONPATH``:

    git archive REV paramfsm specs | tar -x -C /tmp/base
    PYTHONPATH=/tmp/base torchrun --nproc-per-node 2 benchmarks/init_weights_time.py --modules 200
    torchrun --nproc-per-node 2 benchmarks/init_weights_time.py --modules 200
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import paramfsm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", type=int, default=200)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    seconds = []
    for _ in range(args.rounds):
        with torch.device("meta"):
            model = torch.nn.Sequential(*(torch.nn.Linear(args.width, args.width) for _ in range(args.modules)))
        rt = paramfsm.shard(model)
        torch.manual_seed(0)
        start = time.perf_counter()
        rt.init_weights()
        seconds.append(time.perf_counter() - start)
        rt.close()
    if dist.get_rank() == 0:
        print(f"init_weights of {args.modules} Linear({args.width}, {args.width}) at world "
              f"{dist.get_world_size()}: median {statistics.median(seconds):.4f} s over {args.rounds}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
