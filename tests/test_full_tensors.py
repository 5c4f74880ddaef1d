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


@pytest.fixture(scope="module")
def ranks2(in_process2):
    """This file's two ranks are threads of the test process (``gloo_ranks.py``), where ``make mutate`` sees
    them; a test that needs processes of its own asks for ``suite_ranks2``."""
    return in_process2


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


def two_parameters_job(rank, world):
    """Rank 0 asks for one parameter's full gradient while rank 1 asks for another's full value, of the
    same size: a collective of the same size on both ranks, but not the same tensor."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6, bias=False), nn.Linear(6, 6, bias=False))
    plain = {n: p.detach().clone() for n, p in model.named_parameters()}
    rt = paramfsm.shard(model)
    model(torch.randn(2, 6, generator=torch.Generator().manual_seed(1))).sum().backward()
    try:
        got = rt.full_grad("0.weight") if rank == 0 else rt.full_param("1.weight")
        caught = None
    except RankDesync as exc:
        caught, got = str(exc), None
    again = {n: rt.full_param(n) for n in plain}  # the same request on both ranks: in step again
    rt.close()
    return caught, got, all(torch.equal(again[n], plain[n]) for n in plain)


def test_full_tensors_of_two_parameters_of_one_size_raise_rank_desync(ranks2):
    for rank, (caught, got, recovered) in enumerate(ranks2.run(two_parameters_job)):
        assert caught is not None, f"rank {rank} returned a mixed tensor instead of raising: {got}"
        assert "<full gradient '0.weight'>" in caught and "<full parameter '1.weight'>" in caught, caught
        assert recovered


class Tied(nn.Module):
    """An embedding and an LM head sharing one weight: two state-dict keys, one parameter."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.head = nn.Linear(4, 7, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        return self.head(self.embed(tokens))


def tied_load_job(rank, world):
    """Load a plain tied model's state dict whose two keys are equal but distinct tensors (as a copy per
    key, a dtype or device conversion, or a file without aliases gives) into a sharded tied model."""
    torch.manual_seed(0)
    plain = Tied()
    copied = {key: value.clone() for key, value in plain.state_dict().items()}
    assert copied["embed.weight"] is not copied["head.weight"]
    torch.manual_seed(1)
    model = Tied()
    rt = paramfsm.shard(model)
    rt.load_full_state_dict(copied)
    loaded = rt.full_state_dict()
    tokens = torch.tensor([[1, 2, 3]])
    same_output = torch.allclose(model(tokens), plain(tokens))
    copied["head.weight"] = copied["head.weight"] + 1
    try:
        rt.load_full_state_dict(copied)
        refused = None
    except paramfsm.ParamFSMError as exc:
        refused = str(exc)
    rt.close()
    return torch.equal(loaded["embed.weight"], plain.embed.weight), same_output, refused


def test_a_plain_tied_state_dict_with_distinct_equal_tensors_loads(ranks2):
    for loaded, same_output, refused in ranks2.run(tied_load_job):
        assert loaded and same_output
        assert refused and "'embed.weight' and 'head.weight'" in refused and "different values" in refused
