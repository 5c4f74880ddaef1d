"""Models built on the meta device: ``shard(device=)``, ``rt.init_weights`` against plain torch, and the guard.

The init contract: after ``torch.manual_seed(s)``, ``rt.init_weights()`` on a
meta-built, sharded model gives the parameters (and buffers) that the same
seed and ``reset_parameters()`` in ``model.modules()`` order give an unsharded
copy, bit for bit, at worlds 1, 2 and 3; ``rt.init_weights(fn)`` matches
``model.apply(fn)``. The model has odd sizes (shards with padding), a tied
weight (initialised twice, the last write wins), a block whose
``reset_parameters`` writes its child's weight, a parameter of its own, and
BatchNorm buffers.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import paramfsm
from paramfsm import ParamFSMError


class Block(nn.Module):
    """Its reset_parameters writes its own gain and its child's weight (after the child's own init ran first)."""

    def __init__(self, width: int):
        super().__init__()
        self.inner = nn.Linear(width, width)
        self.gain = nn.Parameter(torch.empty(width))

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.gain, 0.5, 1.5)
        nn.init.orthogonal_(self.inner.weight)

    def forward(self, x):
        return torch.tanh(self.inner(x)) * self.gain


class TiedNet(nn.Module):
    def __init__(self, vocab: int = 13, width: int = 7):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.block = Block(width)
        self.norm = nn.BatchNorm1d(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        h = self.block(self.embed(tokens)).sum(1)
        return self.head(self.norm(h))


def plain_reset(model: nn.Module) -> None:
    with torch.no_grad():
        for module in model.modules():
            if callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()


def scaled_normal(module: nn.Module) -> None:
    for name, param in module.named_parameters(recurse=False):
        nn.init.normal_(param, std=0.1 if name == "weight" else 1.0)


def _full(rt, model):
    params = {n: rt.full_param(n) for n, _ in model.named_parameters()}
    return params, {n: b.clone() for n, b in model.named_buffers()}


def init_job(rank, world):
    with torch.device("meta"):
        model = TiedNet()
    rt = paramfsm.shard(model, device="cpu")
    tokens = torch.randint(0, 13, (4, 3), generator=torch.Generator().manual_seed(1))
    try:
        model(tokens)
        guarded = "no error"
    except ParamFSMError as exc:
        guarded = str(exc)
    out = {"guarded": guarded, "dumps": list(rt.flight.dumps)}
    torch.manual_seed(5)
    rt.init_weights()
    out["reset"] = _full(rt, model)
    out["after"] = torch.rand(3)  # the RNG after init: plain torch drew exactly as much
    torch.manual_seed(6)
    rt.init_weights(scaled_normal)  # again: re-initialises
    out["fn"] = _full(rt, model)
    model.train()
    loss = model(tokens).square().mean()
    loss.backward()
    out["loss"] = loss.detach()
    out["grads"] = {n: rt.full_grad(n) for n, _ in model.named_parameters()}
    rt.close()
    return out


@pytest.mark.parametrize("pool", ["ranks1", "ranks2", "ranks3"])
def test_init_weights_is_plain_init(pool, request):
    results = request.getfixturevalue(pool).run(init_job)
    plain = TiedNet()
    torch.manual_seed(5)
    plain_reset(plain)
    after = torch.rand(3)
    reset = ({n: p.detach().clone() for n, p in plain.named_parameters()},
             {n: b.clone() for n, b in plain.named_buffers()})
    torch.manual_seed(6)
    with torch.no_grad():
        plain.apply(scaled_normal)
    tokens = torch.randint(0, 13, (4, 3), generator=torch.Generator().manual_seed(1))
    loss = plain(tokens).square().mean()
    loss.backward()
    for rank, got in enumerate(results):
        assert "built on the meta device" in got["guarded"] and "rt.init_weights()" in got["guarded"]
        assert got["dumps"] == [], "a forward stopped before any transition wrote a flight-recorder dump"
        for what, want in (("reset", reset), ("fn", ({n: p for n, p in plain.named_parameters()}, {}))):
            params, buffers = got[what]
            for name, value in want[0].items():
                assert torch.equal(params[name], value), f"rank {rank}, {what}: {name} differs from plain init"
            for name, value in want[1].items():
                assert torch.equal(buffers[name], value), f"rank {rank}, {what}: buffer {name}"
        assert torch.equal(got["after"], after), "init_weights drew a different amount of randomness"
        torch.testing.assert_close(got["loss"], loss.detach())
        for name, param in plain.named_parameters():
            torch.testing.assert_close(got["grads"][name], param.grad, atol=1e-6, rtol=1e-5)


def test_device_must_agree_or_be_inferable(monkeypatch):
    with pytest.raises(ParamFSMError, match=r"device='cuda:1'.*parameters are on cpu.*model.to"):
        paramfsm.shard(nn.Linear(2, 2), device="cuda:1")
    with torch.device("meta"):
        model = nn.Linear(2, 2)
    with pytest.raises(ParamFSMError, match="device='meta'.*real device"):
        paramfsm.shard(model, device="meta")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(ParamFSMError, match=r"device= is missing and cannot be inferred on local rank 1.*set_device"):
        paramfsm.shard(model)


class Unowned(nn.Module):
    """A parameter no reset_parameters writes."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.pos = nn.Parameter(torch.empty(5))


class Reaching(nn.Module):
    """A reset_parameters that writes a parameter outside its own subtree."""

    def __init__(self, other: nn.Linear):
        super().__init__()
        self.own = nn.Linear(2, 2)
        self.others = [other]

    def reset_parameters(self) -> None:
        nn.init.zeros_(self.others[0].weight)


def bad_init_job(rank, world):
    out = {}
    with torch.device("meta"):
        model = Unowned()
    rt = paramfsm.shard(model)
    try:
        rt.init_weights()
        out["unowned"] = "no error"
    except ParamFSMError as exc:
        out["unowned"] = str(exc)
    with torch.device("meta"):
        other = nn.Linear(2, 2)
        wrapped = nn.Sequential(other, Reaching(other))
    rt2 = paramfsm.shard(wrapped)
    try:
        rt2.init_weights()
        out["reaching"] = "no error"
    except ParamFSMError as exc:
        out["reaching"] = str(exc)
    rt.detach()
    rt2.detach()
    return out


def test_init_weights_refuses_what_it_cannot_do(ranks2):
    out = ranks2.run(bad_init_job)[0]
    assert "['pos'] were not written in full" in out["unowned"], out["unowned"]
    assert "module '1' (Reaching) uses parameter '0.weight'" in out["reaching"], out["reaching"]


def meta_mixed_precision_job(rank, world, shape):
    """Built on meta, sharded with param_dtype=bfloat16 (on a 2-D mesh when ``shape`` is given), initialised,
    trained two steps: the gradients and parameters of plain torch running the same bfloat16 compute."""
    import copy

    from patterns_common import batch
    from torch.distributed.device_mesh import init_device_mesh

    from paramfsm.testing import assert_close_dicts, rank_slice
    from paramfsm.testing.models import mlp

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard")) if shape else None
    with torch.device("meta"):
        model = mlp(width=16, depth=3, d_in=8, d_out=4)
    rt = paramfsm.shard(model, device="cpu", param_dtype=torch.bfloat16, mesh=mesh)
    torch.manual_seed(5)
    rt.init_weights()
    master = mlp(width=16, depth=3, d_in=8, d_out=4)
    torch.manual_seed(5)
    plain_reset(master)
    opt = torch.optim.AdamW(rt.shard_parameters(), lr=1e-2)
    master_opt = torch.optim.AdamW(master.parameters(), lr=1e-2)
    seen = set()
    model[0].register_forward_hook(lambda m, args, out: seen.add((m.weight.dtype, out.dtype)))
    assert_close_dicts({n: rt.full_param(n) for n, _ in model.named_parameters()},
                       {n: p.detach() for n, p in master.named_parameters()}, atol=0, rtol=0, what="init")
    for step in range(2):
        x, = batch(step, world, 2, (8,))
        model(rank_slice(x, rank, world)).float().pow(2).mean().backward()
        low = copy.deepcopy(master).to(torch.bfloat16)
        low(x.bfloat16()).float().pow(2).mean().backward()
        for p, q in zip(master.parameters(), low.parameters()):
            p.grad = q.grad.float()
        want = {n: p.grad for n, p in master.named_parameters()}
        scale = max(g.abs().max().item() for g in want.values())
        assert_close_dicts({n: rt.full_grad(n) for n, _ in model.named_parameters()}, want,
                           atol=scale * 2 ** -5, rtol=0, what=f"grads, step {step}")
        opt.step()
        master_opt.step()
        opt.zero_grad(set_to_none=True)
        master_opt.zero_grad(set_to_none=True)
        assert_close_dicts({n: rt.full_param(n) for n, _ in model.named_parameters()},
                           {n: p.detach() for n, p in master.named_parameters()}, atol=2e-2, rtol=0,
                           what=f"params after step {step}")
    assert seen == {(torch.bfloat16, torch.bfloat16)}, seen
    assert all(s.dtype == torch.float32 and s.device.type == "cpu" for s in rt.shard_parameters())
    rt.close()
    return True


@pytest.mark.parametrize("pool, shape", [("ranks2", None), pytest.param("ranks4", (2, 2), marks=pytest.mark.slow)], ids=["world2", "mesh2x2"])
def test_meta_build_with_param_dtype_trains_like_plain_torch(pool, shape, request):
    assert request.getfixturevalue(pool).run(meta_mixed_precision_job, shape) == [True] * (4 if shape else 2)
