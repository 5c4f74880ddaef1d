"""``rt.memory()`` and gradient accumulation (``rt.no_sync()`` and relatives), run in the test process.

The expected byte counts are computed by hand from the parameters' element
counts and dtypes (:mod:`paramfsm.sharding.memory` counts tensor bytes the runtime
owns), and the accumulated gradients are compared with plain torch's. On a
one-rank group (:mod:`one_rank`) a gathered parameter is a view of its shard
and adds nothing, unless it is gathered in another dtype (``param_dtype``).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from one_rank import one_rank  # noqa: F401  (fixture)

import paramfsm
from paramfsm import State
from paramfsm.errors import ParamFSMError, UnsyncedGradients
from paramfsm.sharding.memory import KINDS, _size, describe
from paramfsm.testing.models import mlp

#: mlp(width=6, depth=3, d_in=4, d_out=2): 4*6 + 6 + 6*6 + 6 + 6*2 + 2 elements.
NUMEL = 86


def _model():
    torch.manual_seed(0)
    return mlp(width=6, depth=3, d_in=4, d_out=2)


def _held(rt, state: State, itemsize: int) -> int:
    """Bytes of the full parameters now in ``state``, at ``itemsize`` bytes an element."""
    sizes = {rec.name: rec.numel for rec in rt._by_id.values()}
    return sum(sizes[name] * itemsize for name, s in rt.states().items() if s is state)


def test_the_shards_and_their_gradients_are_counted_in_bytes(one_rank):
    model = _model()
    rt = paramfsm.shard(model)
    assert rt.memory() == dict.fromkeys(KINDS, 0) | {"shards": NUMEL * 4}
    model(torch.randn(3, 4)).sum().backward()
    assert rt.memory() == dict.fromkeys(KINDS, 0) | {"shards": NUMEL * 4, "shard_grads": NUMEL * 4}
    rt.detach()
    model = _model().double()
    rt = paramfsm.shard(model)
    assert rt.memory()["shards"] == NUMEL * 8
    rt.detach()


def test_parameters_gathered_in_another_dtype_count_in_that_dtype(one_rank):
    model = _model()
    rt = paramfsm.shard(model, param_dtype=torch.bfloat16)
    seen = []
    model[2].register_forward_pre_hook(lambda *_: seen.append((rt.memory(), _held(rt, State.AVAILABLE, 2))))
    loss = model(torch.randn(3, 4)).float().pow(2).sum()
    (during, available), = seen
    assert available >= 36 * 2 + 6 * 2 and during["gathered"] == available, (during, available)
    assert during["shards"] == NUMEL * 4 and during["inflight"] == 0
    assert rt.memory()["gathered"] == 0  # released after the forward
    # A retained graph's backward keeps its parameters for the next one: "deferred".
    loss.backward(retain_graph=True)
    deferred = _held(rt, State.DEFERRED_RELEASE, 2)
    assert deferred > 0 and rt.memory()["deferred"] == deferred
    loss.backward()
    assert rt.memory()["deferred"] == 0
    rt.detach()


def test_a_gathered_parameter_of_one_rank_adds_nothing(one_rank):
    model = _model()
    rt = paramfsm.shard(model)
    with rt.gathered(model[0]):
        assert rt.state(model[0].weight) is State.AVAILABLE
        assert rt.memory()["gathered"] == 0
    rt.detach()


def test_gradients_kept_under_no_sync_are_counted_until_synchronised(one_rank):
    model = _model()
    rt = paramfsm.shard(model, param_dtype=torch.bfloat16)
    with rt.no_sync():
        model(torch.randn(3, 4)).float().sum().backward()
    assert rt.memory()["unsynced_grads"] == NUMEL * 2  # full gradients, in the compute dtype
    rt.sync_gradients()
    assert rt.memory()["unsynced_grads"] == 0
    rt.detach()


def test_offloaded_optimizer_state_is_reported_by_tier(one_rank):
    model = _model()
    rt = paramfsm.shard(model, offload=paramfsm.Offload(optimizer="cpu"))
    held = rt.memory()
    assert set(held) == set(KINDS) | {"tier_cpu", "tier_disk", "offload_resident"}
    assert held["shards"] == NUMEL * 4 and held["tier_disk"] == 0
    rt.close()
    assert "tier_cpu" not in paramfsm.shard(_model()).memory()


def test_an_asynchronous_save_reports_its_staged_copy(one_rank, tmp_path):
    from paramfsm import checkpoint

    rt = paramfsm.shard(_model())
    assert "checkpoint_staging" not in rt.memory()
    handle = checkpoint.save(rt, tmp_path / "ckpt", async_save=True)
    assert rt.memory()["checkpoint_staging"] in (NUMEL * 4, 0)  # the staged shards, 0 once written
    handle.wait()
    assert rt.memory()["checkpoint_staging"] == 0
    rt.close()


def test_sizes_are_written_in_binary_units():
    assert [_size(n) for n in (0, 1023, 1024, 1100, 1536, 1024 ** 2, 5 * 1024 ** 3, 3 * 1024 ** 4)] == \
        ["0 B", "1023 B", "1.0 KiB", "1.1 KiB", "1.5 KiB", "1.0 MiB", "5.0 GiB", "3072.0 GiB"]
    assert describe({"shards": 2048, "shard_grads": 0}) == "shards 2.0 KiB, shard_grads 0 B"


# ---------------------------------------------------------------------- accumulation


def _pair():
    model, ref = _model(), _model()
    return model, ref, paramfsm.shard(model)


def _micro(model, ref, k: int, quiet) -> None:
    for m in range(k):
        torch.manual_seed(100 + m)
        x = torch.randn(3, 4)
        with quiet(m):
            (model(x).pow(2).sum() / k).backward()
        (ref(x).pow(2).sum() / k).backward()


def _same_grads(rt, ref) -> None:
    got = {name: rt.full_grad(name) for name, _ in ref.named_parameters()}
    for name, p in ref.named_parameters():
        assert torch.allclose(got[name], p.grad, atol=1e-6), name


def test_no_sync_accumulates_plain_torchs_gradients_and_restores_sync(one_rank):
    model, ref, rt = _pair()
    assert rt.scheduler.grads.sync is True
    _micro(model, ref, 3, lambda m: rt.no_sync() if m < 2 else contextlib.nullcontext())
    assert rt.scheduler.grads.sync is True and rt.memory()["unsynced_grads"] == 0
    _same_grads(rt, ref)
    rt.set_requires_gradient_sync(False)
    with rt.no_sync():
        pass
    assert rt.scheduler.grads.sync is False  # no_sync restores what was there before it
    rt.set_requires_gradient_sync(True)
    rt.detach()


def test_set_requires_gradient_sync_takes_only_a_bool(one_rank):
    _, _, rt = _pair()
    for value in (1, "False", None):
        with pytest.raises(ParamFSMError) as info:
            rt.set_requires_gradient_sync(value)
        assert str(info.value) == f"rt.set_requires_gradient_sync({value!r}): expected True or False"
    rt.detach()


def test_an_unsynchronised_gradient_refuses_the_step_until_synchronised(one_rank):
    model, ref, rt = _pair()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    rt.set_requires_gradient_sync(False)
    _micro(model, ref, 2, lambda m: contextlib.nullcontext())
    rt.set_requires_gradient_sync(True)
    before = {name: p.detach().clone() for name, p in rt.named_shard_parameters()}
    with pytest.raises(UnsyncedGradients) as info:
        opt.step()
    assert str(info.value).startswith("SGD.step(): the gradient of parameter '4."), str(info.value)
    assert all(torch.equal(p, before[name]) for name, p in rt.named_shard_parameters())
    first = torch.optim.SGD(model[0].parameters(), lr=0.1)
    with pytest.raises(UnsyncedGradients, match=r"^SGD\.step\(\): the gradient of parameter '0\."):
        first.step()  # named from this optimizer's parameters, not the first kept of the model
    for call, what in ((lambda: rt.clip_grad_norm_(1.0), "rt.clip_grad_norm_()"),
                       (lambda: rt.full_grad("2.bias"), "rt.full_grad()")):
        with pytest.raises(UnsyncedGradients, match=what.replace("(", r"\(").replace(")", r"\)")):
            call()
    other.step()  # an optimizer over other parameters is not this model's
    rt.sync_gradients()
    _same_grads(rt, ref)
    opt.step()
    rt.sync_gradients()  # nothing kept: nothing to do
    rt.detach()


def test_only_the_optimizers_own_parameters_are_checked(one_rank):
    model, ref, rt = _pair()
    with rt.no_sync():
        model[4](torch.randn(2, 6)).sum().backward()
    head = torch.optim.SGD(model[4].parameters(), lr=0.1)
    body = torch.optim.SGD(list(model[0].parameters()) + list(model[2].parameters()), lr=0.1)
    body.step()
    with pytest.raises(UnsyncedGradients, match=r"^SGD\.step\(\): the gradient of parameter '4\."):
        head.step()
    shards = torch.optim.SGD([dict(rt.named_shard_parameters())["4.bias"]], lr=0.1)
    with pytest.raises(UnsyncedGradients, match="'4.bias'"):
        shards.step()
    rt.sync_gradients()
    head.step()
    rt.detach()


def test_sync_gradients_inside_a_backward_is_refused(one_rank):
    model, _, rt = _pair()
    errors = []

    def hook(grad):
        try:
            rt.sync_gradients()
        except ParamFSMError as exc:
            errors.append(str(exc))
        return grad

    def watch(module, args, out):
        out.register_hook(hook)  # runs in the middle of the backward, between two units

    model[2].register_forward_hook(watch)
    with rt.no_sync():
        model(torch.randn(2, 4)).sum().backward()
    assert errors == ["rt.sync_gradients() was called inside a backward (from a hook?); call it between "
                      "backward passes, on every rank"], errors
    rt.sync_gradients()
    rt.detach()


def test_a_lost_gradient_refuses_sync_gradients(one_rank):
    model, _, rt = _pair()
    x = torch.randn(2, 4)
    with rt.no_sync():
        model(x).pow(2).mean().backward()

    def boom(grad):
        raise RuntimeError("interrupted")

    with rt.no_sync():
        y = model(x).pow(2).mean()
        handle = model[0].weight.register_hook(boom)
        with pytest.raises(RuntimeError, match="interrupted"):
            y.backward()
        handle.remove()
    rt.reset()
    with pytest.raises(UnsyncedGradients, match="is lost") as info:
        rt.sync_gradients()
    assert str(info.value).startswith("rt.sync_gradients(): the gradient of parameter"), str(info.value)
    rt.detach()


def test_sync_gradients_names_the_lost_gradient_behind_healthy_ones(one_rank):
    """The first layer keeps healthy gradients first; a whole backward interrupted in the first layer loses
    those of the layers it had reached."""
    model, _, rt = _pair()
    with rt.no_sync():
        model[0](torch.randn(2, 4)).sum().backward()

    def boom(grad):
        raise RuntimeError("interrupted")

    with rt.no_sync():
        y = model(torch.randn(2, 4)).sum()
        handle = model[0].weight.register_hook(boom)
        with pytest.raises(RuntimeError, match="interrupted"):
            y.backward()
        handle.remove()
    rt.reset()
    with pytest.raises(UnsyncedGradients) as info:
        rt.sync_gradients()
    message = str(info.value)
    assert "parameter '0." not in message and "is lost" in message, message
    rt.detach()


def test_sync_gradients_synchronises_with_sync_switched_off(one_rank):
    model, ref, rt = _pair()
    rt.set_requires_gradient_sync(False)
    _micro(model, ref, 2, lambda m: contextlib.nullcontext())
    assert rt.memory()["unsynced_grads"] == NUMEL * 4
    rt.sync_gradients()  # explicit: it runs whatever the switch says
    assert rt.memory()["unsynced_grads"] == 0
    rt.set_requires_gradient_sync(True)
    _same_grads(rt, ref)
    rt.detach()
