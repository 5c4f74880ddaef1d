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

The all-reduce is the runtime's rank-checked one (:func:`paramfsm.sharding.full_state.all_reduce`),
so a rank that clips while its peers gather raises RankDesync instead of waiting.

[Note: plain clipping over shards]
DESIGN's recipe builds the optimizer over ``rt.shard_parameters()``, and
``torch.nn.utils.clip_grad_norm_(p for g in opt.param_groups for p in
g["params"])`` is what a training loop then writes (Lightning, Accelerate and
Hugging Face's Trainer all clip through the optimizer's parameters). On shards
torch would compute each rank's own partial norm and clip each rank by a
different coefficient: silently wrong, and the ranks' models drift apart. So
the first ``paramfsm.shard`` wraps the function every torch clipping call
computes its norm with (``torch.nn.utils.clip_grad._get_total_norm``, which
``clip_grad_norm_`` looks up at call time, and its public alias
``torch.nn.utils.get_total_norm``). When none of the tensors is a shard
gradient it is torch's own function, called unchanged; otherwise the shard
gradients' part is reduced over their runtime's ranks (collective: every rank
clips, as with ``rt.clip_grad_norm_``) and any other tensor, replicated on
every rank, counts once. Torch then scales each gradient by one coefficient,
the same on every rank: exactly plain torch's clipping of the full gradients.
"""

from __future__ import annotations

import contextlib
import logging
import math

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad as torch_clip

from paramfsm import optim
from paramfsm.sharding import accumulation, full_state
from paramfsm.errors import ParamFSMError

log = logging.getLogger(__name__)

_TORCH_TOTAL_NORM = getattr(torch_clip, "_get_total_norm", None)


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
    part = shard_part([s.grad for s in shards], norm_type, reduce, hold, device)
    total = _combine([part], norm_type).float()
    if error_if_nonfinite and not torch.isfinite(total):
        raise ParamFSMError(f"the total norm of order {norm_type} of the gradients is not finite "
                            "(clip_grad_norm_ was called with error_if_nonfinite=True)")
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        with hold(g, write=True):
            g.detach().mul_(coef.to(g.dtype))
    return total


def shard_part(grads, norm_type: float, reduce, hold, device) -> torch.Tensor:
    """The part of the total ``norm_type``-norm that ``grads`` (one runtime's shard gradients, None where a
    parameter has none) contribute, reduced over the ranks: the sum of ``|g|^p`` (float64) for a finite
    p > 0, the largest ``|g|`` for infinity, the number of parameters with a nonzero gradient for p = 0."""
    if norm_type == 0.0:
        nonzero = []
        for g in grads:
            if g is None:
                nonzero.append(0.0)
                continue
            with hold(g, write=False):
                nonzero.append(float(torch.count_nonzero(g)))
        counts = torch.tensor(nonzero, dtype=torch.float64, device=device)
        if reduce is not None:
            counts = reduce(counts, "sum")
        return torch.count_nonzero(counts).double()
    if norm_type == math.inf:
        maxima = []
        for g in grads:
            if g is not None and g.numel():
                with hold(g, write=False):
                    maxima.append(g.detach().abs().max().double())
        local = (torch.stack(maxima).max() if maxima else torch.zeros((), dtype=torch.float64, device=device))
        local = local.reshape(1)
        return (reduce(local, "max") if reduce is not None else local)[0]
    local = torch.zeros(1, dtype=torch.float64, device=device)
    for g in grads:
        if g is not None:
            with hold(g, write=False):
                local += g.detach().double().abs().pow(norm_type).sum()
    return (reduce(local, "sum") if reduce is not None else local)[0]


def _combine(parts, norm_type: float) -> torch.Tensor:
    """The total norm from :func:`shard_part`-shaped parts (float64)."""
    stacked = torch.stack([p.to(parts[0].device) for p in parts])
    if norm_type == math.inf:
        return stacked.max()
    if norm_type == 0.0:
        return stacked.sum()
    return stacked.sum().pow(1.0 / norm_type)


def _resident(grad, *, write: bool):
    return contextlib.nullcontext()


# ---------------------------------------------------------------------- plain clipping over shards
def install() -> None:
    """Route torch's total-norm function through :func:`_total_norm` (once per process; see [Note: plain
    clipping over shards])."""
    if _TORCH_TOTAL_NORM is None:
        log.warning("paramfsm: this torch has no torch.nn.utils.clip_grad._get_total_norm, so "
                    "torch.nn.utils.clip_grad_norm_ over shard parameters cannot be made global; clip with "
                    "rt.clip_grad_norm_(max_norm) instead")
        return
    if torch_clip._get_total_norm is not _total_norm:
        torch_clip._get_total_norm = _total_norm
        torch.nn.utils.get_total_norm = _total_norm


def _total_norm(tensors, norm_type: float = 2.0, error_if_nonfinite: bool = False, foreach=None):
    """torch's ``get_total_norm``, global over the ranks when some of ``tensors`` are shard gradients."""
    listed = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    owners = _owners()
    by_runtime: dict = {}
    others = []
    for t in listed:
        rt = owners.get(id(t))
        if rt is None:
            others.append(t)
        else:
            by_runtime.setdefault(rt, []).append(t)
    if not by_runtime:
        return _TORCH_TOTAL_NORM(listed, norm_type, error_if_nonfinite, foreach)
    norm_type = float(norm_type)
    if norm_type < 0:
        raise ParamFSMError(
            f"a total norm of order {norm_type} over paramfsm shard gradients: a negative-order norm of the "
            "per-parameter norms cannot be computed from shards. What to do: clip with a norm of order >= 0.")
    device = listed[0].device
    parts = []
    for rt, grads in by_runtime.items():
        parts.append(_runtime_part(rt, grads, norm_type, device))
    if others:
        parts.append(shard_part(others, norm_type, None, _resident, device))
    total = _combine(parts, norm_type).to(device=device, dtype=listed[0].dtype)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot "
            "be clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False`")
    return total


def _owners() -> dict:
    """id(shard gradient) -> its runtime, over every live sharded model."""
    out = {}
    for shard in optim.shards():
        rt = optim.runtime_of(shard)
        if rt is not None and shard.grad is not None:
            out[id(shard.grad)] = rt
    return out


def _runtime_part(rt, grads, norm_type: float, device) -> torch.Tensor:
    accumulation.require_synced(rt, "torch.nn.utils.clip_grad_norm_() over shard parameters")
    with rt._reporting():
        reduce = None if rt.world == 1 else (
            lambda values, op: full_state.all_reduce(rt, values, op, full_state.REDUCTIONS[0]))
        hold = rt.offload.residency.holding if rt.offload is not None else _resident
        return shard_part(grads, norm_type, reduce, hold, device)
