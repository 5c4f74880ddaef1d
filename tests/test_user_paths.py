"""What users hit in this release's paths, each against plain torch or the documented contract (2 gloo ranks).

* An optimizer whose step raises inside one unit's step under offload (a check refusing a NaN gradient) leaves
  every parameter in its param groups: after the gradients are fixed, the next step trains them all.
* ``opt.step(closure)`` under ``Offload(optimizer=...)`` is refused with ``OffloadError`` naming the closure
  (a closure run once per unit would be wrong, and a silent fallback would offload nothing).
* ``rt.gathered(writeback=True)``'s agreement sees every element: ranks that wrote different values in the
  first element only raise, and nothing is written back.
* A module attached after ``shard()`` whose parameters sit in its children (``nn.Sequential(nn.Linear(...))``)
  is refused with ``ModelChanged`` at the next forward, like a bare ``Linear``.
* A write inside ``rt.gathered()`` under offload reaches the offloaded shards, as without offload.
* A subclass whose ``step`` calls ``super().step()`` steps once per call, under offload and as a
  whole-parameter optimizer, also once torch wrapped the parent's ``step`` (any instance of it was built).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch import nn

import paramfsm
import paramfsm.optim
from paramfsm.errors import ModelChanged, OffloadError, ParamFSMError
from paramfsm.testing.models import mlp


@pytest.fixture(scope="module")
def ranks2(in_process2):
    """This file's two ranks are threads of the test process (``gloo_ranks.py``), where ``make mutate`` sees
    them; a test that needs processes of its own asks for ``suite_ranks2``."""
    return in_process2


def _model():
    torch.manual_seed(0)
    return mlp(width=16, depth=4, d_in=8, d_out=4)


def _assert_same(full, plain, rank):
    for key, want in plain.items():
        torch.testing.assert_close(full[key], want, atol=1e-6, rtol=1e-5,
                                   msg=lambda message, key=key: f"rank {rank}: {key}: {message}")


def _batch(step, world, rank):
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(50 + step)).chunk(max(world, 1))[rank]


class CheckedSGD(torch.optim.SGD):
    """SGD that refuses a step over a non-finite gradient (raises inside the step, whichever parameters it has)."""

    def step(self, closure=None):  # declared element-wise below: its update is SGD's
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None and not bool(torch.isfinite(p.grad).all()):
                    raise FloatingPointError("non-finite gradient")
        return super().step(closure)


paramfsm.optim.elementwise(CheckedSGD)


def raising_unit_job(rank, world, folder):
    model = _model()
    rt = paramfsm.shard(model, offload=paramfsm.Offload(optimizer="cpu")) if world else None
    opt = CheckedSGD(model.parameters(), lr=0.1, momentum=0.9)
    count = sum(len(g["params"]) for g in opt.param_groups)
    refused = None
    for step in range(3):
        if step == 1:  # a bad batch: every gradient non-finite, so the first unit's step raises, before any update
            bad = _batch(step, world, rank).clone()
            bad[0, 0] = float("nan")
            model(bad).pow(2).mean().backward()
            try:
                opt.step()
            except FloatingPointError as exc:
                refused = (str(exc), sum(len(g["params"]) for g in opt.param_groups) == count)
            opt.zero_grad()
        model(_batch(step, world, rank)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    full = rt.full_state_dict() if rt is not None else model.state_dict()
    if rt is not None:
        rt.close()
    return refused, {k: v.clone() for k, v in full.items()}


def test_a_unit_step_that_raises_under_offload_leaves_every_parameter_in_the_groups(ranks2, tmp_path):
    _, plain = raising_unit_job(0, 0, None)
    for rank, (refused, full) in enumerate(ranks2.run(raising_unit_job, str(tmp_path))):
        assert refused is not None and "non-finite" in refused[0] and refused[1], (rank, refused)
        _assert_same(full, plain, rank)


class LoggedAdafactor(torch.optim.Adafactor):
    """A whole-parameter optimizer whose step wraps its parent's through ``super()`` (a logging wrapper)."""

    def step(self, closure=None):
        return super().step(closure)


def parent_built_first_job(rank, world, kind):
    """A plain instance of the parent class exists first (torch then wraps the parent's step with its hooks),
    then the subclass trains three steps: under an offloaded optimizer, or whole-parameter (Adafactor)."""
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    torch.optim.Adafactor([torch.zeros(2, 2, requires_grad=True)])
    model = _model()
    offload = paramfsm.Offload(optimizer="cpu") if kind == "offload" else None
    rt = paramfsm.shard(model, offload=offload) if world else None
    opt = (CheckedSGD(model.parameters(), lr=0.1, momentum=0.9) if kind == "offload"
           else LoggedAdafactor(model.parameters(), lr=0.01))
    for step in range(3):
        model(_batch(step, world, rank)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    full = rt.full_state_dict() if rt is not None else model.state_dict()
    if rt is not None:
        rt.close()
    return {k: v.clone() for k, v in full.items()}


@pytest.mark.parametrize("kind", ["offload", "whole"])
def test_a_subclass_stepping_through_super_steps_once(ranks2, kind):
    """[Note: a parent's step inside the user's] (paramfsm.optim.offload_step): every unit was stepped twice."""
    plain = parent_built_first_job(0, 0, kind)
    for rank, full in enumerate(ranks2.run(parent_built_first_job, kind)):
        _assert_same(full, plain, rank)


def closure_job(rank, world):
    model = _model()
    rt = paramfsm.shard(model, offload=paramfsm.Offload(optimizer="cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def closure():
        opt.zero_grad()
        loss = model(_batch(0, world, rank)).pow(2).mean()
        loss.backward()
        return loss

    try:
        opt.step(closure)
        outcome = "no error"
    except OffloadError as exc:
        outcome = str(exc)
    rt.close()
    return outcome


def test_a_closure_step_under_an_offloaded_optimizer_is_refused(ranks2):
    for outcome in ranks2.run(closure_job):
        assert "step(closure) over offloaded shards" in outcome and "What to do" in outcome, outcome


def first_element_job(rank, world):
    model = _model()
    rt = paramfsm.shard(model)
    before = rt.full_state_dict()
    try:
        with torch.no_grad(), rt.gathered():
            model[0].weight.view(-1)[0] = float(rank)  # the ranks differ in the first element only
        outcome = "no error"
    except ParamFSMError as exc:
        outcome = str(exc)
    after = rt.full_state_dict()
    rt.close()
    return outcome, all(torch.equal(after[k], v) for k, v in before.items())


def test_writes_that_differ_only_in_the_first_element_are_refused(ranks2):
    for rank, (outcome, kept) in enumerate(ranks2.run(first_element_job)):
        assert "parameter '0.weight'" in outcome and "the ranks wrote different values" in outcome, (rank, outcome)
        assert kept, f"rank {rank}: a refused write-back changed the shards"


def nested_attach_job(rank, world):
    model = _model()
    rt = paramfsm.shard(model)
    model.append(nn.Sequential(nn.Linear(4, 4)))  # its parameters are its child's
    try:
        model(_batch(0, world, rank))
        outcome = "no error"
    except ModelChanged as exc:
        outcome = str(exc)
    rt.detach()
    return outcome, len(model) - 1


def test_a_module_attached_with_parameters_in_its_children_is_refused(ranks2):
    for outcome, index in ranks2.run(nested_attach_job):
        assert f"'{index}.0.weight'" in outcome and "attached after paramfsm.shard()" in outcome, outcome


def offload_write_job(rank, world, folder, offload):
    model = _model()
    rt = (paramfsm.shard(model, offload=paramfsm.Offload(params=offload, optimizer=offload, path=folder))
          if world else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        model(_batch(step, world, rank)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad(), (rt.gathered() if rt is not None else contextlib.nullcontext()):
            model[2].weight.mul_(0.5)  # an EMA-style write between steps
            model[0].bias.add_(0.25)
    full = rt.full_state_dict() if rt is not None else model.state_dict()
    if rt is not None:
        rt.close()
    return {k: v.clone() for k, v in full.items()}


@pytest.mark.parametrize("offload", ["cpu", "disk"])
def test_writes_inside_gathered_under_offload_reach_the_shards(ranks2, tmp_path, offload):
    plain = offload_write_job(0, 0, None, None)
    for rank, full in enumerate(ranks2.run(offload_write_job, str(tmp_path), offload)):
        _assert_same(full, plain, rank)
