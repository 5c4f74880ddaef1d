"""Two (or more) real gloo ranks in the test process: one thread each, each with its own world.

``make mutate`` mutates only what runs in the pytest process, and the spawned ranks of
``conftest.py`` are out of its sight. torch's threaded process group (``threaded_ranks.py``) has no
wait timeouts and no point-to-point transport of its own, so the gloo exchange, offloaded shards and
anything that agrees among ranks could not run in process. Here each rank is a thread that calls
``init_process_group("gloo")`` on a shared in-memory store: real gloo pairs, real timeouts, the whole
public API.

[Note: a world per rank thread]
torch.distributed keeps one world per process (``distributed_c10d._world``: the default group and the
group tables). While :func:`on_gloo_ranks` runs, that world is one per thread, the way torch's own
threaded tests make it (``ThreadLocalWorld``), with one addition: a thread started by a rank thread
(paramfsm's exchange, page-in and save threads) sees its starter's world, so its collectives run in
the rank's groups.

[Note: an exchange issuer per rank]
paramfsm posts point-to-point exchanges from one issuer per process (``gloo.exchange._issuer``): one
rank per process in every real run. Here each rank gets an issuer of its own for the call, so its
threads post in its own world, and the threads end with the call.
"""

from __future__ import annotations

import threading
import traceback

import paramfsm
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch._C._distributed_c10d import ProcessGroup
from torch.testing._internal.distributed.multi_threaded_pg import ThreadLocalWorld, WorldData

from paramfsm.engine.effects.gloo import exchange
from paramfsm.verify.launch import RankFailure

_local = threading.local()


class _RankWorlds(ThreadLocalWorld):
    """Each thread's world: its own, its starter's (a thread a rank started), or a new empty one."""

    def _get_world(self) -> WorldData:
        world = getattr(_local, "world", None)
        if world is None:
            world = getattr(threading.current_thread(), "_rank_world", None)
            if world is None:
                world = WorldData(None, {}, {}, {}, {}, 0, {}, {}, {}, [])
            _local.world = world
        return world


class _Stop:
    """Ends an issuer's threads: handed over as a batch that is never ready, it goes to the checking
    thread, which ends settling it; handed over alone, the posting thread ends iterating it."""

    mode = None

    def __iter__(self):
        raise SystemExit

    def ready(self) -> bool:
        return False

    def agree(self, refusals):
        return None

    def post(self, refused):
        raise SystemExit


def on_gloo_ranks(world: int, job, timeout_s: float = 60.0, turns: bool = False):
    """``job(rank)`` on ``world`` gloo ranks, one thread each in this process: (results, errors).

    Every rank's group is destroyed when its job ends, whether it returned or raised. With ``turns`` the
    ranks take turns until they call ``paramfsm.shard`` ([Note: the ranks take turns until they shard]).
    """
    results, errors = [None] * world, [None] * world
    store = dist.HashStore()
    issuers: dict[int, exchange._Issuer] = {}
    turn = threading.Lock()

    def body(rank):
        dist.init_process_group("gloo", rank=rank, world_size=world, store=store)
        _local.lock = turn if turns else None
        _take_turn()
        try:
            results[rank] = job(rank)
        except BaseException as exc:  # noqa: BLE001 - the test inspects every rank's error
            errors[rank] = exc
        finally:
            _end_turn()
            dist.destroy_process_group()

    def hand_over(jobs):
        key = id(c10d._world._get_world())
        if key not in issuers:
            issuers[key] = exchange._Issuer.__new__(exchange._Issuer)
            issuers[key]._forget()  # an issuer without the fork hook: it lives for this call only
        issuers[key]._hand_over(jobs)

    start = threading.Thread.start

    posting: list[threading.Thread] = []

    def start_in_world(thread):
        thread._rank_world = getattr(_local, "world", None)
        if thread.name == "paramfsm-exchange":
            posting.append(thread)
        start(thread)

    saved_world, shard, seed = c10d._world, paramfsm.shard, torch.manual_seed
    collectives = {name: ProcessGroup.__dict__[name] for name in _COLLECTIVES}  # the descriptors, bound on lookup
    c10d._world = _RankWorlds()
    threading.Thread.start = start_in_world
    paramfsm.shard, torch.manual_seed = _shard_after_turn, _seed_in_turn
    for name in collectives:
        setattr(ProcessGroup, name, _after_turn(getattr(ProcessGroup, name)))
    exchange._issuer._hand_over = hand_over
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    try:
        threads = [threading.Thread(target=body, args=(rank,), daemon=True) for rank in range(world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=timeout_s)
        assert not any(thread.is_alive() for thread in threads), "a rank is blocked"
    finally:
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        del exchange._issuer._hand_over
        paramfsm.shard, torch.manual_seed = shard, seed
        for name, descriptor in collectives.items():
            setattr(ProcessGroup, name, descriptor)
        threading.Thread.start = start
        c10d._world = saved_world
        _stop(issuers.values(), posting)
    return results, errors


def _stop(issuers, threads) -> None:
    """End the call's issuer threads, and wait for them (their ``SystemExit`` is theirs, not a failure)."""
    hook = threading.excepthook

    def quiet(args):
        if not (args.thread in threads and args.exc_type is SystemExit):
            hook(args)

    threading.excepthook = quiet
    try:
        for issuer in issuers:
            if issuer._queue is not None:
                issuer._queue.put([_Stop()])
                issuer._queue.put(_Stop())
        for thread in threads:
            thread.join(timeout=5)
    finally:
        threading.excepthook = hook


# [Note: the ranks take turns until they shard]
# The global random generator is the process's, shared by the rank threads. A job seeds it and builds its
# model (``torch.manual_seed(0); model = ...``) as a spawned rank does; two threads doing so at once would
# draw from one sequence in turns and build different models. So a rank takes a turn when its job starts
# and whenever it seeds the generator, and gives it up when it calls ``paramfsm.shard`` or any collective
# (FSDP2's, DCP's, the job's own: a collective waits for the other ranks, which wait for the turn) or its job
# ends: the ranks build each model one after the other, each from its own seed. A job that draws from the
# global generator after sharding (dropout) draws in no set order. A rank that blocks otherwise while it holds
# its turn (a group's rendezvous on the store) is passed by the others after ``TURN_S``.
TURN_S = 10.0
_real_shard, _real_seed = paramfsm.shard, torch.manual_seed
#: Every ProcessGroup method that waits for other ranks: a rank calling one gives up its turn first.
_COLLECTIVES = tuple(name for name in vars(ProcessGroup) if not name.startswith("__") and name.lstrip("_").startswith((
    "allgather", "all_gather", "allreduce", "alltoall", "all_to_all", "barrier", "broadcast", "gather", "scatter",
    "monitored_barrier", "recv", "reduce", "send")))


def _after_turn(method):
    """``method`` of a process group, called once the calling rank has given up its turn."""

    def call(self, *args, **kwargs):
        _end_turn()
        return method(self, *args, **kwargs)

    return call


#: One entry per rank that went on without the turn after ``TURN_S``: a job that blocked while it held it.
WAITED_OUT: list[str] = []


def _take_turn() -> None:
    lock = getattr(_local, "lock", None)
    if lock is not None and getattr(_local, "turn", None) is None:
        _local.turn = lock if lock.acquire(timeout=TURN_S) else None
        if _local.turn is None:
            WAITED_OUT.append(threading.current_thread().name)


def _end_turn() -> None:
    turn, _local.turn = getattr(_local, "turn", None), None
    if turn is not None:
        turn.release()


def _seed_in_turn(seed):
    _take_turn()
    return _real_seed(seed)


def _shard_after_turn(*args, **kwargs):
    _end_turn()
    return _real_shard(*args, **kwargs)


class InProcessRanks:
    """A rank pool's ``run`` on gloo ranks that are threads of this process (see :func:`on_gloo_ranks`).

    The tests written for spawned ranks (``fn(rank, world, *args)``, results by rank, a failure raised as
    :class:`RankFailure` with the rank's traceback) run here unchanged, where ``make mutate`` sees them.
    """

    def __init__(self, world: int, timeout: float = 120.0):
        self.world, self.timeout = world, timeout

    def run(self, fn, *args, timeout: float | None = None) -> list:
        results, errors = on_gloo_ranks(self.world, lambda rank: fn(rank, self.world, *args),
                                        timeout or self.timeout, turns=True)
        for rank, error in enumerate(errors):
            if error is not None:
                detail = "".join(traceback.format_exception(error))
                raise RankFailure(rank, detail) from error
        return results


def unwrap(results, errors):
    """The results, after raising the first rank's error (with the others named) if any rank failed."""
    failed = [(rank, error) for rank, error in enumerate(errors) if error is not None]
    if failed:
        raise AssertionError(f"ranks {[rank for rank, _ in failed]} failed") from failed[0][1]
    return results
