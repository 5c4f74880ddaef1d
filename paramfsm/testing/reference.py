"""The single-process plain-torch reference every scenario is compared with.

Each rank holds an unsharded deep copy of the model taken before sharding and
runs the same program on the *combined* batch of all ranks. With losses that
average over the batch, the reference gradient equals the average of the
per-rank gradients, which is what paramfsm's reduce-scatter produces.
"""

from __future__ import annotations

import copy
from typing import Mapping

import torch
from torch import nn


def global_batch(world: int, per_rank: int, *shapes, seed: int = 0, dtype=torch.float32):
    """Tensors of shape (world*per_rank, *shape) drawn from a fixed seed: identical on every rank."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(world * per_rank, *shape, generator=gen, dtype=dtype) for shape in shapes]


def rank_slice(tensor: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """This rank's contiguous share of a global batch."""
    per = tensor.shape[0] // world
    return tensor[rank * per:(rank + 1) * per]


class Reference:
    """An unsharded copy of a model plus an optimizer built the same way as the sharded one."""

    def __init__(self, model: nn.Module, make_optimizer=None):
        self.model = copy.deepcopy(model)
        self.optimizer = make_optimizer(self.model.parameters()) if make_optimizer else None

    def grads(self) -> dict[str, torch.Tensor | None]:
        return {n: (p.grad.detach().clone() if p.grad is not None else None)
                for n, p in self.model.named_parameters()}

    def params(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.model.zero_grad(set_to_none=True)


def sharded_grads(rt, model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Full gradients of the sharded model (collective: every rank calls it)."""
    return {n: rt.full_grad(n) for n, _ in model.named_parameters()}


def sharded_params(rt, model: nn.Module) -> dict[str, torch.Tensor]:
    """Full parameters of the sharded model (collective)."""
    return {n: rt.full_param(n) for n, _ in model.named_parameters()}


def assert_close_dicts(got: Mapping, want: Mapping, *, atol: float = 1e-6, rtol: float = 1e-5, what: str = "") -> float:
    """Assert two name->tensor dicts agree (None only matches None or an all-zero tensor).

    Returns the largest absolute difference, so callers can report it.
    """
    if set(got) != set(want):
        raise AssertionError(f"{what}: keys differ: {sorted(set(got) ^ set(want))}")
    worst = 0.0
    for name in want:
        a, b = got[name], want[name]
        if a is None or b is None:
            other = a if b is None else b
            if other is not None and other.abs().max().item() != 0:
                raise AssertionError(f"{what}: '{name}' is None on one side and nonzero on the other")
            continue
        if a.shape != b.shape:
            raise AssertionError(f"{what}: '{name}' shape {tuple(a.shape)} != {tuple(b.shape)}")
        diff = (a.float() - b.float()).abs().max().item() if a.numel() else 0.0
        worst = max(worst, diff)
        if not torch.allclose(a.float(), b.float(), atol=atol, rtol=rtol):
            raise AssertionError(f"{what}: '{name}' differs from the reference by {diff:.3g} (atol {atol})")
    return worst
