"""What ``import paramfsm`` and a first ``shard()`` cost above ``import torch``, in fresh interpreters.

Each round starts two interpreters, one after the other, that both import
torch, start a one-rank gloo group and build ``Sequential(Linear(8, 8),
Linear(8, 8))`` and run one forward and backward; the measured one imports
paramfsm and shards the model first. Each reports
the seconds from just after ``import torch`` to its end, its resident set
(``VmRSS``) and how many modules it imported. The figures are the median
over rounds of (measured - baseline): what a training script that never
checkpoints pays for paramfsm before it touches a parameter. It also lists
whether DCP, DTensor, sympy or the compile stack were imported (none should
be; ``tests/test_startup_imports.py`` asserts it).

    python benchmarks/startup.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
HEAVY = ("torch.distributed.checkpoint", "torch.distributed.tensor", "sympy", "torch._dynamo", "torch._inductor")

SCRIPT = textwrap.dedent("""
    import json, os, sys, tempfile, time
    import torch
    import torch.distributed as dist
    began = time.perf_counter()
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    if sys.argv[1] == "paramfsm":
        import paramfsm
        rt = paramfsm.shard(model)
    model(torch.randn(2, 8)).sum().backward()
    seconds = time.perf_counter() - began
    rss = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:"))
    heavy = sorted({m for m in sys.modules for h in HEAVY if m == h or m.startswith(h + ".")})
    print(json.dumps({"seconds": seconds, "rss_kib": rss, "modules": len(sys.modules), "heavy": heavy}))
    dist.destroy_process_group()
""")


def _run(way: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    code = f"HEAVY = {HEAVY!r}\n" + SCRIPT
    done = subprocess.run([sys.executable, "-c", code, way], capture_output=True, text=True, env=env, timeout=300)
    if done.returncode != 0:
        raise SystemExit(f"{way} run failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    seconds, rss, modules, heavy = [], [], [], set()
    for _ in range(args.rounds):
        base, ours = _run("torch"), _run("paramfsm")
        seconds.append(ours["seconds"] - base["seconds"])
        rss.append((ours["rss_kib"] - base["rss_kib"]) / 1024)
        modules.append(ours["modules"] - base["modules"])
        heavy.update(ours["heavy"])
    print(f"import paramfsm + first shard() + one step, above import torch; median of {args.rounds} rounds")
    print(f"  time      {statistics.median(seconds):.3f} s   (rounds: {', '.join(f'{s:.3f}' for s in seconds)})")
    print(f"  resident  {statistics.median(rss):.1f} MiB")
    print(f"  modules   +{statistics.median(modules):.0f}")
    print(f"  heavy imports: {', '.join(sorted(heavy)) or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
