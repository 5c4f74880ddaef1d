"""Full tensors and sharded checkpoints on one rank in the test process, compared with plain torch.

The same public API as ``test_full_tensors.py`` and the checkpoint tests, run
on a world-1 gloo group in the pytest process (:mod:`one_rank`) so that
``make mutate`` reaches :mod:`paramfsm.sharding.full_state` and
:mod:`paramfsm.checkpoint`. What only several ranks exercise (the rank-order
tag of a full-tensor gather, the slices of ranks above 0, resharding between
world sizes) stays with the spawned tests; ``docs/mutation.md`` lists it.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from one_rank import one_rank  # noqa: F401  (fixture)
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

import paramfsm
from paramfsm import checkpoint
from paramfsm.sharding import full_state
from paramfsm.errors import ParamFSMError
from paramfsm.testing import Reference, assert_close_dicts, sharded_grads, sharded_params
from paramfsm.testing.models import mlp

VOCAB, DIM = 11, 6


class Tied(nn.Module):
    """An embedding tied to the output head, a layer norm, and a buffer the forward reads."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("shift", torch.randn(DIM))

    def forward(self, tokens):
        return self.head(self.norm(self.embed(tokens) + self.shift))


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, 5), generator=torch.Generator().manual_seed(step))


def _loss(model, step: int) -> torch.Tensor:
    return model(_tokens(step)).logsumexp(-1).mean()


def _adamw(params):
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def _model(seed: int) -> Tied:
    torch.manual_seed(seed)
    model = Tied()
    with torch.no_grad():
        model.norm.weight.add_(torch.randn(DIM) * 0.1)  # distinct values, so a mixed-up key shows
        model.norm.bias.add_(torch.randn(DIM) * 0.1)
    return model


def _train(rt, model, opt, steps) -> None:
    for step in steps:
        opt.zero_grad(set_to_none=True)
        _loss(model, step).backward()
        opt.step()


def _equal_dicts(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key


@pytest.mark.parametrize("rank0_only", [False, True])
def test_full_state_dict_is_the_plain_state_dict(one_rank, rank0_only):
    model = _model(0)
    plain = copy.deepcopy(model).state_dict()
    rt = paramfsm.shard(model)
    try:
        full = rt.full_state_dict(rank0_only=rank0_only)
        _equal_dicts(full, plain)
        assert all(value.device.type == "cpu" for value in full.values())
        assert full["head.weight"] is full["embed.weight"], "a tied parameter is gathered once"
        full["shift"].add_(1)
        full["norm.weight"].add_(1)
        _equal_dicts(rt.full_state_dict(), plain)  # copies, never views of the shards or buffers
    finally:
        rt.close()


def test_full_param_and_full_grad_match_plain_torch_over_steps(one_rank):
    model = _model(0)
    ref = Reference(model, _adamw)
    rt = paramfsm.shard(model)
    opt = _adamw(rt.shard_parameters())
    assert rt.full_grad("norm.weight") is None, "no backward yet"
    for step in range(2):
        opt.zero_grad(set_to_none=True)
        ref.zero_grad()
        _loss(model, step).backward()
        _loss(ref.model, step).backward()
        assert_close_dicts(sharded_grads(rt, model), ref.grads(), what=f"step {step} gradients")
        opt.step()
        ref.optimizer.step()
        assert_close_dicts(sharded_params(rt, model), ref.params(), what=f"step {step} parameters")
    rt.close()
    assert_close_dicts(dict(model.named_parameters()), ref.params(), what="after close")


def test_a_gather_that_keeps_nothing_and_the_names_of_full_tensor_collectives(one_rank):
    model = nn.Linear(3, 2)
    rt = paramfsm.shard(model)
    try:
        rec = rt.record("weight")
        assert full_state.gather(rt, rec, rec.shard, full_state.PARAMETER, keep=False) is None
        names = full_state.collective_names(rt.units, list(rt._by_id.values()))
        assert names == tuple(unit.name for unit in rt.units) + (
            "<full parameter 'weight'>", "<full gradient 'weight'>",
            "<full parameter 'bias'>", "<full gradient 'bias'>",
            "<all-reduce of the gradient norm>", "<all-reduce of the scaler's found_inf>",
            "<agreement at the end of a backward>")
    finally:
        rt.close()


@pytest.mark.parametrize("tied_keys", ["one", "both_equal"])
def test_load_full_state_dict_of_a_plain_model(one_rank, tied_keys):
    model, plain = _model(0), _model(1)
    rt = paramfsm.shard(model)
    try:
        state = plain.state_dict()
        if tied_keys == "one":
            del state["head.weight"]  # save_pretrained writes one key of a tied parameter
        else:
            state["head.weight"] = state["head.weight"].clone()  # distinct tensors, equal values
        rt.load_full_state_dict(state)
        _equal_dicts(rt.full_state_dict(), plain.state_dict())
        with torch.no_grad():
            assert torch.allclose(model(_tokens(0)), plain(_tokens(0)), atol=1e-6)
    finally:
        rt.close()


@pytest.mark.parametrize("bad,message", [
    ("missing", "state dict is missing keys ['norm.bias'] (rank 0)"),
    ("parameter", "'norm.bias': shape (5,) does not match the parameter's (6,) (rank 0)"),
    ("buffer", "'shift': shape (5,) does not match the buffer's (6,) (rank 0)"),
    ("tied", "keys 'embed.weight' and 'head.weight' name one tied parameter but hold different values"),
], ids=["missing", "parameter", "buffer", "tied"])
def test_a_bad_full_state_dict_is_refused_before_anything_is_written(one_rank, bad, message):
    model = _model(0)
    rt = paramfsm.shard(model)
    try:
        before = rt.full_state_dict()
        state = {key: value + 1 for key, value in _model(1).state_dict().items()}
        if bad == "missing":
            del state["norm.bias"]
        elif bad == "tied":
            state["head.weight"] = state["embed.weight"] + 1
        else:
            state["norm.bias" if bad == "parameter" else "shift"] = torch.zeros(5)
        with pytest.raises(ParamFSMError, match=re.escape(message)):
            rt.load_full_state_dict(state)
        _equal_dicts(rt.full_state_dict(), before)
    finally:
        rt.close()


def test_loading_or_saving_while_parameters_are_gathered_is_refused(one_rank, tmp_path):
    model = _model(0)
    rt = paramfsm.shard(model)
    caught, state = [], _model(1).state_dict()

    def inside_forward(module, args):
        for call, what in [(lambda: rt.load_full_state_dict(state), "load a state dict"),
                           (lambda: checkpoint.save(rt, tmp_path / "ck"), "save a sharded checkpoint"),
                           (lambda: checkpoint.load(rt, tmp_path / "ck"), "load a sharded checkpoint"),
                           (lambda: rt.load_sharded_state_dict({}), "load a sharded state dict")]:
            with pytest.raises(ParamFSMError, match=f"cannot {what} while parameters are gathered: "
                                                    r"\[.*'norm.weight', 'norm.bias'\]") as info:
                call()
            caught.append(str(info.value))

    handle = model.norm.register_forward_pre_hook(inside_forward)
    _loss(model, 0).backward()
    handle.remove()
    assert len(caught) == 4 and caught[0].endswith("]; call it between iterations")
    assert all(text.endswith("]; call it between iterations (after the final backward and optimizer step)")
               for text in caught[1:])
    rt.close()


def test_sharded_state_dict_views_the_shards_as_flat_dtensors(one_rank):
    model = _model(0)
    plain = copy.deepcopy(model).state_dict()
    rt = paramfsm.shard(model)
    try:
        sd = rt.sharded_state_dict(layout="flat")
        assert list(sd) == list(plain)
        assert not isinstance(sd["shift"], DTensor) and torch.equal(sd["shift"], plain["shift"])
        for key in ["embed.weight", "norm.weight", "norm.bias", "head.weight"]:
            value = sd[key]
            assert isinstance(value, DTensor) and value.placements == (Shard(0),), key
            assert value.shape == (plain[key].numel(),) and value.stride() == (1,), key
            assert torch.equal(value.full_tensor(), plain[key].reshape(-1)), key
        owner = {"head.weight": "embed.weight"}
        for key in ["embed.weight", "norm.bias", "head.weight"]:
            assert sd[key].to_local().data_ptr() == rt.record(owner.get(key, key)).shard.data_ptr(), key
    finally:
        rt.close()


def test_load_sharded_state_dict_copies_and_redistributes(one_rank):
    model, other = _model(0), _model(1)
    want = copy.deepcopy(other).state_dict()
    rt, rt_other = paramfsm.shard(model), paramfsm.shard(other)
    try:
        sd = rt_other.sharded_state_dict(layout="flat")
        mesh = sd["norm.weight"].device_mesh
        sd["norm.weight"] = DTensor.from_local(want["norm.weight"].clone(), mesh, [Replicate()])
        rt.load_sharded_state_dict(sd)
        _equal_dicts(rt.full_state_dict(), want)
    finally:
        rt.close()
        rt_other.close()


@pytest.mark.parametrize("bad,message", [
    ("missing", "sharded state dict is missing keys ['norm.bias']"),
    ("plain", "'norm.bias': expected a DTensor of shape (6,) or pieces of shape (6,) (from rt.sharded_state_dict()), got Tensor (6,)"),
    ("shape", "'norm.bias': expected a DTensor of shape (6,) or pieces of shape (6,) (from rt.sharded_state_dict()), got DTensor (5,)"),
    ("number", "'norm.bias': expected a DTensor of shape (6,) or pieces of shape (6,) (from rt.sharded_state_dict()), got int ()"),
], ids=["missing", "plain", "shape", "number"])
def test_a_bad_sharded_state_dict_is_refused(one_rank, bad, message):
    model = _model(0)
    rt = paramfsm.shard(model)
    try:
        sd = rt.sharded_state_dict(layout="flat")
        if bad == "missing":
            del sd["norm.bias"]
        elif bad == "plain":
            sd["norm.bias"] = torch.zeros(DIM)
        elif bad == "number":
            sd["norm.bias"] = 3
        else:
            sd["norm.bias"] = DTensor.from_local(torch.zeros(5), sd["norm.bias"].device_mesh, [Shard(0)])
        with pytest.raises(ParamFSMError, match=re.escape(message)):
            rt.load_sharded_state_dict(sd)
        if bad != "missing":  # refused after the keys before it were written: the forward refuses too
            with pytest.raises(ParamFSMError, match=re.escape("rt.load_sharded_state_dict failed part-way")):
                model(_tokens(0))
    finally:
        rt.close()


def test_a_checkpoint_resumes_training_like_plain_torch(one_rank, tmp_path):
    """Save after two steps, train on, change the lr; loading (in place, and into a fresh model and
    optimizer) restores shards, moments, step counts and the lr, and the next step matches plain torch."""
    model = _model(0)
    ref = Reference(model, _adamw)
    rt = paramfsm.shard(model)
    opt = _adamw(rt.shard_parameters())
    for step in range(2):
        _train(rt, model, opt, [step])
        _train(None, ref.model, ref.optimizer, [step])
    checkpoint.save(rt, tmp_path / "ck", optimizer=opt)
    saved = copy.deepcopy(ref)
    _train(rt, model, opt, [2, 3])
    for group in opt.param_groups:
        group["lr"] = 0.5
    fresh = _model(7)
    rt_fresh = paramfsm.shard(fresh)
    opt_fresh = _adamw(rt_fresh.shard_parameters())
    _loss(fresh, 9).backward()  # gradients the load must leave as they are (it steps a fresh optimizer once)
    grads = {r: [s.grad.clone() for s in r.shard_parameters()] for r in (rt, rt_fresh)}
    try:
        checkpoint.load(rt, tmp_path / "ck", optimizer=opt)
        checkpoint.load(rt_fresh, tmp_path / "ck", optimizer=opt_fresh)
        assert [g["lr"] for o in (opt, opt_fresh) for g in o.param_groups] == [0.05, 0.05]
        for r, before in grads.items():
            assert all(torch.equal(s.grad, g) for s, g in zip(r.shard_parameters(), before, strict=True))
        for got_rt, got_model, got_opt in [(rt, model, opt), (rt_fresh, fresh, opt_fresh)]:
            assert_close_dicts(sharded_params(got_rt, got_model), saved.params(), atol=0, rtol=0,
                               what="loaded parameters")
            _train(got_rt, got_model, got_opt, [4])
        _train(None, saved.model, saved.optimizer, [4])
        for got_rt, got_model in [(rt, model), (rt_fresh, fresh)]:
            assert_close_dicts(sharded_params(got_rt, got_model), saved.params(), what="step after loading")
    finally:
        rt.close()
        rt_fresh.close()


def test_optimizer_state_of_tensors_that_are_not_shards_is_refused(one_rank):
    rt = paramfsm.shard(_model(0))
    try:
        stray = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)
        with pytest.raises(ParamFSMError, match="not a shard or a parameter of this runtime; build it on rt.shard_parameters"):
            checkpoint.sharded_optim_state_dict(rt, stray)
    finally:
        rt.close()


def test_error_messages_list_the_first_five_parameters(one_rank, tmp_path):
    model = mlp(width=6, depth=3, d_in=4, d_out=2)  # six parameters in one unit
    rt = paramfsm.shard(model, units=lambda name, module: name == "")
    first_five = "['0.weight', '0.bias', '2.weight', '2.bias', '4.weight']"
    try:
        with pytest.raises(ParamFSMError, match=re.escape(f"state dict is missing keys {first_five} (rank 0)")):
            rt.load_full_state_dict({})
        with pytest.raises(ParamFSMError, match=re.escape(f"sharded state dict is missing keys {first_five}")):
            rt.load_sharded_state_dict({})
        caught = []

        def inside_forward(module, args):
            for call in (lambda: rt.load_full_state_dict(model.state_dict()),
                         lambda: checkpoint.save(rt, tmp_path / "ck")):
                with pytest.raises(ParamFSMError, match=re.escape(f"while parameters are gathered: {first_five};")):
                    call()
            caught.append(True)

        handle = model[2].register_forward_pre_hook(inside_forward)
        model(torch.randn(2, 4)).sum().backward()
        handle.remove()
        assert caught == [True]
    finally:
        rt.close()


def test_a_load_that_fails_part_way_blocks_the_forward(one_rank):
    """A value that cannot be copied (a meta tensor) after others were written: the next forward refuses."""
    model = _model(0)
    rt = paramfsm.shard(model)
    state = _model(1).state_dict()
    state["norm.bias"] = torch.empty(DIM, device="meta")
    with pytest.raises(NotImplementedError):
        rt.load_full_state_dict(state)
    with pytest.raises(ParamFSMError, match=re.escape(
            "rt.load_full_state_dict failed part-way, so the parameters hold a mix of old and new values. "
            "What to do: run rt.load_full_state_dict again, or load a good checkpoint")) as caught:
        model(_tokens(0))
    assert "not rt.init_weights()" in str(caught.value)  # it would replace trained weights
    rt.load_full_state_dict(_model(1).state_dict())
    _equal_dicts(rt.full_state_dict(), _model(1).state_dict())
    rt.close()


def test_a_checkpoint_load_that_fails_leaves_the_model_as_it_was(one_rank, tmp_path):
    """A checkpoint whose data file is missing is refused before anything is written (a ParamFSMError naming
    the file, not DCP's CheckpointException): the model keeps its values and trains on; a good load then works."""
    model = _model(0)
    rt = paramfsm.shard(model)
    checkpoint.save(rt, tmp_path / "ck")
    rt2 = paramfsm.shard(other := _model(1))
    before = rt2.full_state_dict()
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / ".metadata").write_bytes((tmp_path / "ck" / ".metadata").read_bytes())
    with pytest.raises(ParamFSMError, match="missing"):
        checkpoint.load(rt2, tmp_path / "broken")
    _equal_dicts(rt2.full_state_dict(), before)
    other(_tokens(0))
    checkpoint.load(rt2, tmp_path / "ck")
    _equal_dicts(rt2.full_state_dict(), rt.full_state_dict())
    other(_tokens(0))
    rt.close()
    rt2.close()


@paramfsm.optim.elementwise  # its own step: declared element-wise (paramfsm.optim, [Note: element-wise optimizers])
class _CountingSGD(torch.optim.SGD):
    """SGD that also keeps a plain number per parameter (optimizer state need not be tensors)."""

    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                self.state[p]["count"] = self.state[p].get("count", 0) + 1
        return super().step(closure)


def test_optimizer_state_loads_from_plain_tensors_and_numbers(one_rank):
    """``load_sharded_optim_state_dict`` takes shard-shaped entries as DTensors or as plain tensors."""
    source, target = _model(0), _model(0)
    rt_source, rt_target = paramfsm.shard(source), paramfsm.shard(target)
    make = lambda params: _CountingSGD(params, lr=0.1, momentum=0.9)  # noqa: E731
    opt_source, opt_target = make(rt_source.shard_parameters()), make(rt_target.shard_parameters())
    try:
        _train(rt_source, source, opt_source, [0, 1, 2])
        saved = checkpoint.sharded_optim_state_dict(rt_source, opt_source)
        names = [name for name, _ in rt_source.named_shard_parameters()]
        assert saved["optim.param_groups"] == [{**opt_source.param_groups[0], "params": names}]
        plain = {k: (v.full_tensor().clone() if isinstance(v, DTensor) else v) for k, v in saved.items()}
        checkpoint.load_sharded_optim_state_dict(rt_target, opt_target, plain)
        for shard_source, shard_target in zip(rt_source.shard_parameters(), rt_target.shard_parameters()):
            want, got = opt_source.state[shard_source], opt_target.state[shard_target]
            assert got["count"] == want["count"] == 3
            assert torch.equal(got["momentum_buffer"], want["momentum_buffer"])
    finally:
        rt_source.close()
        rt_target.close()
