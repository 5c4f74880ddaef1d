"""Runtime scenarios on 2 (and 3) gloo ranks, each compared with single-process plain torch (the two-rank ones
under a unit per module and under shard()'s default merge: ``patterns_common.UNIT_CHOICES``).

The seed pattern (one forward, several losses, ``zero_grad(); backward(l1,
retain_graph=True); zero_grad(); backward(l2)``) under both retain policies,
with plain ``loss.backward`` and ``rt.backward``, over several optimizer steps.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from patterns_common import ranks2  # noqa: F401 - the fixture: every two-rank scenario here runs under both unit choices
from patterns_common import unit_kwargs

import paramfsm
from paramfsm import State
from paramfsm.core.fsm import default_table
from paramfsm.core.replay import replay
from paramfsm.testing import Reference, assert_close_dicts, rank_slice, sharded_grads, sharded_params
from paramfsm.testing.models import TinyTransformer

VOCAB, SEQ, PER_RANK = 32, 8, 2


def _batch(step: int, world: int):
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (world * PER_RANK, SEQ), generator=gen)
    targets = torch.randint(0, VOCAB, (world * PER_RANK, SEQ), generator=gen)
    return tokens, targets


def _losses(out, targets, count: int):
    """Several different losses from one output (all batch means)."""
    flat = out.reshape(-1, VOCAB)
    losses = [F.cross_entropy(flat, targets.reshape(-1)), (out ** 2).mean(), out.tanh().mean()]
    return losses[:count]


def multi_loss_job(rank, world, retain, n_losses, use_rt_backward, steps, tied=False):
    torch.manual_seed(0)
    model = TinyTransformer(vocab=VOCAB, dim=16, depth=2, seq=SEQ, tied=tied)
    ref = Reference(model, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    rt = paramfsm.shard(model, retain=retain, trace=True, strict=True, **unit_kwargs(model))
    opt = torch.optim.SGD(rt.shard_parameters(), lr=0.1, momentum=0.9)
    report = {"grad_err": 0.0, "param_err": 0.0, "gathers_per_backward": [], "tasks_per_backward": []}
    for step in range(steps):
        tokens, targets = _batch(step, world)
        out = model(rank_slice(tokens, rank, world))
        losses = _losses(out, rank_slice(targets, rank, world), n_losses)
        ref_losses = _losses(ref.model(tokens), targets, n_losses)
        for i, (loss, ref_loss) in enumerate(zip(losses, ref_losses)):
            keep = i < n_losses - 1
            opt.zero_grad()
            ref.zero_grad()
            gathers, tasks, first = rt.counters["all_gathers"], rt.scheduler.graph.tasks_begun, len(rt.trace)
            if use_rt_backward:
                rt.backward(loss, retain_graph=keep)
            else:
                loss.backward(retain_graph=keep)
            report["gathers_per_backward"].append(rt.counters["all_gathers"] - gathers)
            report["tasks_per_backward"].append(
                (rt.scheduler.graph.tasks_begun - tasks,
                 len({r.graph_task for r in rt.trace.records[first:] if r.graph_task >= 0})))
            expected = State.DEFERRED_RELEASE if keep and retain == "defer" else State.NOT_AVAILABLE
            states = rt.states()
            assert set(states.values()) == {expected}, f"after backward {i}: {states}"
            ref_loss.backward(retain_graph=keep)
            err = assert_close_dicts(sharded_grads(rt, model), ref.grads(), atol=1e-6,
                                     what=f"step {step} backward {i}")
            report["grad_err"] = max(report["grad_err"], err)
        opt.step()
        ref.optimizer.step()
        err = assert_close_dicts(sharded_params(rt, model), ref.params(), atol=1e-5, what=f"params after step {step}")
        report["param_err"] = max(report["param_err"], err)
    problem = replay(rt.trace.records, default_table())
    assert problem is None, str(problem)
    assert rt.scheduler.audit.last == []
    rt.close()
    return report


@pytest.mark.parametrize("retain", ["defer", "regather"])
@pytest.mark.parametrize("use_rt_backward", [False, True], ids=["loss.backward", "rt.backward"])
def test_two_losses_retained_graph(ranks2, retain, use_rt_backward):
    report = ranks2.run(multi_loss_job, retain, 2, use_rt_backward, 3)[0]
    gathers = report["gathers_per_backward"]
    second_backwards = gathers[1::2]
    if retain == "defer":
        assert second_backwards == [0, 0, 0], gathers
    else:
        assert all(g > 0 for g in second_backwards), gathers
    assert all(t == (1, 1) for t in report["tasks_per_backward"]), report["tasks_per_backward"]


@pytest.mark.parametrize("retain", ["defer", "regather"])
def test_three_losses(ranks2, retain):
    report = ranks2.run(multi_loss_job, retain, 3, False, 2)[0]
    gathers = report["gathers_per_backward"]
    if retain == "defer":
        assert [g for i, g in enumerate(gathers) if i % 3] == [0, 0, 0, 0], gathers
    assert all(t == (1, 1) for t in report["tasks_per_backward"])


def test_two_losses_three_ranks(ranks3):
    report = ranks3.run(multi_loss_job, "defer", 2, False, 2)[0]
    assert report["gathers_per_backward"][1::2] == [0, 0]


def test_tied_weights_two_losses(ranks2):
    report = ranks2.run(multi_loss_job, "defer", 2, False, 2, True)[0]
    assert report["gathers_per_backward"][1::2] == [0, 0]


def dropped_graph_job(rank, world, how):
    torch.manual_seed(0)
    model = TinyTransformer(vocab=VOCAB, dim=16, depth=2, seq=SEQ)
    ref = Reference(model)
    rt = paramfsm.shard(model, trace=True, strict=True, **unit_kwargs(model))
    tokens, targets = _batch(0, world)
    out = model(rank_slice(tokens, rank, world))
    l1, l2 = _losses(out, rank_slice(targets, rank, world), 2)
    l1.backward(retain_graph=True)
    held = rt.deferred_bytes
    assert held > 0 and set(rt.states().values()) == {State.DEFERRED_RELEASE}
    if how == "flush":
        rt.flush()
    else:
        del out, l1, l2
    after = rt.deferred_bytes
    assert set(rt.states().values()) == {State.NOT_AVAILABLE}, rt.states()
    if how == "flush":
        ref_out = ref.model(tokens)
        r1, r2 = _losses(ref_out, targets, 2)
        r1.backward(retain_graph=True)
        ref.zero_grad()
        for shard in rt.shard_parameters():
            shard.grad = None
        before = rt.counters["all_gathers"]
        l2.backward()
        r2.backward()
        assert rt.counters["all_gathers"] > before, "a backward after flush must re-gather"
        assert_close_dicts(sharded_grads(rt, model), ref.grads(), atol=1e-6)
    assert replay(rt.trace.records, default_table()) is None
    return held, after


@pytest.mark.parametrize("how", ["flush", "drop_graph"])
def test_deferred_memory_returned(ranks2, how):
    held, after = ranks2.run(dropped_graph_job, how)[0]
    assert held > 0 and after == 0


def bounded_job(rank, world, bound):
    torch.manual_seed(0)
    model = TinyTransformer(vocab=VOCAB, dim=16, depth=2, seq=SEQ)
    ref = Reference(model)
    rt = paramfsm.shard(model, max_deferred_bytes=bound, trace=True, strict=True, **unit_kwargs(model))
    tokens, targets = _batch(0, world)
    out = model(rank_slice(tokens, rank, world))
    l1, l2 = _losses(out, rank_slice(targets, rank, world), 2)
    r1, r2 = _losses(ref.model(tokens), targets, 2)
    l1.backward(retain_graph=True)
    r1.backward(retain_graph=True)
    assert_close_dicts(sharded_grads(rt, model), ref.grads(), atol=1e-6)
    for shard in rt.shard_parameters():
        shard.grad = None
    ref.zero_grad()
    l2.backward()
    r2.backward()
    assert_close_dicts(sharded_grads(rt, model), ref.grads(), atol=1e-6)
    return rt.scheduler.deferral.peak_bytes, sum(rt.record(n).nbytes for n, _ in model.named_parameters())


def test_max_deferred_bytes_bounds_memory(ranks2):
    bound = 4096
    peak, total = ranks2.run(bounded_job, bound)[0]
    assert 0 < peak <= bound < total


def test_shard_requires_initialised_distributed(monkeypatch):
    # Other tests leave a one-rank group in this process (group="single"): the check is asked as if none.
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)
    with pytest.raises(paramfsm.ParamFSMError, match="init_process_group"):
        paramfsm.shard(torch.nn.Linear(2, 2))


def consumed_graph_job(rank, world):
    torch.manual_seed(0)
    model = TinyTransformer(vocab=VOCAB, dim=16, depth=2, seq=SEQ)
    ref = Reference(model)
    rt = paramfsm.shard(model, trace=True, strict=True, **unit_kwargs(model))
    tokens, targets = _batch(0, world)
    local = rank_slice(tokens, rank, world), rank_slice(targets, rank, world)
    history = []  # a loss history keeps the first (consumed) graph's outputs alive
    out0 = model(local[0])
    history.append(_losses(out0, local[1], 1)[0])
    history[-1].backward()
    out1 = model(local[0])
    loss1 = _losses(out1, local[1], 1)[0]
    for shard in rt.shard_parameters():
        shard.grad = None
    loss1.backward(retain_graph=True)
    ref_loss = _losses(ref.model(tokens), targets, 1)[0]
    ref_loss.backward()
    assert_close_dicts(sharded_grads(rt, model), ref.grads(), atol=1e-6)
    held = rt.deferred_bytes
    del out1, loss1
    return held, rt.deferred_bytes, set(rt.states().values())


def test_dropped_retained_graph_returns_memory_while_a_consumed_graph_lives(ranks2):
    held, after, states = ranks2.run(consumed_graph_job)[0]
    assert held > 0 and after == 0 and states == {State.NOT_AVAILABLE}
