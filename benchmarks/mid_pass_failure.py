"""What it would cost to tell the other ranks at once that one rank failed in the middle of a pass (gloo, world 2).

A rank whose page-in fails in the middle of a backward leaves its peers blocked in a point-to-point receive
that will never be matched. This measures the ways a blocked gloo wait could be woken, and what each costs
on every wait:

* **plain wait**: ``work.wait()`` on an ``isend``/``irecv`` pair of 2 MiB, as paramfsm waits today (median
  microseconds per pair, 50 pairs a round, 5 rounds);
* **thread-handed wait**: the same, waited for on a helper thread while the caller waits on an event in
  one-second slices (between slices it could read a failure notice from the store);
* **flag all-reduce**: one one-element all-reduce, what an agreement at the end of every pass would cost;
* whether gloo's point-to-point work offers a future, and whether ``wait(timeout)`` can be retried;
* how long a peer's pending receive takes to fail after the other rank calls ``abort()``, ``shutdown()`` or
  ``destroy_process_group()`` and then sleeps 5 s before it exits.

    python benchmarks/mid_pass_failure.py
"""

from __future__ import annotations

import datetime
import os
import queue
import statistics
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PAIRS, ROUNDS = 50, 5


def _pairs(send, recv, other, wait) -> float:
    dist.barrier()
    began = time.perf_counter()
    for i in range(PAIRS):
        for work in (dist.isend(send, other, tag=i), dist.irecv(recv, other, tag=i)):
            wait(work)
    return (time.perf_counter() - began) / PAIRS * 1e6


def costs(rank: int, port: int, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    other = 1 - rank
    send, recv = torch.ones((2 << 20) // 4), torch.empty((2 << 20) // 4)
    jobs: queue.SimpleQueue = queue.SimpleQueue()

    def waiter() -> None:
        while True:
            work, done = jobs.get()
            work.wait()
            done.set()

    threading.Thread(target=waiter, daemon=True).start()

    def handed(work) -> None:
        done = threading.Event()
        jobs.put((work, done))
        while not done.wait(1.0):
            pass

    flag = torch.zeros(1)

    def reduce() -> float:
        dist.barrier()
        began = time.perf_counter()
        for _ in range(200):
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return (time.perf_counter() - began) / 200 * 1e6

    rows: dict = {}
    for _ in range(ROUNDS):
        rows.setdefault("plain wait", []).append(_pairs(send, recv, other, lambda w: w.wait()))
        rows.setdefault("thread-handed wait", []).append(_pairs(send, recv, other, handed))
        rows.setdefault("flag all-reduce", []).append(reduce())
    future = "yes"
    work = dist.irecv(recv, other, tag=10_000)
    try:
        work.get_future()
    except RuntimeError as exc:
        future = f"no ({exc})"
    retried = "n/a"
    if rank == 1:
        try:
            work.wait(timeout=datetime.timedelta(seconds=0.5))
        except RuntimeError:
            try:
                work.wait(timeout=datetime.timedelta(seconds=0.5))
                retried = "yes"
            except RuntimeError as exc:
                retried = f"no ({str(exc).strip().splitlines()[-1][:60]})"
    else:
        time.sleep(3)  # rank 0 sends nothing on that tag: rank 1's waits time out
    _send(out, ({k: statistics.median(v) for k, v in rows.items()}, future) if rank == 0 else retried)


def _send(out, value) -> None:
    """Hand ``value`` to the parent and end the process at once (a timed-out or aborted gloo pair cannot be
    torn down cleanly); the queue's feeder thread is flushed first."""
    out.put(value)
    out.close()
    out.join_thread()
    os._exit(0)


def teardown(rank: int, port: int, how: str, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    if rank == 1:
        time.sleep(1)
        backend = dist.group.WORLD._get_backend(torch.device("cpu"))
        {"abort": backend.abort, "shutdown": backend.shutdown, "destroy_process_group": dist.destroy_process_group}[how]()
        time.sleep(5)
        os._exit(0)
    work = dist.irecv(torch.empty(1000), 1, tag=3)
    began = time.monotonic()
    try:
        work.wait()
    except RuntimeError:
        pass
    _send(out, time.monotonic() - began)


def main() -> None:
    context = mp.get_context("spawn")
    out = context.Queue()
    procs = [context.Process(target=costs, args=(rank, 29611, out)) for rank in range(2)]
    for proc in procs:
        proc.start()
    found = [out.get(timeout=300) for _ in procs]
    for proc in procs:
        proc.join()
    (medians, future), = [f for f in found if isinstance(f, tuple)]
    retried, = [f for f in found if not isinstance(f, tuple)]
    for name, value in medians.items():
        print(f"{name:20} median {value:8.0f} us")
    print(f"gloo point-to-point work has a future: {future}")
    print(f"a timed-out wait(timeout) can be waited again: {retried}")
    for i, how in enumerate(("abort", "shutdown", "destroy_process_group")):
        procs = [context.Process(target=teardown, args=(rank, 29621 + i, how, out)) for rank in range(2)]
        for proc in procs:
            proc.start()
        woke = out.get(timeout=60)
        for proc in procs:
            proc.join()
        print(f"peer's pending receive failed {woke:.1f} s after the wait began, with {how}() on the other "
              "rank (which exits 5 s after it)")


if __name__ == "__main__":
    main()
