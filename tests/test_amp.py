"""fp16 loss scaling on shards: the skip decisions and the scale trajectory of plain torch, on 2 and 3 ranks.

The reference is plain torch on the global batch: fp32 master weights, an
fp16 copy for forward and backward (inputs cast to fp16, loss in fp32), its
gradients cast into the master's ``.grad``, and ``torch.amp.GradScaler``.
Overflows are forced by writing an inf into one element of one gradient:
in the reference, and in the sharded run on the one rank whose shard holds
that element, so no other rank can see it.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from patterns_common import batch
from torch.nn.utils import clip_grad_norm_

import paramfsm
import paramfsm.amp
from paramfsm.testing.models import mlp

#: step -> (parameter, flat index) whose gradient gets an inf; the elements fall in different ranks' shards.
OVERFLOWS = {3: ("0.weight", 5), 9: ("2.weight", 250), 10: ("4.bias", 3), 15: ("2.bias", 15)}
SCALER = {"init_scale": 2.0 ** 8, "growth_interval": 3}


def _local(t, rank, world):
    return t.chunk(world)[rank]


def _poison(rt, master, rank, world, name: str, index: int) -> int:
    """The inf: into the master's gradient, and into the shard of the rank owning that element."""
    dict(master.named_parameters())[name].grad.view(-1)[index] = math.inf
    rec = rt.record(name)
    owner = index // rec.shard_numel
    if rank == owner:
        rec.shard.grad[index - owner * rec.shard_numel] = math.inf
    return owner


def scaler_job(rank, world, pattern, steps=20):
    torch.manual_seed(0)
    model = mlp(width=16, depth=3, d_in=8, d_out=4)
    master = copy.deepcopy(model)
    rt = paramfsm.shard(model, param_dtype=torch.float16)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    ref_opt = torch.optim.SGD(master.parameters(), lr=0.05, momentum=0.9)
    scaler = paramfsm.amp.GradScaler(rt, **SCALER)
    ref_scaler = torch.amp.GradScaler("cpu", **SCALER)
    scales, ref_scales, owners = [], [], []
    micro = 2 if pattern in ("accumulate", "accumulate_no_sync") else 1
    for step in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        low = copy.deepcopy(master).half()
        for m in range(micro):
            x, y = batch(step * micro + m, world, 2, (8,), (4,))
            out, ref_out = model(_local(x, rank, world)).float(), low(x.half()).float()
            if pattern == "two_losses":
                l1, l2 = F.mse_loss(out, _local(y, rank, world)), out.pow(2).mean()
                r1, r2 = F.mse_loss(ref_out, y), ref_out.pow(2).mean()
                rt.backward(scaler.scale(l1), retain_graph=True)
                scaler.scale(l2).backward()
                ref_scaler.scale(r1).backward(retain_graph=True)
                ref_scaler.scale(r2).backward()
            elif pattern == "accumulate_no_sync" and m < micro - 1:
                with rt.no_sync():  # one reduce-scatter per step: the last micro-batch's backward
                    scaler.scale(F.mse_loss(out, _local(y, rank, world)) / micro).backward()
                ref_scaler.scale(F.mse_loss(ref_out, y) / micro).backward()
            else:
                scaler.scale(F.mse_loss(out, _local(y, rank, world)) / micro).backward()
                ref_scaler.scale(F.mse_loss(ref_out, y) / micro).backward()
        for p, q in zip(master.parameters(), low.parameters()):
            p.grad = q.grad.float()
        if step in OVERFLOWS:
            owners.append(_poison(rt, master, rank, world, *OVERFLOWS[step]))
        scaler.unscale_(opt)
        ref_scaler.unscale_(ref_opt)
        rt.clip_grad_norm_(1.0)
        clip_grad_norm_(master.parameters(), 1.0)
        scaler.step(opt)
        ref_scaler.step(ref_opt)
        scaler.update()
        ref_scaler.update()
        scales.append(scaler.get_scale())
        ref_scales.append(ref_scaler.get_scale())
    err = max((rt.full_param(n) - p.detach()).abs().max().item() for n, p in master.named_parameters())
    finite = all(torch.isfinite(rt.full_param(n)).all() for n, _ in master.named_parameters())
    rt.close()
    return scales, ref_scales, owners, err, finite


@pytest.mark.parametrize("pattern", ["one_loss", "two_losses", "accumulate", "accumulate_no_sync"])
def test_skip_decisions_and_scales_match_plain_torch_on_2_ranks(ranks2, pattern):
    results = ranks2.run(scaler_job, pattern)
    scales, ref_scales, owners, _, _ = results[0]
    assert set(owners) == {0, 1}, "every rank must own one of the forced overflows"
    skipped = [step for step in range(1, len(scales)) if scales[step] < scales[step - 1]]
    assert skipped == sorted(OVERFLOWS), (skipped, scales)
    assert max(ref_scales) > SCALER["init_scale"], "the scale must also grow, or growth is untested"
    for rank, (got, want, _, err, finite) in enumerate(results):
        assert got == want, f"rank {rank}: scale trajectory {got} differs from plain torch {want}"
        assert finite and err < 5e-3, f"rank {rank}: parameters differ from plain torch by {err}"


def test_skip_decisions_match_plain_torch_on_3_ranks(ranks3):
    results = ranks3.run(scaler_job, "one_loss")
    assert len(set(results[0][2])) == 3, "every rank must own one of the forced overflows"
    for rank, (got, want, _, err, finite) in enumerate(results):
        assert got == want and finite and err < 5e-3, (rank, got, want, err)


def plain_scaler_job(rank, world):
    torch.manual_seed(0)
    model = mlp(width=8, depth=2, d_in=4, d_out=2)
    rt = paramfsm.shard(model)
    opt = torch.optim.SGD(rt.shard_parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(model(torch.randn(2, 4)).pow(2).mean()).backward()
    try:
        scaler.step(opt)
    except paramfsm.ParamFSMError as exc:
        return str(exc)
    finally:
        rt.detach()
    return None


def test_a_plain_grad_scaler_on_shards_is_refused(ranks2):
    for message in ranks2.run(plain_scaler_job):
        assert message is not None and "paramfsm.amp.GradScaler" in message, message
