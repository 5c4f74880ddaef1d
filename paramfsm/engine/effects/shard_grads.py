"""A reduced gradient shard, added into ``shard.grad``: the last move of a gradient's road.

The executor adds what its reduce-scatters complete (:meth:`Executor._accumulate_all
<paramfsm.engine.effects.executor.Executor>`); under gradient offload it hands them back and the schedule
adds them while the shard gradients are paged in (:meth:`paramfsm.engine.schedule.grad_paging.GradPaging.accumulate`).
Both add through :func:`accumulate`, so the addition is written once.
"""

from __future__ import annotations


def accumulate(rec, flat_grad) -> None:
    """Add a reduced gradient shard into ``shard.grad`` (created on first use).

    ``flat_grad`` is referenced nowhere else (a piece of a fresh reduce-scatter
    output, or a one-rank gradient taken from autograd), so it becomes
    ``shard.grad`` as is, without a copy.
    """
    shard = rec.shard
    if flat_grad.dtype != shard.dtype:
        flat_grad = flat_grad.to(shard.dtype)
    if shard.grad is None:
        shard.grad = flat_grad
    else:
        shard.grad.add_(flat_grad)
