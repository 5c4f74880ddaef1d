"""Helpers of one process group: values kept per group, and the small blocking all-gather the checks use.

Both the collectives (:mod:`paramfsm.engine.effects.collectives`), the gloo transport
(:mod:`paramfsm.engine.effects.gloo`) and the rank-order check (:mod:`paramfsm.engine.effects.rankcheck`)
stand on this module, and it on none of them. torch 2.13 names the flat collectives
``all_gather_single`` / ``reduce_scatter_single``; older releases call them ``all_gather_into_tensor`` /
``reduce_scatter_tensor``. Both are looked up once, here.
"""

from __future__ import annotations

import weakref
from typing import Callable

import torch
import torch.distributed as dist

ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class PerGroup:
    """Values kept per process group, dropped with the group.

    Keyed by the group itself (weakly), never by ``id(group)``: a destroyed
    group's id is reused by the next one, differently on each rank, which
    would hand a new group an old group's tags, ranks or backend. ``None``
    stands for the default group of the moment (``dist.group.WORLD``), so a
    re-initialised world starts afresh too.
    """

    def __init__(self):
        self._groups: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def get(self, group, key=None, default=None):
        table = self._groups.get(dist.group.WORLD if group is None else group)
        return default if table is None else table.get(key, default)

    def set(self, group, value, key=None) -> None:
        self._groups.setdefault(dist.group.WORLD if group is None else group, {})[key] = value


def _plain_wait(work) -> None:
    """``work.wait()``: for CUDA tensors a stream wait, which blocks no host thread."""
    if work is not None:
        work.wait()


def _on(tensor: torch.Tensor, wait: Callable | None) -> Callable:
    """The wait for a collective on ``tensor``: ``wait`` (a waiter) for CPU tensors; for CUDA ones, or
    without a waiter, ``work.wait()``."""
    return wait if wait is not None and tensor.device.type == "cpu" else _plain_wait


def all_gather_tags(tag: torch.Tensor, world: int, group, wait: Callable | None = None) -> torch.Tensor:
    """All-gather a small 1-D tag vector, blocking; one row per rank (the rank-order check's header)."""
    out = torch.empty(world * tag.numel(), dtype=tag.dtype, device=tag.device)
    _on(tag, wait)(ALL_GATHER(out, tag, group=group, async_op=True))
    return out.view(world, -1)
