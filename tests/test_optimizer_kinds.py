"""Which optimizers step paramfsm's flat shards: element-wise ones, recognised or declared; others are refused.

paramfsm steps every optimizer on each rank's flat 1-D shard of each parameter, which is the optimizer's own
update only for element-wise rules ([Note: element-wise optimizers] in paramfsm.optim). One Adafactor step
on a sharded ``Linear(7, 15)`` was 0.035 off plain torch (the flat shard got an unfactored second moment),
with no error; Muon raised torch's own shape error. Now the first step of an optimizer paramfsm does not know
to be element-wise is refused before anything changes, naming the parameter, its module, unit, state and
rank and the way to declare an element-wise optimizer; a declared one trains like plain torch.
"""

from __future__ import annotations

import pytest
import torch
from patterns_common import Pair, batch
from torch import nn

import paramfsm
from paramfsm.optim import OptimizerNotElementwise


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


def refused_job(rank, world, kind):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(7, 15, bias=False), nn.Tanh(), nn.Linear(15, 3))
    rt = paramfsm.shard(model, min_unit_bytes=0)
    before = {name: p.detach().clone() for name, p in rt.named_shard_parameters()}
    params = list(model.parameters()) if kind == "model" else rt.shard_parameters()
    opt = torch.optim.Adafactor(params, lr=0.01) if kind == "model" else SignSGD(params)
    model(torch.randn(4, 7)).pow(2).mean().backward()
    with pytest.raises(OptimizerNotElementwise) as caught:
        opt.step()
    after = dict(rt.named_shard_parameters())
    unchanged = all(torch.equal(before[name], after[name]) for name in before)
    rt.close()
    return str(caught.value), unchanged


@pytest.mark.parametrize("kind", ["model", "shards"], ids=["adafactor_over_model", "custom_over_shards"])
def test_an_optimizer_not_known_element_wise_is_refused_before_it_steps(ranks2, kind):
    for rank, (message, unchanged) in enumerate(ranks2.run(refused_job, kind)):
        name = "Adafactor" if kind == "model" else "SignSGD"
        for fact in (f"{name}.step()", "parameter '0.weight'", "module '0'", "unit '0'", f"rank {rank}",
                     "state NOT_AVAILABLE", f"paramfsm.optim.elementwise({name})"):
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
