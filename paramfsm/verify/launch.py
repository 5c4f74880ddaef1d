"""Run functions on N local ranks (127.0.0.1): for tests, the demo, verify and benchmarks.

A :class:`RankPool` starts its worker processes once (forked from a server
that has imported torch, see :func:`_context`), initialises one process
group among them (gloo for ``device="cpu"``, NCCL for ``device="cuda"``, each
rank on its own GPU; ``backend=`` overrides), and then runs any number of picklable functions
``fn(rank, world, *args)`` on every rank, returning the per-rank results.
Reusing the workers keeps a test suite from paying process start-up and
``import torch`` for every test.

Failures are fast and whole: the first rank that raises sends its formatted
traceback, the pool kills every worker (a peer may be blocked in a collective
that will never complete) and raises :class:`RankFailure` carrying the remote
traceback. A run that exceeds its timeout is treated the same way.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from multiprocessing.connection import wait


class RankFailure(RuntimeError):
    """A function failed (or timed out) on some rank; the message holds the remote traceback."""

    def __init__(self, rank: int, detail: str):
        self.rank, self.detail = rank, detail
        super().__init__(f"rank {rank} failed:\n{detail}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, conn, sys_path: list[str], threads: int, backend: str,
            device: str, environ: dict[str, str]) -> None:
    # The fork server was started once, possibly long ago: take the parent's environment as of now.
    os.environ.clear()
    os.environ.update(environ)
    sys.path[:] = sys_path
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    try:
        if device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, rank=rank, world_size=world)
        # [Note: a rank's start-up heap is frozen]
        # What the rank holds once it has started (torch's modules, the default group) lives as long as the
        # rank. Freezing it takes it out of every later collection, which then walks only what the jobs made:
        # a full collection of torch's heap takes 0.15 s here, after the freeze a few milliseconds, and jobs
        # that end in a collection (paramfsm.verify.runner.run_program) run one per program.
        gc.freeze()
        conn.send(("ready", None))
    except Exception:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        try:
            message = conn.recv()
        except EOFError:
            break
        if message is None:
            break
        fn, args = message
        try:
            conn.send(("ok", fn(rank, world, *args)))
        except BaseException:  # noqa: BLE001
            conn.send(("error", traceback.format_exc()))
    dist.destroy_process_group()
    # [Note: a worker skips interpreter finalisation]
    # Once the group is destroyed the worker has nothing left to clean up, but a normal interpreter
    # exit with torch loaded takes over a second per process (module teardown, thread joins). A
    # test session closes several pools, so that was seconds per pool spent on nothing. Flush what
    # the jobs printed and leave at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _context():
    """Processes forked from a server that has already imported torch.

    [Note: ranks fork from a server that imported torch once]
    Importing torch takes seconds, and ``world`` ranks importing it at once on a small machine take
    ``world`` times as long; a test session starts a dozen pools. The ``forkserver`` start method
    imports torch once, in a server process that runs nothing else (no threads, no CUDA, no process
    group), and forks every rank from it, so a pool starts in a fraction of a second after the first.
    Forking is safe because the server never initialised anything that threads or devices own. A
    forked rank inherits the server's environment, not the caller's as a spawned one would, so
    ``_worker`` receives the caller's and applies it first (multiprocessing itself moves the rank into
    the caller's working directory).
    What a process reads only when it starts (glibc's ``MALLOC_*`` variables, say) comes from the
    environment of the first pool's start, when the server starts.
    """
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


class RankPool:
    """``world`` spawned ranks that run functions on request (see the module docstring)."""

    def __init__(self, world: int = 2, timeout: float = 300.0, threads: int | None = None, *,
                 device: str = "cpu", backend: str | None = None, environ: dict[str, str] | None = None):
        """``environ``: the ranks' environment (default: this process's at the pool's first run, when the
        ranks start; a test suite passes its own, so that what a test patched then does not reach them)."""
        self.world, self.timeout = world, timeout
        self.environ = None if environ is None else dict(environ)
        self.device = device
        self.backend = backend or ("nccl" if device == "cuda" else "gloo")
        self.threads = threads or max(1, (os.cpu_count() or 2) // world)
        self._procs: list = []
        self._conns: list = []

    def _start(self) -> None:
        ctx = _context()
        port = free_port()
        for rank in range(self.world):
            parent, child = ctx.Pipe()
            args = (rank, self.world, port, child, list(sys.path), self.threads, self.backend, self.device,
                    dict(os.environ) if self.environ is None else self.environ)
            proc = ctx.Process(target=_worker, args=args, daemon=True)
            proc.start()
            self._procs.append(proc)
            self._conns.append(parent)
        self._collect("start-up")

    def run(self, fn, *args, timeout: float | None = None) -> list:
        """Run ``fn(rank, world, *args)`` on every rank; return the results ordered by rank."""
        if not self._procs:
            self._start()
        for conn in self._conns:
            conn.send((fn, args))
        return self._collect(getattr(fn, "__name__", str(fn)), timeout)

    def _collect(self, what: str, timeout: float | None = None) -> list:
        deadline = time.monotonic() + (timeout or self.timeout)
        results: dict[int, object] = {}
        pending = dict(enumerate(self._conns))
        while pending:
            left = deadline - time.monotonic()
            ready = wait(list(pending.values()), timeout=max(left, 0))
            if not ready:
                self.close()
                raise RankFailure(min(pending), f"{what}: no answer within {timeout or self.timeout:.0f}s "
                                                "(a rank may be blocked in a collective)")
            for conn in ready:
                rank = self._conns.index(conn)
                try:
                    status, value = conn.recv()
                except EOFError:
                    self.close()
                    raise RankFailure(rank, f"{what}: the worker process died") from None
                if status == "error":
                    self.close()
                    raise RankFailure(rank, value)
                results[rank] = value
                del pending[rank]
        return [results[r] for r in range(self.world)]

    def close(self) -> None:
        """Stop every worker (politely if idle, by force otherwise)."""
        for conn in self._conns:
            try:
                conn.send(None)
            except (OSError, BrokenPipeError):
                pass
        for proc in self._procs:
            proc.join(timeout=2)
            if proc.is_alive():
                proc.kill()
                proc.join()
        self._procs, self._conns = [], []

    def __enter__(self) -> "RankPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
