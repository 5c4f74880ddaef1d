"""A module merged into its parent's unit (the default units) and called on its own works as its own unit did.

Each call gathers the unit for the call and releases it after: outside any forward, under ``no_grad``,
inside another unit's forward, and through the backward of its outputs. Gradients and parameters are
compared with plain torch on the global batch.
"""

from __future__ import annotations

import pytest
import torch
from patterns_common import Pair, batch
from torch import nn

import paramfsm
from paramfsm import State
from paramfsm.engine.storage.default_units import MIN_UNIT_BYTES


class Heads(nn.Module):
    """A small trunk and two small heads (all merged into the root), and a big block that is a unit of its own
    and calls the value head inside its forward."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16))
        self.policy = nn.Linear(16, 4)
        self.value = nn.Linear(16, 1)
        self.big = Big(self.value)

    def forward(self, x):
        return self.policy(self.trunk(x))


class Big(nn.Module):
    """Two layers over ``MIN_UNIT_BYTES`` (units of their own); its forward calls a module of another unit."""

    def __init__(self, value: nn.Module):
        super().__init__()
        self.proj = nn.Linear(16, 1100)
        self.back = nn.Linear(1100, 16)
        self.scorer = [value]  # not a child: the value head stays the root's

    def forward(self, h):
        return self.scorer[0](self.back(torch.tanh(self.proj(h))))


def members_job(rank, world):
    torch.manual_seed(0)
    pair = Pair(Heads(), rank, world, min_unit_bytes=MIN_UNIT_BYTES)  # ranks inherit the suite's 0
    units = [u.name for u in pair.rt.units]
    model, ref = pair.model, pair.ref.model
    for step in range(3):
        (x,) = batch(step, world, 2, (8,))
        pair.zero_grad()
        h, h_ref = model.trunk(pair.local(x)), ref.trunk(x)  # a merged module alone: forward and backward
        loss = model.value(h).pow(2).mean() + model.big(h).mean() + model(pair.local(x)).pow(2).mean()
        loss.backward()
        (ref.value(h_ref).pow(2).mean() + ref.big(h_ref).mean() + ref(x).pow(2).mean()).backward()
        pair.assert_states(State.NOT_AVAILABLE, what=f"step {step}")
        pair.check_grads(f"step {step}")
        pair.step(f"step {step}")
    with torch.no_grad():
        (x,) = batch(9, world, 2, (8,))
        got = model.value(model.trunk(pair.local(x)))
        want = ref.value(ref.trunk(pair.local(x)))
    pair.assert_states(State.NOT_AVAILABLE, what="no_grad")
    report = pair.finish()
    report["units"], report["no_grad"] = units, (got - want).abs().max().item()
    return report


def test_merged_modules_called_on_their_own_train_like_plain_torch(ranks2):
    for report in ranks2.run(members_job):
        assert report["units"] == ["<root>", "big.proj", "big.back"], report["units"]  # trunk and heads: merged
        assert report["checks"] == 6 and report["no_grad"] < 1e-6, report


class Gained(nn.Sequential):
    """A root that owns a parameter and calls other units."""

    def __init__(self):
        super().__init__(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, 4))

    def forward(self, x):
        return super().forward(x) * self.gain


def frozen_before_the_first_forward_job(rank, world):
    torch.manual_seed(0)
    model = Gained()
    pair = Pair(model, rank, world, min_unit_bytes=0)
    model.gain.requires_grad_(False)
    pair.ref.model.gain.requires_grad_(False)
    for step in range(2):
        (x,) = batch(step, world, 2, (8,))
        pair.zero_grad()
        model(pair.local(x)).pow(2).mean().backward()
        pair.ref.model(x).pow(2).mean().backward()
        pair.check_grads(f"step {step}")
        pair.step(f"step {step}")
        model.gain.requires_grad_(True)
        pair.ref.model.gain.requires_grad_(True)
    return pair.finish()


def test_a_parameter_of_a_parent_unit_frozen_before_the_first_forward_trains_like_plain_torch(ranks2):
    """The root calls other units, so its parameters' gradient nodes are hooked at its first forward; one
    frozen then is hooked at the first forward after it is unfrozen."""
    for report in ranks2.run(frozen_before_the_first_forward_job):
        assert report["checks"] == 4, report


def gathered_member_job(rank, world):
    torch.manual_seed(0)
    pair = Pair(Heads(), rank, world, min_unit_bytes=MIN_UNIT_BYTES)
    model, ref = pair.model, pair.ref.model
    with torch.no_grad(), pair.rt.gathered(model.value):  # a merged module: held through the root's unit
        model.value.weight.mul_(0.5)
    with torch.no_grad():
        ref.value.weight.mul_(0.5)
    (x,) = batch(0, world, 2, (8,))
    pair.zero_grad()
    (model.value(model.trunk(pair.local(x))).pow(2).mean() + model(pair.local(x)).pow(2).mean()).backward()
    (ref.value(ref.trunk(x)).pow(2).mean() + ref(x).pow(2).mean()).backward()
    pair.check_grads("after a write inside rt.gathered(merged module)")
    pair.step("after a write inside rt.gathered(merged module)")
    return pair.finish()


def test_gathered_holds_a_merged_module_through_its_unit(ranks2):
    assert ranks2.run(gathered_member_job)[0]["checks"] == 2
