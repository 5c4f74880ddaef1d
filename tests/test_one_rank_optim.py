"""Optimizer mapping and higher-order gradients on one rank in the test process, compared with plain torch.

The same public API as the spawned tests of :mod:`paramfsm.optim` and
:mod:`paramfsm.engine.events.higher_order`, run on a world-1 gloo group in the
pytest process (:mod:`one_rank`) so that ``make mutate`` reaches them. The
gradient-penalty jobs of ``test_patterns_higher_order.py`` run here as rank 0
of a world of 1.
"""

from __future__ import annotations

import re

import pytest
import torch
from one_rank import one_rank  # noqa: F401  (fixture)
from test_patterns_higher_order import penalty_job, retained_penalty_job
from torch import nn

import paramfsm
import paramfsm.amp
from paramfsm.engine.events import higher_order
from paramfsm.errors import ParamFSMError
from paramfsm.optim import OptimizerStateMismatch, map_optimizer
from paramfsm.testing import Reference, assert_close_dicts, sharded_params
from paramfsm.testing.models import mlp


def _model(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return mlp(width=6, depth=3, d_in=4, d_out=2)


def _backward(model, step: int) -> None:
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(step))
    model(x).pow(2).mean().backward()


def _groups(named):
    """Hugging Face's param groups: weight decay on matrices only, each group with its own lr."""
    named = list(named)
    return [{"params": [p for n, p in named if p.dim() > 1], "weight_decay": 0.1, "lr": 0.05},
            {"params": [p for n, p in named if p.dim() <= 1], "weight_decay": 0.0, "lr": 0.02}]


def _steps(model, opt, steps) -> None:
    for step in steps:
        opt.zero_grad(set_to_none=True)
        _backward(model, step)
        opt.step()


def test_an_optimizer_over_the_model_parameters_steps_the_shards_like_plain_torch(one_rank):
    model = _model()
    ref = Reference(model)
    ref.optimizer = torch.optim.AdamW(_groups(ref.model.named_parameters()), betas=(0.8, 0.9))
    rt = paramfsm.shard(model)
    opt = torch.optim.AdamW(_groups(model.named_parameters()), betas=(0.8, 0.9))
    try:
        for step in range(2):
            _steps(model, opt, [step])
            _steps(ref.model, ref.optimizer, [step])
            assert_close_dicts(sharded_params(rt, model), ref.params(), what=f"step {step}")
        shards = {id(s) for s in rt.shard_parameters()}
        assert all(id(p) in shards for group in opt.param_groups for p in group["params"])
        assert [(g["lr"], g["weight_decay"], g["betas"]) for g in opt.param_groups] == [
            (0.05, 0.1, (0.8, 0.9)), (0.02, 0.0, (0.8, 0.9))]
        assert all(opt.state[s]["exp_avg"].shape == s.shape for s in rt.shard_parameters())
    finally:
        rt.close()


def test_groups_added_later_and_models_sharded_later_are_mapped_at_the_next_step(one_rank):
    """A group added after the first step, and an optimizer that stepped plain parameters before
    ``paramfsm.shard`` (SGD without momentum keeps no state), both step the shards like plain torch."""
    other = paramfsm.shard(nn.Linear(2, 2))  # another sharded model: the first step is scanned and remembered
    model = _model()
    ref = Reference(model)
    matrices = [p for p in model.parameters() if p.dim() > 1]
    vectors = [p for p in model.parameters() if p.dim() <= 1]
    opt = torch.optim.SGD(matrices, lr=0.1)
    ref.optimizer = torch.optim.SGD([p for p in ref.model.parameters() if p.dim() > 1], lr=0.1)
    _steps(model, opt, [0])
    _steps(ref.model, ref.optimizer, [0])
    rt = paramfsm.shard(model)
    try:
        _steps(model, opt, [1])
        _steps(ref.model, ref.optimizer, [1])
        assert_close_dicts(sharded_params(rt, model), ref.params(), what="sharded after the first step")
        opt.add_param_group({"params": vectors, "lr": 0.3})
        ref.optimizer.add_param_group({"params": [p for p in ref.model.parameters() if p.dim() <= 1], "lr": 0.3})
        _steps(model, opt, [2])
        _steps(ref.model, ref.optimizer, [2])
        assert_close_dicts(sharded_params(rt, model), ref.params(), what="a group added after the first step")
    finally:
        rt.close()
        other.close()


def test_map_optimizer_maps_before_the_first_step_and_is_idempotent(one_rank):
    model = _model()
    rt = paramfsm.shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        map_optimizer(opt)
        mapped = list(opt.param_groups[0]["params"])
        assert [id(p) for p in mapped] == [id(s) for s in rt.shard_parameters()]
        map_optimizer(opt)
        assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in mapped]
    finally:
        rt.close()


def test_shard_shaped_state_loaded_before_the_first_step_moves_to_the_shards(one_rank):
    """A checkpoint of a mapped optimizer loaded into a new optimizer over the model's parameters."""
    model = _model()
    ref = Reference(model, lambda params: torch.optim.Adam(params, lr=0.05))
    rt = paramfsm.shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    try:
        _steps(model, opt, [0])
        _steps(ref.model, ref.optimizer, [0, 1])
        again = torch.optim.Adam(model.parameters(), lr=0.05)
        again.load_state_dict(opt.state_dict())
        _steps(model, again, [1])
        assert_close_dicts(sharded_params(rt, model), ref.params(), what="resumed from a mapped state")
    finally:
        rt.close()


def test_state_of_full_parameters_is_refused_and_kept(one_rank):
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    _steps(model, opt, [0])
    weight = model[0].weight
    rt = paramfsm.shard(model)
    try:
        with pytest.raises(OptimizerStateMismatch, match=re.escape(
                "Adam holds state ['exp_avg', 'exp_avg_sq'] for the full parameter '0.weight' (shape (6, 4)), "
                "but paramfsm steps its shard (shape (24,)). It stepped before paramfsm.shard partitioned the "
                "model. What to do: create the optimizer after paramfsm.shard (or before its first step), or "
                "load its state from a checkpoint of the sharded run (paramfsm.checkpoint).")):
            opt.step()
        assert opt.state[weight]["exp_avg"].shape == (6, 4), "the state stays where it was"
    finally:
        rt.close()


_PLAIN_SCALER = re.escape(
    "a plain torch.amp.GradScaler is stepping SGD over paramfsm shards: each rank would decide alone whether a "
    "gradient overflowed, so ranks could skip different steps and the shards would silently diverge. What to "
    "do: use paramfsm.amp.GradScaler(rt, ...) (the same API; found_inf is agreed across ranks).")


def _scaled_step(scaler, model, opt) -> None:
    opt.zero_grad()
    scaler.scale(model(torch.randn(2, 4)).pow(2).mean()).backward()
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("first", ["plain_step", "scaler_step", "model_parameters", "group_added"])
def test_a_plain_grad_scaler_stepping_shards_is_refused(one_rank, first):
    model = _model()
    rt = paramfsm.shard(model)
    opt = torch.optim.SGD(model.parameters() if first == "model_parameters" else rt.shard_parameters(), lr=0.1)
    try:
        if first == "model_parameters":
            map_optimizer(opt)  # mapped from the model's parameters before the scaler unscales shard gradients
        if first in ("plain_step", "group_added"):
            _steps(model, opt, [0])  # the optimizer is scanned: the scaler meets the fast path
        if first == "group_added":  # a group of plain tensors added later: the optimizer still steps shards
            opt.add_param_group({"params": [nn.Parameter(torch.zeros(3))]})
        with pytest.raises(ParamFSMError, match=_PLAIN_SCALER):
            _scaled_step(torch.amp.GradScaler("cpu"), model, opt)
        _scaled_step(paramfsm.amp.GradScaler(rt), model, opt)
    finally:
        rt.close()


def test_a_plain_grad_scaler_on_plain_parameters_is_let_through(one_rank):
    rt = paramfsm.shard(_model(1))  # a sharded model exists, but this optimizer steps plain parameters
    plain = _model(2)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    try:
        _scaled_step(torch.amp.GradScaler("cpu"), plain, opt)
        _scaled_step(torch.amp.GradScaler("cpu"), plain, opt)
    finally:
        rt.close()


def test_an_optimizer_step_over_unsynchronised_gradients_is_refused(one_rank):
    model = _model()
    rt = paramfsm.shard(model)
    opt = torch.optim.SGD(rt.shard_parameters(), lr=0.1)
    try:
        with rt.no_sync():
            _backward(model, 0)
        with pytest.raises(ParamFSMError, match=r"SGD.step\(\)"):
            opt.step()
        _backward(model, 1)
        opt.step()
    finally:
        rt.close()


@pytest.mark.parametrize("wrt", ["input", "param"])
@pytest.mark.parametrize("retain,bound", [("defer", None), ("regather", 0)], ids=["defer", "regather"])
def test_a_gradient_penalty_matches_plain_torch(one_rank, wrt, retain, bound):
    assert penalty_job(0, 1, wrt, retain, bound, True)["checks"] == 4


def test_a_penalty_alone_and_a_retained_penalty_backward(one_rank):
    assert penalty_job(0, 1, "param", "regather", None, False)["checks"] == 4
    for retain in ("defer", "regather"):  # the job checks states and gradients (one rank gathers nothing)
        retained_penalty_job(0, 1, retain)


def test_second_order_entry_routes_only_recorded_gradients():
    events = []
    plain, recorded = torch.ones(2), torch.full((2,), 3.0, requires_grad=True)
    assert higher_order.enter(events.append, ("u",), (plain, None)) is None
    out = higher_order.enter(events.append, ("u",), (plain, recorded, None))
    assert out[0] is plain and out[2] is None and torch.equal(out[1], recorded)
    assert out[1] is not recorded and out[1].grad_fn is not None
    out[1].sum().backward()
    assert [(e.kind, e.unit, e.call, e.keep_graph, e.graph_task >= 0) for e in events] == [
        (higher_order.PRE_BACKWARD, "u", "u", False, True)]
    assert higher_order.on_param_grad(events.append, ("u",), plain) is None
    with torch.no_grad():
        assert higher_order.on_param_grad(events.append, ("u",), recorded) is None
    routed = higher_order.on_param_grad(events.append, ("u", "v"), recorded)
    assert torch.equal(routed, recorded) and routed.grad_fn is not None
    routed.sum().backward(retain_graph=True)
    assert [(e.unit, e.keep_graph) for e in events] == [("u", False), ("u", True), ("v", True)]


def test_a_model_sharded_after_the_last_step_is_mapped_whatever_the_generation(one_rank, monkeypatch):
    """The optimizer last stepped before ``paramfsm.shard``: its groups are mapped again, also when the
    number of groups happens to equal the sharding generation (pinned here: 2 groups, generation 2)."""
    monkeypatch.setattr(paramfsm.optim, "_generation", 0)
    other = paramfsm.shard(nn.Linear(2, 2))  # generation 1; with a sharded model, a plain step is remembered
    model = _model()
    ref = Reference(model)
    opt = torch.optim.SGD(_groups(model.named_parameters()))
    ref_opt = torch.optim.SGD(_groups(ref.model.named_parameters()))
    try:
        _steps(model, opt, [0])
        _steps(ref.model, ref_opt, [0])
        rt = paramfsm.shard(model)
        assert paramfsm.optim._generation == len(opt.param_groups) == 2
        _steps(model, opt, [1])
        _steps(ref.model, ref_opt, [1])
        assert_close_dicts(sharded_params(rt, model), ref.params(), what="the step after sharding")
        rt.close()
    finally:
        other.close()
