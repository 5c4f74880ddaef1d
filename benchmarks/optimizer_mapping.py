"""Cost of mapping an optimizer built over ``model.parameters()`` to the shards, per ``step()``.

paramfsm's global optimizer step pre-hook (:mod:`paramfsm.optim`) runs on every
``step()``; once an optimizer is mapped it is a weak-dictionary lookup. This
times the hook alone on a mapped optimizer over a 200-layer model (one rank,
``group="single"``), and checks that the mapped optimizer holds exactly the
tensors of ``rt.shard_parameters()``.

    python benchmarks/optimizer_mapping.py [--calls 100000]
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import paramfsm
from paramfsm import optim as pfo


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=100_000)
    args = parser.parse_args(argv)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(200)))
    rt = paramfsm.shard(model, group="single")
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    pfo.map_optimizer(opt)
    start = time.perf_counter()
    for _ in range(args.calls):
        pfo._before_step(opt, (), {})
    per_call = (time.perf_counter() - start) / args.calls
    same = [id(p) for p in opt.param_groups[0]["params"]] == [id(s) for s in rt.shard_parameters()]
    print(f"step pre-hook on a mapped optimizer: {per_call * 1e6:.2f} us per step(); "
          f"holds exactly the shards: {same}")
    rt.close()
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
