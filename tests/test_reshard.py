"""``reshard_after_forward``: units kept gathered from their forward to their backward train like plain
torch, gather nothing in backward, and never stay gathered once no backward can come."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from patterns_common import Pair, batch

import paramfsm
from paramfsm import State
from paramfsm.testing.models import mlp


@pytest.fixture(scope="module")
def ranks2(in_process2):
    """This file's two ranks are threads of the test process (``gloo_ranks.py``), where ``make mutate`` sees
    them; a test that needs processes of its own asks for ``suite_ranks2``."""
    return in_process2


POLICIES = {
    "reshard": True,
    "keep": False,
    "keep_last": lambda name, module: name != "4",  # only the last Linear is kept
}


def _backward_gathers(records, since: int) -> int:
    return sum(1 for r in records[since:] if r.graph_task >= 0 and "start_gather" in r.effects)


def reshard_job(rank, world, policy):
    torch.manual_seed(0)
    pair = Pair(mlp(width=8, depth=3, d_in=4, d_out=3), rank, world, bucket_bytes=256,
                reshard_after_forward=POLICIES[policy])
    rt, out = pair.rt, {"backward_gathers": [], "left": []}
    na = State.NOT_AVAILABLE
    for step in range(3):
        x, y = batch(step, world, 2, (4,), (3,))
        pair.zero_grad()
        mark = len(rt.trace.records)
        got = pair.model(pair.local(x))
        out["kept"] = sorted(n for n, s in rt.states().items() if s is not na)
        out["gathered_bytes"] = rt.memory()["gathered"]
        F.mse_loss(got, pair.local(y)).backward()
        out["backward_gathers"].append(_backward_gathers(rt.trace.records, mark))
        F.mse_loss(pair.ref.model(x), y).backward()
        pair.check_grads(f"step {step}")
        pair.step(f"step {step}")
        out["left"].append(sorted(n for n, s in rt.states().items() if s is not na))
    # Two losses on one retained graph.
    pair.zero_grad()
    x, y = batch(10, world, 2, (4,), (3,))
    got, want = pair.model(pair.local(x)), pair.ref.model(x)
    F.mse_loss(got, pair.local(y)).backward(retain_graph=True)
    got.pow(2).mean().backward()
    F.mse_loss(want, y).backward(retain_graph=True)
    want.pow(2).mean().backward()
    pair.check_grads("two losses")
    pair.step("two losses")
    # Forwards no backward follows: without a graph, and with one that is dropped or replaced.
    with torch.no_grad():
        pair.model(pair.local(x))
    out["after_no_grad"] = sorted(n for n, s in rt.states().items() if s is not na)
    pair.model.eval()
    dropped = pair.model(pair.local(x))
    del dropped
    out["after_dropped"] = sorted(n for n, s in rt.states().items() if s is not na)
    pair.model.train()
    held = pair.model(pair.local(x))
    pair.zero_grad()
    F.mse_loss(pair.model(pair.local(x)), pair.local(y)).backward()
    F.mse_loss(pair.ref.model(x), y).backward()
    pair.check_grads("a forward whose graph outlives the next forward")
    held.mean().backward()  # its backward still gathers what it needs
    pair.ref.model(x).mean().backward()
    pair.check_grads("the older graph's backward")
    del held
    out["at_end"] = sorted(n for n, s in rt.states().items() if s is not na)
    out.update(pair.finish())
    return out


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_reshard_after_forward_matches_plain_torch(ranks2, policy):
    for out in ranks2.run(reshard_job, policy):
        assert out["left"] == [[]] * 3 and out["at_end"] == [], out
        assert out["after_no_grad"] == [] and out["after_dropped"] == [], out
        gathers = out["backward_gathers"]
        if policy == "keep":
            assert out["kept"] == ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias", "4.weight"], out
            assert gathers == [0, 0, 0], f"a unit kept from forward to backward was gathered again: {out}"
            assert out["gathered_bytes"] == 4 * (8 * 4 + 8 + 8 * 8 + 8 + 3 * 8 + 3), out
        elif policy == "keep_last":
            assert out["kept"] == ["4.bias", "4.weight"], out
            assert all(0 < g for g in gathers), out
        else:
            assert out["kept"] == [] and all(g > 0 for g in gathers), out
        assert out["grad_err"] <= 1e-6 and out["param_err"] <= 1e-6, out


def test_a_bad_reshard_policy_is_refused():
    with pytest.raises(paramfsm.ParamFSMError, match="reshard_after_forward"):
        paramfsm.shard(mlp(), reshard_after_forward="no")


class RootOwned(torch.nn.Module):
    """A root that owns a parameter of its own (its unit is the root unit), around one Linear."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(4))
        self.inner = torch.nn.Linear(4, 3)

    def forward(self, x):
        return self.inner(x * self.scale)


def root_job(rank, world, reshard_root):
    torch.manual_seed(0)
    policy = True if reshard_root else (lambda name, module: name != "")
    pair = Pair(RootOwned(), rank, world, reshard_after_forward=policy)
    x, y = batch(0, world, 2, (4,), (3,))
    pair.zero_grad()
    mark = len(pair.rt.trace.records)
    got = pair.model(pair.local(x))
    kept = sorted(n for n, s in pair.rt.states().items() if s is not State.NOT_AVAILABLE)
    F.mse_loss(got, pair.local(y)).backward()
    F.mse_loss(pair.ref.model(x), y).backward()
    pair.check_grads("root-owned parameter")
    gathered = sorted({r.param for r in pair.rt.trace.records[mark:]
                       if r.graph_task >= 0 and "start_gather" in r.effects})
    held = pair.model(pair.local(x))  # kept for a backward that never comes, across an optimizer step
    pair.step("root-owned parameter")
    with pair.rt.gathered():
        seen = pair.model.scale.detach().clone()
    stale = (seen - pair.rt.full_param("scale")).abs().max().item()
    del held
    pair.finish()
    return kept, gathered, stale


def test_the_root_unit_is_kept_on_request_and_resharded_by_default(ranks2):
    for kept, gathered, stale in ranks2.run(root_job, False):
        assert kept == ["scale"] and "scale" not in gathered and "inner.weight" in gathered, (kept, gathered)
        assert stale == 0, "rt.gathered() showed the copy a forward kept from before the optimizer step"
    for kept, gathered, stale in ranks2.run(root_job, True):
        assert kept == [] and "scale" in gathered and stale == 0, (kept, gathered, stale)


def _full_params(pair) -> dict:
    return {name: pair.rt.full_param(name) for name, _ in pair.model.named_parameters()}


def save_while_kept_job(rank, world, folder):
    torch.manual_seed(0)
    pair = Pair(mlp(width=8, depth=3, d_in=4, d_out=3), rank, world, reshard_after_forward=False)
    rt, out = pair.rt, {}
    initial = pair.ref.params()
    x, y = batch(0, world, 2, (4,), (3,))
    pair.zero_grad()
    got = pair.model(pair.local(x))
    out["kept"] = sorted(n for n, s in rt.states().items() if s is not State.NOT_AVAILABLE)
    paramfsm.checkpoint.save(rt, f"{folder}/after-forward")  # the forward's backward has not run yet
    F.mse_loss(got, pair.local(y)).backward()
    F.mse_loss(pair.ref.model(x), y).backward()
    pair.check_grads("a backward after a save")
    pair.step("a step after a save")
    stepped = pair.ref.params()
    held = pair.model(pair.local(x))  # between iterations, a kept forward whose graph is still referenced
    paramfsm.checkpoint.save(rt, f"{folder}/between")
    del held
    paramfsm.checkpoint.load(rt, f"{folder}/after-forward")
    out["after_forward_err"] = max((got - initial[n]).abs().max().item() for n, got in _full_params(pair).items())
    paramfsm.checkpoint.load(rt, f"{folder}/between")
    out["between_err"] = max((got - stepped[n]).abs().max().item() for n, got in _full_params(pair).items())
    pair.zero_grad()
    F.mse_loss(pair.model(pair.local(x)), pair.local(y)).backward()
    F.mse_loss(pair.ref.model(x), y).backward()
    pair.check_grads("after loading")
    pair.step("after loading")
    out["left"] = sorted(n for n, s in rt.states().items() if s is not State.NOT_AVAILABLE)
    out.update(pair.finish())
    return out


def test_a_checkpoint_saves_while_reshard_after_forward_keeps_units(ranks2, tmp_path):
    """With every unit kept from its forward to its backward, ``paramfsm.checkpoint.save`` works after a
    forward whose backward has not run (the backward then gathers again and matches plain torch) and
    between iterations while a kept forward's output is still referenced; each checkpoint loads back the
    parameters it was saved with."""
    for out in ranks2.run(save_while_kept_job, str(tmp_path)):
        assert out["kept"] == ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias", "4.weight"], out
        assert out["after_forward_err"] == 0 and out["between_err"] <= 1e-6, out
        assert out["left"] == [] and out["checks"] == 4 and out["grad_err"] <= 1e-6, out
