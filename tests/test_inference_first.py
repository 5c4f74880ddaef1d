"""A model whose first forward runs under ``torch.inference_mode()`` trains and takes writes afterwards.

A parameter of 64 KiB or more keeps one full tensor for life (gathered in place). When its first gather ran
inside ``inference_mode`` that tensor was an inference tensor, and every later write to it failed ("Inplace
update to inference tensor outside InferenceMode"): a ``rt.gathered(writeback=True)`` write, the next
training forward's unpack. Found by ``paramfsm verify`` on ``sized_lm``. Compared with plain torch.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import paramfsm


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(1400, 13), nn.Linear(13, 4))  # 72.8 KB: a persistent full tensor


def _tokens(step):
    return torch.randint(0, 1400, (4, 6), generator=torch.Generator().manual_seed(step))


def _loop(model, gathered, rank=0, world=1):
    with torch.inference_mode():
        model.eval()
        model(_tokens(0).chunk(world)[rank])
        model.train()
    with torch.no_grad(), gathered():
        model[0].weight.mul_(0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        model(_tokens(step).chunk(world)[rank]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def job(rank, world):
    model = _model()
    rt = paramfsm.shard(model, min_unit_bytes=0)
    _loop(model, rt.gathered, rank, world)
    full = rt.full_state_dict()
    rt.close()
    return full


def test_an_inference_mode_first_forward_leaves_parameters_writable(ranks2):
    import contextlib

    plain = _model()
    _loop(plain, contextlib.nullcontext)
    for rank, full in enumerate(ranks2.run(job)):
        for name, value in plain.state_dict().items():
            torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank} {name}: {m}")
