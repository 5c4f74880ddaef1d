"""Batch norms under ``param_dtype`` compute in full precision, as FSDP's mixed precision does by default.

``BatchNorm1d`` / ``BatchNorm2d`` under ``param_dtype=torch.bfloat16`` crashed in forward ("expected scalar type
BFloat16 but found Float": bfloat16 weights against float32 running statistics). Now their parameters are
gathered in their shard's dtype (see [Note: batch norms compute in their parameters' precision] in
``paramfsm.sharding.assembly``) while every other layer computes in bfloat16. Each rank normalises its own half of the
batch, as under DDP, so plain torch runs each half through the model and averages the two losses.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import paramfsm

STEPS = 3


def _model(dim):
    torch.manual_seed(0)
    if dim == 1:
        return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 4 * 4, 4))


def _batch(dim, step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 8, generator=g) if dim == 1 else torch.randn(8, 3, 6, 6, generator=g)


def bn_job(rank, world, dim, units):
    model = _model(dim)
    rt = paramfsm.shard(model, param_dtype=torch.bfloat16, **({} if units == "default" else {"min_unit_bytes": 0}))
    seen = {}
    model[1].register_forward_hook(lambda m, args, out: seen.update(bn=m.weight.dtype, out=out.dtype))
    model[0].register_forward_hook(lambda m, args, out: seen.update(first=m.weight.dtype))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        model(_batch(dim, step).chunk(world)[rank]).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    full = rt.full_state_dict()
    rt.close()
    return seen, full


def _plain(dim, world):
    model = _model(dim)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        loss = sum(model(x).pow(2).mean() for x in _batch(dim, step).chunk(world)) / world
        loss.backward()
        opt.step()
        opt.zero_grad()
    return dict(model.named_parameters())


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("units", ["default", "per_module"])
def test_batch_norm_under_bf16_computes_in_full_precision_and_trains_like_plain_torch(ranks2, dim, units):
    plain = _plain(dim, 2)
    for rank, (seen, full) in enumerate(ranks2.run(bn_job, dim, units)):
        assert seen == {"bn": torch.float32, "out": torch.bfloat16, "first": torch.bfloat16}, (rank, seen)
        for name, value in plain.items():
            # bfloat16 compute in the other layers: about 3 significant digits.
            torch.testing.assert_close(full[name], value.detach(), rtol=3e-2, atol=3e-3,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
