"""A refused change leaves the model exactly as it was.

``shard()`` refusing an offload setting (an unwritable folder, a bound below one unit, units with different
bounds, a predicate answering something other than an Offload) must leave the model trainable, with the same
values, and shardable again; ``model.double()`` / ``.half()`` / ``.to(dtype)`` on a sharded model must refuse
before converting anything (a buffer converted first broke the next forward with a dtype mismatch).
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import paramfsm
from paramfsm.errors import ArgumentError, ArgumentTypeError, OffloadError, ParamFSMError


class Scale(nn.Module):
    """Buffers only: ``Module._apply`` converts them before it reaches any parameter after them."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 8))

    def forward(self, x):
        return x * self.scale


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = Scale()
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x):
        return self.body(self.pre(x))


def _model():
    torch.manual_seed(0)
    return Scaled()


def _batch(step):
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(50 + step))


def _refused(case, folder):
    if case == "unwritable":
        blocker = os.path.join(folder, "a-file")
        open(blocker, "w").close()
        return paramfsm.Offload(params="disk", path=os.path.join(blocker, "tier"))
    if case == "bound":
        return paramfsm.Offload(params="cpu", max_resident_bytes=16)
    if case == "bounds":
        return lambda name, module: paramfsm.Offload(params="cpu", max_resident_bytes=4096 if name else 8192)
    if case == "predicate":
        return lambda name, module: "disk"
    raise ValueError(case)


def refused_shard_job(rank, world, folder, case):
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        paramfsm.shard(model, offload=_refused(case, folder))
    except (OffloadError, ArgumentError, ArgumentTypeError) as exc:
        error = type(exc).__name__
    else:
        error = None
    after = {k: v.clone() for k, v in model.state_dict().items()}
    out = model(_batch(0).chunk(world)[rank])  # usable as a plain model
    rt = paramfsm.shard(model)  # and shardable again
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        model(_batch(step).chunk(world)[rank]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    trained = rt.full_state_dict()
    rt.close()
    return error, before, after, out.shape, trained


def _plain_trained():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        model(_batch(step)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


@pytest.mark.parametrize("case,error", [("unwritable", "OffloadError"), ("bound", "ArgumentError"),
                                        ("bounds", "ArgumentError"), ("predicate", "ArgumentTypeError")])
def test_a_refused_shard_leaves_the_model_as_it_was(ranks2, tmp_path, case, error):
    for rank, (got, before, after, shape, trained) in enumerate(ranks2.run(refused_shard_job, str(tmp_path), case)):
        assert got == error, (rank, got)
        for name, value in before.items():
            assert torch.equal(after[name], value), (rank, name)
        assert tuple(shape) == (2, 4)
        parameters = {n for n, _ in _model().named_parameters()}
        plain = _plain_trained()
        for name in parameters:
            torch.testing.assert_close(trained[name], plain[name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


def convert_job(rank, world, how):
    model = _model()
    rt = paramfsm.shard(model)
    model(_batch(0).chunk(world)[rank]).pow(2).mean().backward()
    try:
        {"double": lambda: model.double(), "half": lambda: model.half(),
         "to": lambda: model.to(torch.float64), "child": lambda: model.body.double()}[how]()
    except ParamFSMError as exc:
        message = str(exc)
    else:
        message = None
    dtypes = {name: b.dtype for name, b in model.named_buffers()}
    model(_batch(1).chunk(world)[rank]).pow(2).mean().backward()  # still trains
    full = rt.full_state_dict()
    rt.close()
    return message, dtypes, full


@pytest.mark.parametrize("how", ["double", "half", "to", "child"])
def test_converting_a_sharded_models_dtype_refuses_before_changing_anything(ranks2, how):
    for rank, (message, dtypes, full) in enumerate(ranks2.run(convert_job, how)):
        assert message is not None, f"rank {rank}: {how} was not refused"
        for word in ("body.0.weight", "'body.0'", f"rank {rank}", "What to do", "param_dtype"):
            assert word in message, (word, message)
        assert dtypes["pre.scale"] == torch.float32, dtypes
        assert all(v.dtype == torch.float32 for v in full.values() if v.is_floating_point())
