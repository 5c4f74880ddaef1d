"""A checkpoint load under offload (streamed unit by unit) against the staged load of the same model without it.

Two gloo ranks, a stack of ``--units`` Linear(``--width``) layers with AdamW, one unit each. Each row saves a
checkpoint, then times ``paramfsm.checkpoint.load`` on rank 0 and samples the rank's anonymous memory
(``RssAnon``) above what it held before the load, every 2 ms:

* ``resident, staged``: no offload; the whole rank's shards and state are staged, then copied;
* ``offload, N MiB reads``: shards and optimizer state on disk, consecutive units read together while their
  staging stays within N MiB (``paramfsm.checkpoint.streamed_load.STAGING_BYTES``; 0: one unit a read).

    python benchmarks/streamed_load.py [--units 48] [--width 512] [--budgets 0 8 16]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from memory import _status_kib  # noqa: E402 - the benchmarks' reader of /proc/self/status


def _rss() -> int:
    """This process's anonymous resident bytes."""
    return _status_kib("RssAnon") * 1024


def load_job(rank, world, folder: str, units: int, width: int, budget_mib):
    import torch

    import paramfsm
    import paramfsm.checkpoint as ck
    from paramfsm.checkpoint import streamed_load

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(units)])
    offload = None if budget_mib is None else paramfsm.Offload(params="disk", optimizer="disk", path=f"{folder}/tier")
    rt = paramfsm.shard(model, offload=offload)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, width)).sum().backward()
    opt.step()
    opt.zero_grad()
    ck.save(rt, f"{folder}/ck", optimizer=opt)
    default = streamed_load.STAGING_BYTES
    streamed_load.STAGING_BYTES = (budget_mib or 0) << 20
    base, peak, stop = _rss(), [0], threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    start = time.perf_counter()
    try:
        ck.load(rt, f"{folder}/ck", optimizer=opt)
    finally:
        took = time.perf_counter() - start
        stop.set()
        watcher.join()
        streamed_load.STAGING_BYTES = default
    state = 3 * sum(rec.shard.numel() * rec.shard.element_size() for rec in rt._by_id.values())
    rt.close()
    return took, max(peak[0] - base, 0), state


def main(argv=None) -> int:
    from paramfsm.verify.launch import RankPool  # in main only: rank workers import this module for its jobs

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--units", type=int, default=48)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--budgets", type=int, nargs="+", default=[0, 8, 16])
    args = parser.parse_args(argv)
    print("| load | ms (rank 0) | RssAnon above, MiB | rank state (shards + AdamW), MiB |")
    print("|---|---:|---:|---:|")
    with RankPool(2) as pool:
        for budget in [None, *args.budgets]:
            with tempfile.TemporaryDirectory() as folder:
                took, above, state = pool.run(load_job, folder, args.units, args.width, budget, timeout=600)[0]
            name = "resident, staged" if budget is None else (
                "offload, one unit a read" if budget == 0 else f"offload, {budget} MiB reads")
            print(f"| {name} | {took * 1e3:.0f} | {above / 2**20:.1f} | {state / 2**20:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
