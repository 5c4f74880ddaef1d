"""An offloaded optimizer step is one step to everything that watches it, and ``zero_grad`` keeps its meaning.

Under ``Offload(optimizer=...)`` (or any offload) paramfsm steps the optimizer unit by unit
(:mod:`paramfsm.optim.offload_step`). What the user registered on the optimizer must still see the one ``step()``
they called, as in plain torch: each step pre-hook once, before any parameter changes, and each post-hook once,
after every parameter changed, both with every parameter in the param groups. And
``zero_grad(set_to_none=False)`` must zero the gradients wherever they are paged, whatever the resident bound.
"""

from __future__ import annotations

import threading

import pytest
import torch

import paramfsm
from paramfsm.optim import offload_step
from paramfsm.testing.models import mlp


@pytest.fixture(scope="module")
def ranks2(in_process2):
    """This file's two ranks are threads of the test process (``gloo_ranks.py``), where ``make mutate`` sees
    them; a test that needs processes of its own asks for ``suite_ranks2``."""
    return in_process2


STEPS = 3


def _model():
    torch.manual_seed(0)
    return mlp(width=16, depth=4, d_in=8, d_out=4)


def _batch(step):
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 + step))


def _offload(kind, folder):
    if kind == "optimizer-cpu":
        return paramfsm.Offload(optimizer="cpu")
    if kind == "params-disk":
        return paramfsm.Offload(params="disk", path=folder)
    if kind is None:
        return None
    raise ValueError(kind)


def hooks_job(rank, world, folder, kind):
    model = _model()
    rt = paramfsm.shard(model, offload=_offload(kind, folder)) if world else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    seen = []

    def first_value():
        shard = opt.param_groups[0]["params"][0]
        return float(shard.detach().reshape(-1)[0]) if shard.numel() else None

    def pre(optimizer, args, kwargs):
        seen.append(("pre", sum(len(g["params"]) for g in optimizer.param_groups), first_value()))

    def post(optimizer, args, kwargs):
        seen.append(("post", sum(len(g["params"]) for g in optimizer.param_groups), first_value()))

    opt.register_step_pre_hook(pre)
    opt.register_step_post_hook(post)
    for step in range(STEPS):
        x = _batch(step).chunk(max(world, 1))[rank]
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    full = rt.full_state_dict() if rt is not None else model.state_dict()
    if rt is not None:
        rt.close()
    return seen, full


@pytest.mark.parametrize("kind", ["optimizer-cpu", "params-disk"])
def test_step_hooks_see_one_step_under_offload(ranks2, tmp_path, kind):
    plain_seen, plain = hooks_job(0, 0, None, None)
    n = len(list(_model().parameters()))
    for rank, (seen, full) in enumerate(ranks2.run(hooks_job, str(tmp_path), kind)):
        kinds = [k for k, _, _ in seen]
        assert kinds == ["pre", "post"] * STEPS, (rank, kinds)
        assert all(count == n for _, count, _ in seen), (rank, seen, n)
        # The pre-hook ran before the update, the post-hook after it: the first shard element changes between.
        for (_, _, before), (_, _, after) in zip(seen[0::2], seen[1::2]):
            assert before is None or before != after, (rank, seen)
        # ...and before the previous step's post-hook value is the same value (nothing stepped in between).
        for (_, _, after), (_, _, before) in zip(seen[1::2], seen[2::2]):
            assert after == before, (rank, seen)
        for name, value in plain.items():
            torch.testing.assert_close(full[name], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"rank {rank} {name}: {m}")
    assert [k for k, _, _ in plain_seen] == ["pre", "post"] * STEPS


def zero_grad_job(rank, world, folder, offload_kwargs, set_to_none):
    model = _model()
    offload = paramfsm.Offload(**offload_kwargs, path=folder) if world else None
    rt = paramfsm.shard(model, offload=offload) if world else None
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(STEPS):
        for micro in range(2):  # the second backward adds into the gradient zero_grad zeroed in place
            x = _batch(2 * step + micro).chunk(max(world, 1))[rank]
            (model(x).pow(2).mean() / 2).backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    full = rt.full_state_dict() if rt is not None else model.state_dict()
    if rt is not None:
        rt.close()
    return full


BOUNDED = [
    dict(grads="cpu", params="cpu", max_resident_bytes=2048),
    dict(grads="disk", optimizer="cpu", max_resident_bytes=3000),
    dict(grads="cpu", params="disk", optimizer="disk", max_resident_bytes=4096),
]


@pytest.mark.parametrize("offload", BOUNDED, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_zero_grad_without_set_to_none_under_a_bounded_tier_trains_like_plain_torch(ranks2, tmp_path, offload):
    plain = zero_grad_job(0, 0, None, None, True)
    for rank, full in enumerate(ranks2.run(zero_grad_job, str(tmp_path), offload, False)):
        for name, value in plain.items():
            torch.testing.assert_close(full[name], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"rank {rank} {name}: {m}")


def test_a_unit_s_step_on_one_thread_lets_no_other_thread_s_step_through():
    """Whether a unit's step is running belongs to the thread running it: a step another thread calls
    meanwhile (another rank's, where ranks are threads of one process) is that user's own, and paramfsm's
    pre-hook must take it as one; read process-wide, it let the other rank's step through unsharded and the
    ranks stopped in different collectives."""
    entered, leave = threading.Event(), threading.Event()

    class Held(torch.optim.SGD):
        def step(self, closure=None):
            entered.set()
            leave.wait(timeout=10)
            return super().step(closure)

    param = torch.nn.Parameter(torch.ones(2))
    opt = Held([param], lr=0.1)
    unit = threading.Thread(target=offload_step._step_only, args=(opt, [[param]], {id(param)}))
    unit.start()
    try:
        assert entered.wait(timeout=10)
        seen = []
        other = threading.Thread(target=lambda: seen.append(offload_step.inner()))
        other.start()
        other.join(timeout=10)
    finally:
        leave.set()
        unit.join(timeout=10)
    assert seen == [False]
    assert not offload_step.inner()


def test_a_parent_s_step_inside_the_user_s_is_told_apart_through_frames_in_between():
    """``within_step`` finds torch's hook wrapper on the stack wherever it is: reached through a frame more
    than paramfsm's own pre-hook (a decorator, a tracing tool), a parent's step inside the user's must still
    pass through, not count as a new step that steps every unit again."""
    torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)  # torch now wraps SGD.step with its hooks

    class Logged(torch.optim.SGD):
        def step(self, closure=None):
            return super().step(closure)

    opt = Logged([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    seen = []

    def through_a_frame():
        return offload_step.within_step(opt)

    def hook(optimizer, args, kwargs):
        seen.append(through_a_frame())
        offload_step._EMPTIED.setdefault(opt, ([], {}))  # as paramfsm's pre-hook leaves the user's step

    opt.register_step_pre_hook(hook)
    try:
        opt.step()
    finally:
        offload_step._EMPTIED.pop(opt, None)
    assert seen == [False, True]  # the user's own step, then the parent's inside it


def extra_param_job(rank, world):
    """An optimizer over the sharded model and a parameter of no module (a learnt temperature), with a user
    pre-hook that hands the step's arguments back as they came, under ``Offload(optimizer="cpu")``; then a
    pre-hook that returns something torch refuses, and a closure passed by keyword."""
    model = _model()
    rt = paramfsm.shard(model, offload=paramfsm.Offload(optimizer="cpu")) if world else None
    temperature = torch.nn.Parameter(torch.full((1,), 2.0))
    opt = torch.optim.AdamW([{"params": model.parameters()}, {"params": [temperature], "lr": 0.1}], lr=1e-2)
    handed = []

    def hand_back(optimizer, args, kwargs):
        handed.append((len(args), dict(kwargs)))
        return args, kwargs

    handle = opt.register_step_pre_hook(hand_back)
    post_hooks = []  # how many post-hooks the optimizer holds after each step: paramfsm adds one, once
    for step in range(STEPS):  # every rank the whole batch: the temperature's gradient is no rank's to reduce
        (model(_batch(step)) * temperature).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        post_hooks.append(len(opt._optimizer_step_post_hooks))
    handle.remove()
    full = rt.full_state_dict() if rt is not None else {k: v.clone() for k, v in model.state_dict().items()}
    trained = temperature.detach().clone()
    held = rt.memory() if rt is not None else {}
    refusals = []
    bad = opt.register_step_pre_hook(lambda optimizer, args, kwargs: 5)
    model(_batch(9)).sum().backward()
    try:
        opt.step()
    except RuntimeError as exc:
        refusals.append(f"{type(exc).__name__}: {exc}")
    bad.remove()
    try:
        opt.step(closure=lambda: model(_batch(9)).sum())
    except (RuntimeError, paramfsm.ParamFSMError) as exc:
        refusals.append(f"{type(exc).__name__}: {exc}")
    if rt is not None:
        rt.close()
    return handed, refusals, full, trained, held, post_hooks


def test_a_parameter_of_no_module_and_a_pre_hook_s_arguments_step_like_plain_torch(ranks2):
    """The offloaded step steps the units one by one; a parameter in no unit must still be stepped (apart, once),
    and a pre-hook's returned arguments are used, or refused in torch's own words. A closure, even by keyword,
    is refused (it would run once per unit)."""
    plain_handed, plain_refusals, plain, plain_temperature, _, _ = extra_param_job(0, 0)
    assert not torch.equal(plain_temperature, torch.full((1,), 2.0))
    for rank, (handed, refusals, full, temperature, held, post_hooks) in enumerate(ranks2.run(extra_param_job)):
        assert post_hooks == [post_hooks[0]] * STEPS, (rank, post_hooks)
        # AdamW's two moments of every shard are in the CPU tier, not left in working memory.
        assert held["tier_cpu"] >= 2 * held["shards"] > 0, (rank, held)
        assert handed == plain_handed == [(1, {})] * STEPS, (rank, handed)
        torch.testing.assert_close(temperature, plain_temperature, rtol=1e-5, atol=1e-6)
        for name, value in plain.items():
            torch.testing.assert_close(full[name], value, rtol=1e-4, atol=1e-5, msg=lambda m: f"rank {rank} {name}: {m}")
        assert len(refusals) == 2, (rank, refusals)
        for refusal in (refusals[0], plain_refusals[0]):  # torch's own words
            assert refusal.startswith("RuntimeError: ") and \
                refusal.endswith(" must return None or a tuple of (new_args, new_kwargs), but got 5."), refusal
        assert refusals[1] == (
            "OffloadError: AdamW.step(closure) over offloaded shards: the step runs unit by unit, so a closure would "
            "be evaluated once per unit. What to do: call step() without a closure, or do not offload this model "
            "(paramfsm.shard(..., offload=None))."), (rank, refusals)
