"""Which optimizers step paramfsm's flat shards, which step whole parameters, and which are refused.

paramfsm steps an element-wise optimizer on each rank's flat 1-D shard; any other steps whole parameters
([Note: element-wise optimizers] in paramfsm.optim, [Note: whole-parameter optimizers] in
paramfsm.optim.whole_params). One Adafactor step on a sharded ``Linear(7, 15)`` was 0.035 off plain torch (the flat
shard got an unfactored second moment), with no error; Muon raised torch's own shape error. Now both match
plain torch after 5 steps at world 2 and 3 on odd shapes; where whole parameters cannot be stepped (a closure,
an offloaded model) the first step is refused before anything changes, naming the parameter, its module,
unit, state and rank and the way to declare an element-wise optimizer.
"""

from __future__ import annotations

import pytest
import torch
from patterns_common import Pair, batch
from torch import nn

import paramfsm
from paramfsm.optim import OptimizerNotElementwise

STEPS = 5


class SignSGD(torch.optim.Optimizer):
    """An element-wise rule torch does not ship: p -= lr * sign(grad)."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


class MomentumSGD(torch.optim.SGD):
    """A subclass that keeps SGD's step (changes a default only): still SGD's element-wise update."""

    def __init__(self, params):
        super().__init__(params, lr=0.05, momentum=0.9)


def _odd_model(bias: bool):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 15, bias=bias), nn.Tanh(), nn.Linear(15, 5, bias=bias), nn.Tanh(),
                         nn.Linear(5, 3, bias=bias))


def _make(kind):
    if kind == "adafactor":
        return lambda params: torch.optim.Adafactor(params, lr=0.05)
    if kind == "muon":
        return lambda params: torch.optim.Muon(params, lr=0.05)
    if kind == "signsgd":
        return lambda params: SignSGD(params, lr=0.01)
    raise ValueError(kind)


def _x(step, world):
    return torch.randn(6 * world, 7, generator=torch.Generator().manual_seed(step))


def whole_job(rank, world, kind, over, units, param_dtype):
    model = _odd_model(bias=kind != "muon")
    rt = None
    if world:
        kwargs = {} if units == "default" else {"min_unit_bytes": 0}
        rt = paramfsm.shard(model, param_dtype=param_dtype, **kwargs)
    params = list(rt.shard_parameters()) if over == "shards" else list(model.parameters())
    opt = _make(kind)(params)
    seen = []
    opt.register_step_pre_hook(lambda o, a, k: seen.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: seen.append("post"))
    for step in range(STEPS):
        x = _x(step, max(world, 1))
        if world:
            x = x.chunk(world)[rank]
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    full = rt.full_state_dict() if rt is not None else model.state_dict()
    if rt is not None:
        rt.close()
    return full, seen


def _plain(kind, world):
    model = _odd_model(bias=kind != "muon")
    opt = _make(kind)(model.parameters())
    for step in range(STEPS):
        model(_x(step, world)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model.state_dict()


def _check(results, plain, rtol=1e-5, atol=1e-6):
    for rank, (full, seen) in enumerate(results):
        assert seen == ["pre", "post"] * STEPS, (rank, seen)
        for name, value in plain.items():
            torch.testing.assert_close(full[name], value, rtol=rtol, atol=atol,
                                       msg=lambda m: f"rank {rank} {name}: {m}")


@pytest.mark.parametrize("kind,over", [("adafactor", "model"), ("adafactor", "shards"), ("muon", "model"),
                                       ("signsgd", "shards")])
@pytest.mark.parametrize("units", ["default", "per_module"])
def test_shape_dependent_optimizers_match_plain_torch_at_world_2(ranks2, kind, over, units):
    _check(ranks2.run(whole_job, kind, over, units, None), _plain(kind, 2))


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["adafactor", "muon"])
def test_shape_dependent_optimizers_match_plain_torch_at_world_3(ranks3, kind):
    _check(ranks3.run(whole_job, kind, "model", "per_module", None), _plain(kind, 3))


def test_whole_parameters_step_at_full_precision_under_param_dtype(ranks2):
    """The optimizer steps the shards' float32 values, not the bfloat16 compute copy: the result is plain
    torch's up to the bfloat16 forward and backward, and moves like it."""
    _check(ranks2.run(whole_job, "adafactor", "model", "per_module", torch.bfloat16), _plain("adafactor", 2),
           rtol=3e-2, atol=3e-3)


def refused_job(rank, world, why, folder):
    model = _odd_model(bias=True)
    offload = paramfsm.Offload(optimizer="cpu") if why == "offload" else None
    rt = paramfsm.shard(model, min_unit_bytes=0, offload=offload)
    before = {name: p.detach().clone() for name, p in rt.named_shard_parameters()}
    opt = torch.optim.Adafactor(model.parameters(), lr=0.01)
    loss = lambda: model(torch.randn(4, 7)).pow(2).mean()  # noqa: E731
    loss().backward()
    with pytest.raises(OptimizerNotElementwise) as caught:
        opt.step(lambda: loss()) if why == "closure" else opt.step()
    after = dict(rt.named_shard_parameters())
    unchanged = all(torch.equal(before[name], after[name]) for name in before)
    rt.close()
    return str(caught.value), unchanged


@pytest.mark.parametrize("why", ["closure", "offload"])
def test_where_whole_parameters_cannot_be_stepped_the_first_step_is_refused(ranks2, tmp_path, why):
    for rank, (message, unchanged) in enumerate(ranks2.run(refused_job, why, str(tmp_path))):
        for fact in ("Adafactor.step()", "parameter '0.weight'", "module '0'", "unit '0'", f"rank {rank}",
                     "state NOT_AVAILABLE", "What to do", "paramfsm.optim.elementwise(Adafactor)"):
            assert fact in message, (fact, message)
        assert unchanged


def declared_job(rank, world, make):
    torch.manual_seed(0)
    pair = Pair(nn.Sequential(nn.Linear(7, 15), nn.Tanh(), nn.Linear(15, 3)), rank, world, make_optimizer=make,
                min_unit_bytes=0)
    for step in range(3):
        x, = batch(step, world, 2, (7,))
        pair.zero_grad()
        pair.model(pair.local(x)).pow(2).mean().backward()
        pair.ref.model(x).pow(2).mean().backward()
        pair.check_grads(f"step {step}")
        pair.step(f"step {step}")
    return pair.finish()


def test_a_declared_element_wise_optimizer_and_a_subclass_keeping_sgds_step_train_like_plain_torch(ranks2):
    paramfsm.optim.elementwise(SignSGD)  # in this process; the ranks declare it in the job's module below
    assert ranks2.run(declared_job, MomentumSGD)[0]["checks"] == 6
    assert ranks2.run(declared_signsgd_job)[0]["checks"] == 6


def declared_signsgd_job(rank, world):
    paramfsm.optim.elementwise(SignSGD)
    return declared_job(rank, world, lambda params: SignSGD(params, lr=0.01))


def test_elementwise_takes_an_optimizer_class_only():
    with pytest.raises(TypeError, match="Optimizer subclass"):
        paramfsm.optim.elementwise(SignSGD([nn.Parameter(torch.zeros(2))]))


def resume_job(rank, world, folder, kind):
    def build():
        model = _odd_model(bias=kind != "muon")
        rt = paramfsm.shard(model, min_unit_bytes=0)
        return model, rt, _make(kind)(model.parameters())

    def train(model, opt, steps):
        for step in steps:
            model(_x(step, world).chunk(world)[rank]).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    model, rt, opt = build()
    train(model, opt, range(2))
    paramfsm.checkpoint.save(rt, folder, optimizer=opt)
    train(model, opt, range(2, STEPS))
    straight = rt.full_state_dict()
    rt.close()
    model, rt, opt = build()
    paramfsm.checkpoint.load(rt, folder, optimizer=opt)
    train(model, opt, range(2, STEPS))
    resumed = rt.full_state_dict()
    rt.close()
    return straight, resumed


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["adafactor", "muon"])
def test_a_whole_parameter_optimizer_resumes_from_a_checkpoint_exactly(ranks2, tmp_path, kind):
    for rank, (straight, resumed) in enumerate(ranks2.run(resume_job, str(tmp_path / "ckpt"), kind)):
        for name, value in straight.items():
            assert torch.equal(resumed[name], value), (rank, name)
