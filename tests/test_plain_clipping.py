"""``torch.nn.utils.clip_grad_norm_`` over shard parameters clips by the global norm, like plain torch.

DESIGN's recipe builds the optimizer over ``rt.shard_parameters()``; the clipping call a training loop (or
Lightning, Accelerate, the Trainer) then writes goes through the optimizer's param groups. On shards torch
alone would clip each rank by its own partial norm (see [Note: plain clipping over shards] in
``paramfsm.optim.grad_norm``). Each case compares the returned norm and the trained parameters with plain torch on
the whole batch, under ``shard()``'s default units and per module.
"""

from __future__ import annotations

import math

import pytest
import torch

import paramfsm
from paramfsm.testing.models import mlp

STEPS = 3
MAX_NORM = 0.05


def _model():
    torch.manual_seed(0)
    return mlp(width=16, depth=3, d_in=8, d_out=4)


def _batch(step):
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(7 + step)) * 3


def clip_job(rank, world, norm_type, how, min_unit_bytes, offload):
    model = _model()
    rt = None
    if world:
        kwargs = {} if min_unit_bytes == "default" else {"min_unit_bytes": min_unit_bytes}
        rt = paramfsm.shard(model, offload=paramfsm.Offload(grads="cpu", params="cpu", max_resident_bytes=4096)
                            if offload else None, **kwargs)
        params = list(rt.shard_parameters())
    else:
        params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.05)
    norms = []
    for step in range(STEPS):
        x = _batch(step).chunk(max(world, 1))[rank]
        model(x).pow(2).mean().backward()
        through = [p for g in opt.param_groups for p in g["params"]]
        if how == "get_total_norm":
            total = torch.nn.utils.get_total_norm([p.grad for p in through if p.grad is not None], norm_type)
            torch.nn.utils.clip_grads_with_norm_(through, MAX_NORM, total)
        else:
            total = torch.nn.utils.clip_grad_norm_(through, MAX_NORM, norm_type)
        norms.append(float(total))
        opt.step()
        opt.zero_grad()
    full = rt.full_state_dict() if rt is not None else model.state_dict()
    if rt is not None:
        rt.close()
    return norms, full


@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf, 0.0])
@pytest.mark.parametrize("units", ["default", 0])
def test_clip_grad_norm_over_the_optimizers_shards_is_global(ranks2, norm_type, units):
    plain_norms, plain = clip_job(0, 0, norm_type, "clip", None, False)
    assert max(plain_norms) > MAX_NORM, "the case must clip"
    for rank, (norms, full) in enumerate(ranks2.run(clip_job, norm_type, "clip", units, False)):
        torch.testing.assert_close(norms, plain_norms, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank}: {m}")
        for name, value in plain.items():
            torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


@pytest.mark.parametrize("how", ["get_total_norm", "clip"])
def test_get_total_norm_and_offloaded_gradients_are_global_too(ranks2, tmp_path, how):
    plain_norms, plain = clip_job(0, 0, 2.0, how, None, False)
    for rank, (norms, full) in enumerate(ranks2.run(clip_job, 2.0, how, 0, how == "clip")):
        torch.testing.assert_close(norms, plain_norms, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank}: {m}")
        for name, value in plain.items():
            torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


def plain_tensors_job(rank, world):
    model = _model()
    rt = paramfsm.shard(model)  # installs paramfsm's total-norm function
    grads = [torch.randn(5, generator=torch.Generator().manual_seed(rank)), torch.randn(3, 2)]
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
    got = torch.nn.utils.get_total_norm(grads)
    rt.close()
    return got, expected


def test_tensors_that_are_not_shard_gradients_get_torchs_own_norm(ranks2):
    for got, expected in ranks2.run(plain_tensors_job):  # each rank its own tensors: nothing is reduced
        torch.testing.assert_close(got, expected)
