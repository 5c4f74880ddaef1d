"""``torch.func`` transforms are refused at the root forward; sparse embedding gradients train like plain torch.

``torch.func.grad``, ``vmap(grad)`` and ``jacrev`` through a sharded model failed inside paramfsm ("autograd.Function
... must override setup_context", or a ModelChanged about replaced parameters); now they raise one paramfsm error
before anything is gathered, and the model trains on afterwards (see [Note: torch.func through a sharded model]).
``Embedding`` / ``EmbeddingBag(sparse=True)`` crashed in backward inside the gradient packing; their gradients are
now made dense before the reduce-scatter (see [Note: sparse gradients]) and train like plain torch.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import paramfsm
from paramfsm.errors import ParamFSMError


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _x(step):
    return torch.randn(4, 4, generator=torch.Generator().manual_seed(step))


def transform_job(rank, world, how, units):
    model = _mlp()
    rt = paramfsm.shard(model, **({} if units == "default" else {"min_unit_bytes": 0}))
    x = _x(0).chunk(world)[rank]
    try:
        if how == "grad":
            params = dict(model.named_parameters())
            torch.func.grad(lambda p: torch.func.functional_call(model, p, (x,)).pow(2).sum())(params)
        elif how == "vmap_grad":
            torch.func.vmap(torch.func.grad(lambda row: model(row).sum()))(x)
        else:
            torch.func.jacrev(lambda row: model(row))(x[0])
    except ParamFSMError as exc:
        message = str(exc)
    else:
        message = None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):  # the refused forward left nothing behind
        model(_x(step).chunk(world)[rank]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    full = rt.full_state_dict()
    rt.close()
    return message, full


def _plain_mlp():
    model = _mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        model(_x(step)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


@pytest.mark.parametrize("how", ["grad", "vmap_grad", "jacrev"])
@pytest.mark.parametrize("units", ["default", "per_module"])
def test_torch_func_transforms_are_refused_naming_everything(ranks2, how, units):
    plain = _plain_mlp()
    for rank, (message, full) in enumerate(ranks2.run(transform_job, how, units)):
        assert message is not None, f"rank {rank}: {how} was not refused"
        for word in ("torch.func", f"rank {rank}", "'0.weight'", "module '0'", "state NOT_AVAILABLE",
                     "'forward'", "What to do", "rt.full_state_dict()"):
            assert word in message, (word, message)
        for name, value in plain.items():
            torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


class Embedded(nn.Module):
    def __init__(self, bag: bool):
        super().__init__()
        self.bag = bag
        self.emb = nn.EmbeddingBag(20, 8, sparse=True, mode="sum") if bag else nn.Embedding(20, 8, sparse=True)
        self.out = nn.Linear(8, 3)

    def forward(self, tokens):
        return self.out(self.emb(tokens) if self.bag else self.emb(tokens).mean(1))


def _tokens(step):
    return torch.randint(0, 20, (4, 5), generator=torch.Generator().manual_seed(step))


def sparse_job(rank, world, bag, units):
    torch.manual_seed(0)
    model = Embedded(bag)
    rt = None
    if world:
        rt = paramfsm.shard(model, **({} if units == "default" else {"min_unit_bytes": 0}))
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    for step in range(3):
        tokens = _tokens(step).chunk(world)[rank] if world else _tokens(step)
        model(tokens).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    if rt is None:
        return model.state_dict()
    full = rt.full_state_dict()
    rt.close()
    return full


@pytest.mark.parametrize("bag", [False, True], ids=["Embedding", "EmbeddingBag"])
@pytest.mark.parametrize("units", ["default", "per_module"])
def test_sparse_embedding_gradients_train_like_plain_torch(ranks2, bag, units):
    plain = sparse_job(0, 0, bag, units)
    for rank, full in enumerate(ranks2.run(sparse_job, bag, units)):
        for name, value in plain.items():
            torch.testing.assert_close(full[name], value, rtol=1e-4, atol=1e-5,
                                       msg=lambda m: f"rank {rank} {name}: {m}")
