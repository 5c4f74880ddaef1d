"""``opt.step(closure)``: the forward and backward run inside the step (Lightning's every step, LBFGS).

The step's checks (no unsynchronised gradient) and its shard-write
announcement look at the gradients the closure made, not at the previous
iteration's: see [Note: a closure's gradients come after the pre-hook] in
``paramfsm/optim/__init__.py``.
"""

from __future__ import annotations

import copy

import pytest
import torch

import paramfsm
from paramfsm.errors import UnsyncedGradients
from paramfsm.testing import sharded_params


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def _batches(world, count):
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(2 * world, 4, generator=gen) for _ in range(count)]


def _loss(model, x):
    return model(x).pow(2).mean() / 2


def accumulate_then_closure_job(rank, world, optimizer):
    """One micro-batch under no_sync, the last one's backward inside the step's closure."""
    model = _model()
    ref = copy.deepcopy(model)
    rt = paramfsm.shard(model, trace=True, strict=True)
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
            "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2)}[optimizer]
    opt, ropt = make(model.parameters()), make(ref.parameters())
    mine = slice(2 * rank, 2 * rank + 2)
    worst, losses, bumped = 0.0, [], []
    for step in range(3):
        xs = _batches(world, 2 * (step + 1))[-2:]
        opt.zero_grad()
        with rt.no_sync():
            _loss(model, xs[0][mine]).backward()

        def closure():
            loss = _loss(model, xs[1][mine])
            loss.backward()
            return loss

        versions = [p._version for p in model.parameters()]
        losses.append(float(opt.step(closure).detach()))
        bumped.append(sum(p._version > v for p, v in zip(model.parameters(), versions)))
        ropt.zero_grad()
        for x in xs:
            _loss(ref, x).backward()
        ropt.step()
        got = sharded_params(rt, model)
        worst = max(worst, max((got[n] - p.detach()).abs().max().item() for n, p in ref.named_parameters()))
    rt.close()
    return {"worst": worst, "bumped": bumped, "losses": losses, "params": len(ref.state_dict())}


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_the_last_micro_batch_may_run_inside_the_step_closure(ranks2, optimizer):
    # Before, the step's pre-hook saw the kept no_sync gradients before the closure synced them and
    # raised UnsyncedGradients on a correct loop.
    for out in ranks2.run(accumulate_then_closure_job, optimizer):
        assert out["worst"] < 1e-6, out
        # each step announces that it writes every parameter (so their versions move, as plain torch's
        # in-place update moves them), the first included: its gradients exist only once the closure ran
        assert out["bumped"] == [out["params"]] * 3, out


def closure_under_no_sync_job(rank, world):
    model = _model()
    rt = paramfsm.shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = _batches(world, 1)[0][2 * rank: 2 * rank + 2]
    before = {n: t.clone() for n, t in sharded_params(rt, model).items()}

    def closure():
        with rt.no_sync():
            loss = _loss(model, x)
            loss.backward()
        return loss

    try:
        opt.step(closure)
    except UnsyncedGradients as exc:
        message = str(exc)
    else:
        message = None
    after = sharded_params(rt, model)
    unchanged = all(torch.equal(before[n], after[n]) for n in before)
    rt.sync_gradients()
    rt.close()
    return {"message": message, "unchanged": unchanged}


def test_a_closure_whose_backward_keeps_gradients_is_still_refused(ranks2):
    for out in ranks2.run(closure_under_no_sync_job):
        assert out["message"] is not None and "SGD.step()" in out["message"], out
        assert "rank" in out["message"] and "no_sync" in out["message"], out
        assert out["unchanged"], out


def retained_graph_over_a_closure_step_job(rank, world):
    """A closure that keeps its graph; a backward over it after the step must fail as in plain torch."""
    model = _model()
    rt = paramfsm.shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = _batches(world, 1)[0][2 * rank: 2 * rank + 2]

    def closure():
        opt.zero_grad()
        loss = _loss(model, x)
        loss.backward(retain_graph=True)
        return loss

    loss = opt.step(closure)
    try:
        loss.backward()
    except RuntimeError as exc:
        message = str(exc)
    else:
        message = None
    del loss
    rt.flush()
    rt.close()
    return message


def test_a_backward_over_a_graph_from_before_a_closure_step_fails_as_in_plain_torch(ranks2):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = _batches(2, 1)[0][:2]

    def closure():
        opt.zero_grad()
        loss = _loss(model, x)
        loss.backward(retain_graph=True)
        return loss

    loss = opt.step(closure)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    for message in ranks2.run(retained_graph_over_a_closure_step_job):
        assert message is not None and "modified by an inplace operation" in message, message
