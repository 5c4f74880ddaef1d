"""Gradient-norm clipping over shards: ``torch.nn.utils.clip_grad_norm_`` for a partitioned model.

Each rank holds 1/world of every gradient (its shard gradient, zero in the
padding), so the p-norm of the whole model's gradient is
``(sum over ranks of sum |g|^p) ** (1/p)``: one all-reduce of one scalar
(a maximum for the infinity norm). Every rank then scales its own shard
gradients by the same coefficient, exactly as torch scales the full ones.

torch defines the total norm as the norm of the per-parameter norms. For
p > 0 and infinity that equals the flat formula above. For p = 0 it does not:
the per-parameter "norm" counts nonzero elements and the total counts the
parameters whose gradient has any, so the shards' nonzero counts are summed
per parameter (one all-reduce of a vector) before counting.

The all-reduce is the caller's ``reduce(values, op)``: the runtime passes its
rank-checked one (:func:`paramfsm.full_state.all_reduce`), so a rank that clips
while its peers gather raises RankDesync instead of waiting.
"""

from __future__ import annotations

import contextlib
import math

import torch

from paramfsm.errors import ParamFSMError


def clip_grad_norm_(shards, max_norm: float, norm_type: float = 2.0, *, error_if_nonfinite: bool = False,
                    reduce=None, paging=None) -> torch.Tensor:
    """Clip the shard gradients in place so the global ``norm_type``-norm is at most ``max_norm``.

    Collective when ``reduce`` is given: every rank calls it. Returns the total
    norm (before clipping) as a float32 tensor, identical on every rank.
    ``reduce(values, op)``: ``values`` (1-D) summed (``op="sum"``) or maximised
    (``"max"``) over the ranks, as a new tensor; None: one rank, nothing to reduce.
    ``paging(grad, write=...)``: a context manager that holds an offloaded gradient in working memory
    while it is read (``write=False``) or scaled (``write=True``), one at a time, so clipping streams
    through the tier (``Residency.holding``); None: no gradient is offloaded.
    """
    hold = paging or _resident
    norm_type = float(norm_type)
    grads = [s.grad for s in shards if s.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    if norm_type == 0.0:
        nonzero = []
        for s in shards:
            if s.grad is None:
                nonzero.append(0.0)
                continue
            with hold(s.grad, write=False):
                nonzero.append(float(torch.count_nonzero(s.grad)))
        counts = torch.tensor(nonzero, dtype=torch.float64, device=device)
        if reduce is not None:
            counts = reduce(counts, "sum")
        total = torch.count_nonzero(counts).float()
    elif norm_type == math.inf:
        maxima = []
        for g in grads:
            if g.numel():
                with hold(g, write=False):
                    maxima.append(g.detach().abs().max().float())
        local = torch.stack(maxima).max() if maxima else torch.zeros((), device=device)
        total = local.clone().reshape(1)
        if reduce is not None:
            total = reduce(total, "max")
        total = total[0]
    else:
        local = torch.zeros(1, dtype=torch.float64, device=device)
        for g in grads:
            with hold(g, write=False):
                local += g.detach().double().abs().pow(norm_type).sum()
        if reduce is not None:
            local = reduce(local, "sum")
        total = local[0].pow(1.0 / norm_type).float()
    if error_if_nonfinite and not torch.isfinite(total):
        raise ParamFSMError(f"the total norm of order {norm_type} of the gradients is not finite "
                            "(clip_grad_norm_ was called with error_if_nonfinite=True)")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        with hold(g, write=True):
            g.detach().mul_(coef.to(g.dtype))
    return total


def _resident(grad, *, write: bool):
    return contextlib.nullcontext()
