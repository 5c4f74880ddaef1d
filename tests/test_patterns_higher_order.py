"""Higher-order gradients (``create_graph=True``) on 2 gloo ranks, compared with plain torch.

A gradient penalty differentiates a gradient: ``torch.autograd.grad(loss,
wrt, create_graph=True)`` records each unit's backward as new graph nodes
that read the unit's parameters, and the final backward runs those nodes.
The penalty of a rank is a function of that rank's own gradient, so the
reference evaluates the same per-rank objective on each rank's slice,
``(1/world) * sum_r (loss_r + penalty_r)``, whose gradient is what the
averaged reduce-scatter produces. ``retain="regather"`` and
``max_deferred_bytes=0`` make sure nothing relies on deferred parameters
still being gathered, and ``bucket_bytes=0, prefetch=0`` that nothing relies
on a unit being gathered early with its bucket or ahead of use.
"""

from __future__ import annotations

import pytest
import torch
from patterns_common import Pair, batch
from patterns_common import ranks2  # noqa: F401 - the fixture: every test here runs under both unit choices
from torch import nn

from paramfsm import State


class PenaltyNet(nn.Module):
    """Linear -> LayerNorm -> tanh -> raw matmul with a parameter -> times ``1.5 + sin(scale)``.

    LayerNorm's and the matmul's double-backward nodes save the parameter
    itself (a leaf is saved by reference), and ``sin(scale)`` puts
    ``cos(scale)`` into the gradient of ``scale``, so a penalty on parameter
    gradients runs a node that reads ``scale`` itself.
    """

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.norm = nn.LayerNorm(8)
        self.proj = nn.Parameter(torch.randn(8, 3) * 0.3)
        self.scale = nn.Parameter(torch.rand(3) + 0.5)

    def forward(self, x):
        return (torch.tanh(self.norm(self.lin(x))) @ self.proj) * (1.5 + torch.sin(self.scale))


def _objective(model, x, wrt: str, with_loss: bool):
    """loss + ||d loss / d wrt||^2 for one batch slice; ``x`` requires grad only when wrt == 'input'.

    With wrt == 'param' no input requires grad, so a later backward can reach
    the recorded computations only through the parameter gradients.
    """
    loss = model(x).pow(2).mean()
    targets = [x] if wrt == "input" else list(model.parameters())
    grads = torch.autograd.grad(loss, targets, create_graph=True)
    penalty = sum(g.pow(2).sum() for g in grads)
    return (loss + penalty) if with_loss else penalty


def _sgd(params):
    return torch.optim.SGD(params, lr=0.01)


def penalty_job(rank, world, wrt, retain, bound, with_loss):
    torch.manual_seed(0)
    pair = Pair(PenaltyNet(), rank, world, make_optimizer=_sgd, retain=retain, max_deferred_bytes=bound,
                bucket_bytes=0, prefetch=0)
    model, ref = pair.model, pair.ref.model
    for step in range(2):
        x, = batch(step, world, 2, (4,))
        pair.zero_grad()
        _objective(model, pair.local(x).clone().requires_grad_(wrt == "input"), wrt, with_loss).backward()
        pair.assert_states(State.NOT_AVAILABLE, what="after the final backward")
        total = sum(_objective(ref, part.clone().requires_grad_(wrt == "input"), wrt, with_loss)
                    for part in x.chunk(world)) / world
        total.backward()
        pair.check_grads(f"step {step}", atol=1e-5)
        pair.step(f"step {step}")
    return pair.finish()


@pytest.mark.parametrize("wrt", ["input", "param"])
@pytest.mark.parametrize("retain,bound", [("defer", None), ("regather", None), ("defer", 0)],
                         ids=["defer", "regather", "bound0"])
def test_gradient_penalty(ranks2, wrt, retain, bound):
    assert ranks2.run(penalty_job, wrt, retain, bound, True)[0]["checks"] == 4


@pytest.mark.parametrize("wrt", ["input", "param"])
def test_penalty_alone_reaches_parameters_only_through_recorded_gradients(ranks2, wrt):
    """The final backward runs only recorded backward nodes: no forward node fetches anything first."""
    assert ranks2.run(penalty_job, wrt, "regather", None, False)[0]["checks"] == 4


def retained_penalty_job(rank, world, retain):
    """``penalty.backward(retain_graph=True)`` twice through recorded gradients only (wrt the parameters).

    With ``retain="defer"`` the retained backward keeps every unit it fetched DEFERRED_RELEASE, so the
    second backward over the same graph gathers nothing; with ``"regather"`` it releases them and the
    second backward gathers again. Gradients match plain torch after each backward either way.
    """
    torch.manual_seed(0)
    pair = Pair(PenaltyNet(), rank, world, make_optimizer=_sgd, retain=retain, bucket_bytes=0, prefetch=0)
    model, ref = pair.model, pair.ref.model
    x, = batch(0, world, 2, (4,))
    pair.zero_grad()
    penalty = _objective(model, pair.local(x), "param", False)
    ref_penalty = sum(_objective(ref, part, "param", False) for part in x.chunk(world)) / world
    penalty.backward(retain_graph=True)
    ref_penalty.backward(retain_graph=True)
    kept = State.DEFERRED_RELEASE if retain == "defer" else State.NOT_AVAILABLE
    pair.assert_states(kept, what="after the retained penalty backward")
    pair.check_grads("retained penalty backward", atol=1e-5)
    before = pair.rt.counters["all_gathers"]
    penalty.backward()
    gathers = pair.rt.counters["all_gathers"] - before
    ref_penalty.backward()
    pair.assert_states(State.NOT_AVAILABLE, what="after the final penalty backward")
    pair.check_grads("final penalty backward", atol=1e-5)
    pair.step("step")
    pair.finish()
    return gathers


def test_a_retained_penalty_backward_defers_and_the_next_backward_gathers_nothing(ranks2):
    assert ranks2.run(retained_penalty_job, "defer") == [0, 0]
    assert min(ranks2.run(retained_penalty_job, "regather")) > 0
