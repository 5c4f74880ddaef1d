"""A unit or merged module called on its own, its output dropped, ends no other backward.

A sub-module run again on an activation the root forward also used (a probe, a head on saved hidden states)
registered its end-of-backward hook on that activation itself, so the root forward's backward, passing through
the activation, ended the unit's backward early: its hold was released while the root forward's backward still
ran through it, and a frozen parameter (which no gradient holds) was read empty ("weight of shape [0]"). Found
by ``paramfsm verify`` (a SubForward of a merged LayerNorm at world 3); see [Note: a call on its own ends only
its own backward] in ``paramfsm.engine.events.hooks``. Compared with plain torch on the global batch.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import paramfsm


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 4))
    model[1].weight.requires_grad_(False)
    model[3].weight.requires_grad_(False)
    return model


def _x():
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(3))


def _loop(model, x):
    seen = {}
    handle = model[3].register_forward_pre_hook(lambda m, args: seen.setdefault("act", args[0]))
    out = model(x)
    handle.remove()
    probe = model[3](seen["act"])  # called on its own, on the root forward's activation; dropped
    del probe
    out.pow(2).mean().backward()


def job(rank, world, units):
    model = _model()
    rt = paramfsm.shard(model, units=(lambda name, module: False) if units == "one" else None, min_unit_bytes=0)
    _loop(model, _x().chunk(world)[rank])
    grads = {name: rt.full_grad(name) for name, p in model.named_parameters() if p.requires_grad}
    rt.close()
    return grads


@pytest.mark.parametrize("units", ["one", "per_module"])
def test_a_dropped_call_on_its_own_does_not_end_the_root_forwards_backward(ranks2, units):
    plain = _model()
    _loop(plain, _x())
    for rank, grads in enumerate(ranks2.run(job, units)):
        for name, p in plain.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(grads[name], p.grad, rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"rank {rank} {name}: {m}")
