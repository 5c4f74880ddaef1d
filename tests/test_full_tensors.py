"""Full-tensor collectives (``rt.full_param``, ``full_grad``, ``full_state_dict``, ``close``) on 2 gloo ranks.

They are rank-checked like a unit's gather: when one rank asks for a full
tensor while the other runs something else of the same size, both raise
RankDesync instead of returning the other collective's values. Tied
parameters are gathered once and share one tensor, as in a plain state dict.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import paramfsm
from paramfsm import RankDesync, State


def _linear():
    """One unit with one parameter: its forward bucket has exactly the size of its full-tensor gather."""
    torch.manual_seed(0)
    return nn.Linear(8, 6, bias=False)


def desync_job(rank, world, debug, other):
    model = _linear()
    plain = model.weight.detach().clone()
    rt = paramfsm.shard(model, debug=debug)
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    if other == "full_grad":
        model(x).pow(2).mean().backward()  # both ranks: a gradient to gather
    before = rt.counters["all_gathers"]
    try:
        if rank == 0:
            rt.full_param("weight")
        elif other == "forward":
            model(x)
        else:
            rt.full_grad("weight")
        caught = None
    except RankDesync as exc:
        caught = {"unit": exc.unit, "message": str(exc)}
    issued = rt.counters["all_gathers"] - before
    rt.reset()  # rank 1's interrupted forward; a no-op elsewhere
    rt.set_step(5)  # rank 1 counted a step rank 0 did not: name the step to be in step again
    assert set(rt.states().values()) == {State.NOT_AVAILABLE}
    again = rt.full_param("weight")  # the ranks are in step again
    rt.close()
    return caught, issued, torch.equal(again, plain)


@pytest.mark.parametrize("debug", [False, True], ids=["default", "debug"])
@pytest.mark.parametrize("other", ["forward", "full_grad"])
def test_a_full_tensor_paired_with_another_collective_raises_on_every_rank(ranks2, debug, other):
    results = ranks2.run(desync_job, debug, other)
    for rank, (caught, issued, recovered) in enumerate(results):
        assert caught is not None, f"rank {rank}: no RankDesync ({other}, debug={debug})"
        assert "<full parameter 'weight'>" in caught["message"], caught["message"]
        assert recovered, f"rank {rank}: full_param after the desync differs from the plain weight"
        # debug=True raises at the header, before the payload; by default the payload carries the tag.
        assert issued == (0 if debug else 1), issued
    assert results[0][0]["unit"] == "<full parameter 'weight'>"
    wanted = "<root>" if other == "forward" else "<full gradient 'weight'>"  # the Linear is the root unit
    assert results[1][0]["unit"] == wanted


def in_step_job(rank, world, debug):
    """Every full-tensor collective in step on both ranks: values equal plain torch, no false alarm."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))
    plain = {n: p.detach().clone() for n, p in model.named_parameters()}
    rt = paramfsm.shard(model, debug=debug)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(2))
    model(x).sum().backward()
    fulls = {n: rt.full_param(n) for n in plain}
    grads = {n: rt.full_grad(n) for n in plain}
    sd = rt.full_state_dict()
    closed = rt.close()
    same = all(torch.equal(fulls[n], plain[n]) and torch.equal(sd[n], plain[n]) for n in plain)
    same_grads = all(torch.equal(grads[n], p.grad) for n, p in closed.named_parameters())
    return same, same_grads


@pytest.mark.parametrize("debug", [False, True], ids=["default", "debug"])
def test_full_tensors_in_step_match_plain_torch(ranks2, debug):
    assert ranks2.run(in_step_job, debug) == [(True, True)] * 2
