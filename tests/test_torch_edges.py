"""The torch edges a new user meets first, on 2 gloo ranks against plain torch (values) or the error.

Each case here once gave a silent wrong result: an optimizer over
``model.parameters()`` that changed nothing, ``clip_grad_norm_`` returning 0,
parameter counts of 0, ``p.data.sum()`` of 0, unfreezing that never trained,
parameters left gathered after an exception.
"""

from __future__ import annotations

import io
import re

import pytest
import torch
import torch.nn.functional as F

import paramfsm
from paramfsm import NotGathered, State
from paramfsm.optim import OptimizerStateMismatch
from paramfsm.testing import Reference, assert_close_dicts, rank_slice, sharded_params
from paramfsm.testing.models import TinyTransformer

VOCAB, SEQ, PER_RANK = 32, 8, 2


def _batch(step: int, world: int):
    gen = torch.Generator().manual_seed(100 + step)
    return (torch.randint(0, VOCAB, (world * PER_RANK, SEQ), generator=gen),
            torch.randint(0, VOCAB, (world * PER_RANK, SEQ), generator=gen))


def _losses(out, targets):
    return F.cross_entropy(out.reshape(-1, VOCAB), targets.reshape(-1)), (out ** 2).mean()


def _model():
    torch.manual_seed(0)
    return TinyTransformer(vocab=VOCAB, dim=16, depth=2, seq=SEQ)


def _train_step(step, rank, world, model, opt, ref_model, ref_opt):
    """One zero_grad / backward / step on the sharded model (this rank's slice) and on the reference."""
    tokens, targets = _batch(step, world)
    opt.zero_grad()
    ref_opt.zero_grad()
    _losses(model(rank_slice(tokens, rank, world)), rank_slice(targets, rank, world))[0].backward()
    _losses(ref_model(tokens), targets)[0].backward()
    opt.step()
    ref_opt.step()


def hf_groups(model, weight_decay=0.1):
    """The Hugging Face Trainer recipe: decay for weights, none for biases and norms, by name."""
    no_decay = [n for n, _ in model.named_parameters() if n.endswith("bias") or "norm" in n]
    return [
        {"params": [p for n, p in model.named_parameters() if n not in no_decay], "weight_decay": weight_decay},
        {"params": [p for n, p in model.named_parameters() if n in no_decay], "weight_decay": 0.0},
    ]


# [Note: Adam's eps in comparisons]
# Some gradients here are zero in exact arithmetic (the attention key bias: softmax ignores a shift
# shared by all keys) and ~1e-9 of rounding noise in practice. Adam divides by sqrt(v) + eps, so with
# the default eps that noise becomes a full +-lr step whose sign depends on summation order, which
# differs between the sharded run and the reference. A larger eps keeps the comparison about the
# optimizer mapping, not about amplified rounding.
ADAM = {"lr": 1e-2, "eps": 1e-3}
OPTIMIZERS = {
    "adamw": lambda model: torch.optim.AdamW(model.parameters(), **ADAM),
    "hf_groups": lambda model: torch.optim.AdamW(hf_groups(model), **ADAM),
    "sgd_momentum": lambda model: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
}


def optimizer_job(rank, world, recipe, when, set_to_none, steps=3):
    """The two-loss retained-graph loop with an optimizer over the model's own parameters."""
    model = _model()
    ref = Reference(model)
    ref_opt = OPTIMIZERS[recipe](ref.model)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=1, gamma=0.5)
    opt = OPTIMIZERS[recipe](model) if when == "before_shard" else None
    rt = paramfsm.shard(model, strict=True)
    opt = opt or OPTIMIZERS[recipe](model)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    worst = 0.0
    for step in range(steps):
        tokens, targets = _batch(step, world)
        l1, l2 = _losses(model(rank_slice(tokens, rank, world)), rank_slice(targets, rank, world))
        r1, r2 = _losses(ref.model(tokens), targets)
        for loss, keep in ((l1, True), (l2, False)):
            opt.zero_grad(set_to_none=set_to_none)
            loss.backward(retain_graph=keep)
        for loss, keep in ((r1, True), (r2, False)):
            ref_opt.zero_grad(set_to_none=set_to_none)
            loss.backward(retain_graph=keep)
        opt.step()
        ref_opt.step()
        sched.step()
        ref_sched.step()
        worst = max(worst, assert_close_dicts(sharded_params(rt, model), ref.params(), atol=1e-5,
                                              what=f"{recipe} step {step}"))
    assert set(rt.states().values()) == {State.NOT_AVAILABLE}
    shards = {id(s) for s in rt.shard_parameters()}
    assert all(id(p) in shards for group in opt.param_groups for p in group["params"]), "not mapped to shards"
    assert [g["weight_decay"] for g in opt.param_groups] == [g["weight_decay"] for g in ref_opt.param_groups]
    rt.close()
    return worst


@pytest.mark.parametrize("recipe", sorted(OPTIMIZERS))
def test_optimizer_over_model_parameters_trains_like_plain_torch(ranks2, recipe):
    worst = ranks2.run(optimizer_job, recipe, "after_shard", True)[0]
    assert worst < 1e-5


def test_optimizer_built_before_shard_and_zero_grad_to_zero(ranks2):
    """zero_grad(set_to_none=False) before the first step: the shard gradients are zeroed, not kept."""
    assert ranks2.run(optimizer_job, "adamw", "before_shard", False)[0] < 1e-5


def state_dict_job(rank, world):
    """Save a mapped optimizer's state, load it into a new optimizer over model.parameters(), go on."""
    model = _model()
    ref = Reference(model)
    ref_opt = torch.optim.AdamW(ref.model.parameters(), **ADAM)
    rt = paramfsm.shard(model)
    opt = torch.optim.AdamW(model.parameters(), **ADAM)

    _train_step(0, rank, world, model, opt, ref.model, ref_opt)
    saved = io.BytesIO()
    torch.save(opt.state_dict(), saved)
    saved.seek(0)
    resumed = torch.optim.AdamW(model.parameters(), **ADAM)
    resumed.load_state_dict(torch.load(saved, weights_only=True))
    _train_step(1, rank, world, model, resumed, ref.model, ref_opt)
    worst = assert_close_dicts(sharded_params(rt, model), ref.params(), atol=1e-5, what="after resuming")
    rt.close()
    return worst


def test_optimizer_state_dict_round_trip(ranks2):
    assert ranks2.run(state_dict_job)[0] < 1e-5


def unfreeze_job(rank, world, steps=4):
    """Gradual unfreezing: the optimizer starts on the head; the body joins with ``add_param_group``
    after the first step, with its own learning rate. Both groups train like plain torch."""
    model = _model()
    ref = Reference(model)
    rt = paramfsm.shard(model, strict=True)

    def head_first(net):
        named = dict(net.named_parameters())
        head = [n for n in named if n.startswith("head")]
        return torch.optim.AdamW([named[n] for n in head], **ADAM), [p for n, p in named.items() if n not in head]

    opt, body = head_first(model)
    ref_opt, ref_body = head_first(ref.model)
    assert body and len(body) == len(ref_body)
    worst = 0.0
    for step in range(steps):
        if step == 1:
            opt.add_param_group({"params": body, "lr": 3e-3})
            ref_opt.add_param_group({"params": ref_body, "lr": 3e-3})
        _train_step(step, rank, world, model, opt, ref.model, ref_opt)
        worst = max(worst, assert_close_dicts(sharded_params(rt, model), ref.params(), atol=1e-5,
                                              what=f"step {step}"))
    shards = {id(s) for s in rt.shard_parameters()}
    mapped = [id(p) in shards for group in opt.param_groups for p in group["params"]]
    assert all(mapped) and len(mapped) == len(shards), "the added group was not mapped to shards"
    rt.close()
    return worst


def test_a_param_group_added_after_the_first_step_trains_like_plain_torch(ranks2):
    assert ranks2.run(unfreeze_job)[0] < 1e-5


def stale_state_job(rank, world, only_1d=False):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), **ADAM)
    tokens, targets = _batch(0, world)
    _losses(model(tokens), targets)[0].backward()
    opt.step()  # state for the full parameters
    if only_1d:  # e.g. a checkpoint that kept the state of biases and norms only
        for param in model.parameters():
            if param.dim() > 1:
                del opt.state[param]
    rt = paramfsm.shard(model)
    opt.zero_grad()
    _losses(model(rank_slice(tokens, rank, world)), rank_slice(targets, rank, world))[0].backward()
    try:
        opt.step()
    except OptimizerStateMismatch as exc:
        rt.close()
        return str(exc)
    raise AssertionError("an optimizer holding full-parameter state stepped the shards silently")


def test_optimizer_with_state_for_full_parameters_raises(ranks2):
    message = ranks2.run(stale_state_job)[0]
    assert "'pos'" in message and "create the optimizer after paramfsm.shard" in message


def test_stale_state_of_biases_and_norms_alone_raises_the_same_advice(ranks2):
    message = ranks2.run(stale_state_job, True)[0]
    assert re.search(r"full parameter '[\w.]*(bias|norm[\w.]*weight)' \(shape \(\d+,\)\)", message), message
    assert "create the optimizer after paramfsm.shard" in message


def clip_job(rank, world):
    model = _model()
    ref = Reference(model)
    rt = paramfsm.shard(model)
    tokens, targets = _batch(0, world)
    _losses(model(rank_slice(tokens, rank, world)), rank_slice(targets, rank, world))[0].backward()
    _losses(ref.model(tokens), targets)[0].backward()
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        norm_message = None
    except NotGathered as exc:
        norm_message = str(exc)
    # clipping by value is element-wise: on the shards it is exactly the full gradient's clip
    torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
    torch.nn.utils.clip_grad_value_(ref.model.parameters(), 0.01)
    worst = assert_close_dicts({n: rt.full_grad(n) for n, _ in model.named_parameters()}, ref.grads(),
                               atol=1e-7, what="clip_grad_value_")
    total = rt.clip_grad_norm_(0.05)
    ref_total = torch.nn.utils.clip_grad_norm_(ref.model.parameters(), 0.05)
    rt.close()
    return norm_message, worst, float(total), float(ref_total)


def test_plain_clipping_over_model_parameters(ranks2):
    norm_message, worst, total, ref_total = ranks2.run(clip_job)[0]
    assert norm_message is not None and "rt.clip_grad_norm_" in norm_message and "gradient of parameter" in norm_message
    assert worst < 1e-7
    assert total == pytest.approx(ref_total, rel=1e-5) and total > 0


def metadata_job(rank, world):
    model = _model()
    expected = {n: (tuple(p.shape), p.numel(), p.dim()) for n, p in model.named_parameters()}
    count = sum(p.numel() for p in model.parameters())
    rt = paramfsm.shard(model)
    got = {n: (tuple(p.shape), p.numel(), p.dim()) for n, p in model.named_parameters()}
    weight = model.blocks[0].qkv.weight
    sizes = (tuple(weight.size()), weight.size(0), weight.nelement(), weight.ndim, tuple(weight.data.shape))
    errors = {}
    for what, fn in {"data.sum": lambda: weight.data.sum(), "item": lambda: model.pos[0, 0].item(),
                     "numpy": lambda: weight.data.numpy(), "state_dict": lambda: torch.save(model.state_dict(),
                                                                                           io.BytesIO()),
                     "len": lambda: len(weight)}.items():
        try:
            fn()
            errors[what] = None
        except NotGathered as exc:
            errors[what] = str(exc)
    rt.close()
    return expected, got, count, sum(p.numel() for p in model.parameters()), sizes, errors


def test_metadata_at_rest_is_logical_and_values_raise(ranks2):
    expected, got, count, after_close, sizes, errors = ranks2.run(metadata_job)[0]
    assert got == expected
    assert after_close == count
    assert sizes == ((48, 16), 48, 768, 2, (48, 16))
    for what, message in errors.items():
        assert message is not None, f"{what} returned a value from an ungathered parameter"
        assert "not gathered on rank 0" in message, (what, message)


def freeze_job(rank, world, direction):
    """Gradual unfreezing (frozen at shard, then trained) or freezing after shard, against plain torch."""
    model = _model()
    target = model.blocks[1].up
    if direction == "unfreeze":
        target.requires_grad_(False)
    ref = Reference(model)
    ref_opt = torch.optim.SGD(ref.model.parameters(), lr=0.1)
    rt = paramfsm.shard(model, strict=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_target = ref.model.blocks[1].up
    worst = 0.0
    for step in range(4):
        if step == 2:
            flag = direction == "unfreeze"
            target.requires_grad_(flag)
            ref_target.requires_grad_(flag)
        _train_step(step, rank, world, model, opt, ref.model, ref_opt)
        worst = max(worst, assert_close_dicts(sharded_params(rt, model), ref.params(), atol=1e-5,
                                              what=f"{direction} step {step}"))
    assert rt.scheduler.audit.last == []
    moved = not torch.equal(rt.full_param("blocks.1.up.weight"), _model().blocks[1].up.weight.detach())
    rt.close()
    return worst, moved


@pytest.mark.parametrize("direction", ["unfreeze", "freeze"])
def test_requires_grad_changes_after_shard(ranks2, direction):
    worst, moved = ranks2.run(freeze_job, direction)[0]
    assert worst < 1e-5
    assert moved, "the toggled parameter never trained"


class Boom(RuntimeError):
    pass


def reset_job(rank, world):
    model = _model()
    ref = Reference(model)
    ref_opt = torch.optim.SGD(ref.model.parameters(), lr=0.1)
    rt = paramfsm.shard(model, strict=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    tokens, _ = _batch(0, world)
    # one clean step (so the next forward has a prefetch plan), then a forward that raises midway
    _train_step(0, rank, world, model, opt, ref.model, ref_opt)

    def explode(module, args):
        raise Boom("data error")
    handle = model.blocks[1].register_forward_pre_hook(explode)
    try:
        model(rank_slice(tokens, rank, world))
    except Boom:
        pass
    handle.remove()
    gathered = sorted(n for n, s in rt.states().items() if s is not State.NOT_AVAILABLE)
    before = rt.counters
    rt.reset()
    states = set(rt.states().values())
    issued = {k: v - before[k] for k, v in rt.counters.items()}
    _train_step(1, rank, world, model, opt, ref.model, ref_opt)
    worst = assert_close_dicts(sharded_params(rt, model), ref.params(), atol=1e-5, what="after reset")
    rt.close()
    return gathered, states, issued, worst


def test_reset_after_an_exception(ranks2):
    gathered, states, issued, worst = ranks2.run(reset_job)[0]
    assert gathered, "the interrupted forward left nothing gathered: the scenario does not test reset"
    assert states == {State.NOT_AVAILABLE}
    assert all(v == 0 for v in issued.values()), f"reset issued collectives: {issued}"
    assert worst < 1e-5
