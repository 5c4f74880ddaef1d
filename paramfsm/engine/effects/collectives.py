"""Collectives as free functions over tensors and a process group; they never read FSM state.

Each returns a work handle (or None when the world has one rank and nothing
has to move). The blocking ones take ``wait``, the function that waits for
the work handle on the host (:func:`waiter` builds one with a time limit, so
no wait hangs forever; see [Note: every host wait has a limit]). torch 2.13
names the flat collectives ``all_gather_single`` /
``reduce_scatter_single``; older releases call them ``all_gather_into_tensor``
/ ``reduce_scatter_tensor``; :mod:`paramfsm.engine.effects.groups` looks both up once.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from paramfsm.engine.effects.gloo import exchange
from paramfsm.engine.effects.gloo.agreement import Refused
from paramfsm.engine.effects.groups import ALL_GATHER as _ALL_GATHER
from paramfsm.engine.effects.groups import REDUCE_SCATTER as _REDUCE_SCATTER
from paramfsm.engine.effects.groups import PerGroup
from paramfsm.errors import NotInitialized


def resolve_group(group, device: torch.device | None = None):
    """Return ``(group, rank, world)``; raise a helpful error when torch.distributed is not set up.

    ``group="single"`` initialises a one-rank group on 127.0.0.1 when
    torch.distributed is not initialised yet, so single-process use (tests,
    notebooks, debugging a trace) needs no launcher. Its backend follows the
    model's ``device``: NCCL for CUDA, gloo otherwise (:func:`default_backend`).
    """
    if group == "single":
        group = None
        if not dist.is_initialized():
            _init_single_process(default_backend(device))
    if not dist.is_available() or not dist.is_initialized():
        raise NotInitialized(
            "torch.distributed is not initialised. Call "
            "torch.distributed.init_process_group('gloo' or 'nccl', ...) before paramfsm.shard "
            "(torchrun sets the environment for you), or pass group='single' for a one-rank run.")
    return group, dist.get_rank(group), dist.get_world_size(group)


def default_backend(device: torch.device | None) -> str:
    """NCCL for CUDA tensors (when torch has it), gloo for everything else."""
    if device is not None and torch.device(device).type == "cuda" and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def _init_single_process(backend: str) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    dist.init_process_group(backend, rank=0, world_size=1)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: Seconds a host wait on a collective may take by default (``PARAMFSM_COLLECTIVE_TIMEOUT`` overrides).
DEFAULT_TIMEOUT_S = 600.0
TIMEOUT_ENV = "PARAMFSM_COLLECTIVE_TIMEOUT"


def timeout_s(value: float | None = None) -> float:
    """The collective time limit: ``value`` if given, else ``$PARAMFSM_COLLECTIVE_TIMEOUT``, else the default."""
    if value is None:
        text = os.environ.get(TIMEOUT_ENV, "").strip()
        try:
            value = float(text) if text else DEFAULT_TIMEOUT_S
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV}={text!r}: expected a number of seconds") from None
    if not value > 0:
        raise ValueError(f"collective timeout {value!r}: must be a positive number of seconds")
    return float(value)


def waiter(limit_s: float, timed_out: Callable[[float], BaseException],
           refused: Callable[[torch.Tensor], BaseException] | None = None) -> Callable:
    """A ``wait(work)`` that raises ``timed_out(seconds waited)`` once ``limit_s`` has passed, and
    ``refused(rows)`` when the ranks' exchanges disagreed (see [Note: an exchange agrees its sizes
    first] in :mod:`paramfsm.engine.effects.rankcheck`; ``rows``: every rank's header).

    [Note: every host wait has a limit]
    A peer that stalls (it sleeps, deadlocks or skipped a collective) leaves a
    plain ``work.wait()`` blocked forever. Every wait of the host on a
    collective therefore goes through a waiter: gloo's ``Work.wait(timeout)``
    raises "timed out" past the limit, and the waiter turns that into the
    caller's error (:class:`~paramfsm.errors.CollectiveTimeout`, naming the
    collective, unit, step and rank). Waits that a CUDA stream makes (the
    device lanes of :mod:`paramfsm.engine.effects.streams`) block no host thread;
    NCCL's watchdog bounds them (``init_process_group(timeout=...)``).
    """
    limit = timedelta(seconds=limit_s)

    def wait(work) -> None:
        if work is None:
            return
        start = time.monotonic()
        try:
            work.wait(timeout=limit)
        except Refused as exc:
            if refused is None:
                raise
            raise refused(exc.rows) from None
        except RuntimeError as exc:
            if "timed out" not in str(exc).lower():
                raise
            raise timed_out(time.monotonic() - start) from None

    return wait


#: ``with coalesced(fields):`` hands the point-to-point exchanges issued inside to the exchange thread at
#: once, named by ``fields`` in their header (see [Note: a bucket's exchanges are posted together] in
#: :mod:`paramfsm.engine.effects.gloo.exchange`); other collectives are issued as before.
coalesced = exchange.coalesced


def size_agreement(kind: str, tensor: torch.Tensor, group) -> str | None:
    """How a collective of ``kind`` ("all-gather" or "reduce-scatter") over ``tensor`` can agree its
    sizes across ranks before it moves: "exchange" (its point-to-point exchanges agree them, see [Note:
    an exchange agrees its sizes first] in :mod:`paramfsm.engine.effects.rankcheck`), "header" (a gloo
    collective: a blocking header all-gather first), or None (not gloo on the CPU: nothing by default)."""
    if tensor.device.type != "cpu" or not _is_gloo(group):
        return None
    world = _shape(group)[1]
    exchanged = exchange.usable(world) if kind == "all-gather" else world == 2
    return "exchange" if exchanged else "header"


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = True):
    """All-gather ``inp`` (S elements) from every rank into ``out`` (world*S, rank-major).

    CPU tensors on gloo are exchanged point to point (see [Note: gloo exchanges
    shards point to point] in :mod:`paramfsm.engine.effects.gloo.exchange`).
    """
    if inp.device.type == "cpu" and _is_gloo(group):
        rank, world = _shape(group)
        if exchange.usable(world):
            return _finish(exchange.exchange_gather(out, inp, group, rank, world), async_op)
    return _ALL_GATHER(out, inp, group=group, async_op=async_op)


def _finish(handle, async_op: bool):
    """``handle`` when asynchronous; else wait for it now and return None, like torch's collectives."""
    if async_op:
        return handle
    handle.wait()
    return None


_SHAPES = PerGroup()


def _shape(group) -> tuple[int, int]:
    """(rank, world) in ``group``, cached per group."""
    shape = _SHAPES.get(group)
    if shape is None:
        shape = (dist.get_rank(group), dist.get_world_size(group))
        _SHAPES.set(group, shape)
    return shape


def reduce_scatter_flat(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = True, replicate_group=None):
    """Sum ``inp`` (world*S, rank-major) over ranks; this rank's S elements land in ``out``.

    With ``replicate_group`` (hybrid sharding), ``out`` is then also summed
    across the replicas, when the returned handle is waited on. On gloo, CPU
    inputs are exchanged point to point at world 2 (see [Note: gloo exchanges
    shards point to point]) and large ones all-reduced in place at larger
    worlds (see [Note: gloo reduces by all-reduce]); ``inp`` is then
    overwritten, which its callers allow.
    """
    rank, world = _shape(group) if inp.device.type == "cpu" and _is_gloo(group) else (None, None)
    if world == 2:  # [Note: gloo exchanges shards point to point]
        work = _finish(exchange.exchange_reduce(out, inp, group, rank), async_op)
    elif world is not None and inp.numel() * inp.element_size() >= GLOO_ALL_REDUCE_BYTES:
        work = _ViaAllReduce(dist.all_reduce(inp, op=dist.ReduceOp.SUM, group=group, async_op=async_op),
                             out, inp, rank)
    else:
        work = _REDUCE_SCATTER(out, inp, group=group, async_op=async_op)
    return work if replicate_group is None else _AcrossReplicas(work, out, replicate_group)


# [Note: gloo reduces by all-reduce]
# gloo's reduce-scatter is slower than its all-reduce of the same input, although
# the all-reduce moves more bytes: at world 2 on 127.0.0.1, 4 MiB per rank took
# 9.3 ms against 6.3 ms (14.9 ms against 11.6 ms at world 3 for 4 MiB per rank
# slice; measured with paired barriers, median of 20). So on gloo an input of at
# least GLOO_ALL_REDUCE_BYTES is summed whole, in place, and this rank's slice is
# copied out when the handle is waited on. Smaller ones keep the reduce-scatter
# (at world 3, 64 KiB reduce-scattered in less time than it all-reduced).
# NCCL's reduce-scatter is the fast one and is always used there.

#: Reduce-scatter inputs on gloo from this many bytes on are all-reduced instead.
GLOO_ALL_REDUCE_BYTES = 1 << 18

_GLOO = PerGroup()


def _is_gloo(group) -> bool:
    """Whether CPU collectives on ``group`` (None: the default group) run on gloo (cached per group)."""
    known = _GLOO.get(group)
    if known is None:
        known = "gloo" in str(dist.get_backend(group))
        _GLOO.set(group, known)
    return known


class _ViaAllReduce:
    """The handle of a reduce-scatter done as an in-place all-reduce: ``wait`` copies this rank's slice."""

    def __init__(self, work, out: torch.Tensor, inp: torch.Tensor, rank: int):
        self.work, self.out, self.inp, self.rank = work, out, inp, rank
        if work is None:  # a blocking all-reduce has already finished
            self._take()

    def wait(self, **kwargs) -> bool:
        if self.work is not None:
            self.work.wait(**kwargs)
            self.work = None
            self._take()
        return True

    def _take(self) -> None:
        size = self.out.numel()
        self.out.copy_(self.inp.view(-1)[self.rank * size:(self.rank + 1) * size])
        self.inp = None


class _AcrossReplicas:
    """A reduce-scatter's handle whose ``wait`` then sums its output across the replicate group.

    [Note: hybrid reduction]
    Hybrid sharding keeps one copy of every shard per replica. A gradient is
    reduce-scattered within the shard group (each rank gets its shard's sum
    over the group) and the shard is then all-reduced across the replicate
    group, so every replica ends with the sum over all ranks. The all-reduce is
    issued only once the reduce-scatter is complete (on a device: after the
    stream has waited for it), and waited on with the same limit.
    """

    def __init__(self, work, out: torch.Tensor, replicate_group):
        self.work, self.out, self.replicate_group = work, out, replicate_group

    def wait(self, **kwargs) -> bool:
        if self.work is not None:
            self.work.wait(**kwargs)
        dist.all_reduce(self.out, op=dist.ReduceOp.SUM, group=self.replicate_group, async_op=True).wait(**kwargs)
        return True


def resolve_mesh(mesh) -> tuple:
    """``(shard group, replicate group or None)`` of a 1-D mesh or a 2-D ``(replicate, shard)`` DeviceMesh."""
    if mesh.ndim == 1:
        return mesh.get_group(0), None
    if mesh.ndim == 2:
        return mesh.get_group(1), mesh.get_group(0)
    raise ValueError(f"mesh of {mesh.ndim} dimensions: expected 1 (shard) or 2 (replicate, shard)")
