"""Two per-step savings that must not change results: the root unit stays gathered from its forward to
its backward ([Note: the root stays gathered for its backward]), and accumulated gradients are
stepped together just before the next event ([Note: accumulated gradients are stepped together]).

Each test pins the saving (states, collectives, the order of effects) and the result (gradients and
parameters against plain torch).
"""

from __future__ import annotations

import gc

import pytest
import torch
from patterns_common import Pair, batch
from torch import nn

import paramfsm
from paramfsm import State
from paramfsm.engine.events import POST_BACKWARD, PRE_BACKWARD


def _root_model() -> nn.Module:
    """A Sequential whose only unit is the root (by_size puts the whole small model in one unit)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def root_job(rank, world, retain):
    pair = Pair(_root_model(), rank, world, retain=retain, units=paramfsm.by_size(min_bytes=1 << 20))
    assert [u.name for u in pair.rt.units] == ["<root>"]
    seen = {}
    for step in range(3):
        x, = batch(step, world, 2, (8,))
        pair.zero_grad()
        before = pair.rt.counters
        out = pair.model(pair.local(x))
        seen.setdefault("after_forward", set(pair.rt.states().values()))
        out.pow(2).mean().backward()
        pair.ref.model(x).pow(2).mean().backward()
        seen[f"gathers_{step}"] = pair.rt.counters["all_gathers"] - before["all_gathers"]
        seen.setdefault("after_backward", set(pair.rt.states().values()))
        pair.check_grads(f"step {step}")
        pair.step(f"step {step}")
    seen["report"] = pair.finish()
    return seen


@pytest.mark.parametrize("retain", ["defer", "regather"])
def test_the_root_stays_gathered_from_forward_to_backward(ranks2, retain):
    """Under retain="defer" the root's parameters wait DEFERRED between forward and backward, and a
    one-unit model gathers once per step instead of twice; "regather" releases them at once. Either
    way the gradients and parameters match plain torch and every parameter rests after backward."""
    for rank, seen in enumerate(ranks2.run(root_job, retain)):
        deferred = retain == "defer"
        assert seen["after_forward"] == {State.DEFERRED_RELEASE if deferred else State.NOT_AVAILABLE}, (rank, seen)
        assert seen["after_backward"] == {State.NOT_AVAILABLE}, (rank, seen)
        assert seen["gathers_2"] == (1 if deferred else 2), (rank, seen)
        assert seen["report"]["checks"] == 6, (rank, seen)


def root_without_backward_job(rank, world):
    """A forward that builds a graph nobody backpropagates, one under no_grad, and a flush."""
    model = _root_model()
    rt = paramfsm.shard(model, trace=True, strict=True, units=paramfsm.by_size(min_bytes=1 << 20))
    x = torch.randn(2, 8)
    states = {}
    out = model(x)
    states["graph"] = set(rt.states().values())
    bytes_held = rt.deferred_bytes
    del out
    gc.collect()
    states["graph_dropped"] = set(rt.states().values())
    with torch.no_grad():
        model(x)
    states["no_grad"] = set(rt.states().values())
    out = model(x)
    rt.flush()
    states["flushed"] = set(rt.states().values())
    del out
    first = model(x)
    second = model(x)  # a new root forward flushes the first one's deferred root
    states["two_forwards"] = set(rt.states().values())
    (first + second).sum().backward()
    states["after"] = set(rt.states().values())
    audit = rt.scheduler.last_audit
    rt.close()
    return states, bytes_held, audit


def test_a_root_kept_for_a_backward_that_never_comes_is_returned(ranks2):
    """Kept parameters are counted as deferred bytes and return to NOT_AVAILABLE when the graph is
    collected, on rt.flush(), and at the next root forward; a forward under no_grad keeps nothing."""
    for rank, (states, bytes_held, audit) in enumerate(ranks2.run(root_without_backward_job)):
        assert states["graph"] == {State.DEFERRED_RELEASE} and bytes_held > 0, (rank, states)
        for moment in ("graph_dropped", "no_grad", "flushed", "after"):
            assert states[moment] == {State.NOT_AVAILABLE}, (rank, moment, states)
        assert states["two_forwards"] == {State.DEFERRED_RELEASE}, (rank, states)
        assert audit == [], (rank, audit)


def grad_queue_job(rank, world):
    """The order in which the scheduler applies unit events and runs reduce_grad effects."""
    torch.manual_seed(0)
    pair = Pair(nn.Sequential(*(nn.Linear(8, 8) for _ in range(3))), rank, world)
    sched = pair.rt.scheduler
    order = []
    take = pair.rt.executor.take_grad

    def take_grad(records):
        order.extend(("grad", rec.name) for rec in records)
        take(records)

    sched._effects["reduce_grad"] = take_grad
    for kind in (PRE_BACKWARD, POST_BACKWARD):
        handler = sched._handlers[kind]
        sched._handlers[kind] = lambda ev, handler=handler, kind=kind: (order.append((kind, ev.unit.name)),
                                                                         handler(ev))
    x, = batch(0, world, 2, (8,))
    pair.zero_grad()
    pair.model(pair.local(x)).pow(2).mean().backward()
    pair.ref.model(x).pow(2).mean().backward()
    pair.check_grads("one backward")
    pair.step("one backward")
    pair.finish()
    return order


def test_queued_gradients_leave_before_the_next_event(ranks2):
    """Every gradient of unit k is taken after unit k's pre-backward and before the next unit event is
    applied (unit k's post-backward), each exactly once; gradients still match plain torch."""
    for rank, order in enumerate(ranks2.run(grad_queue_job)):
        grads = [name for kind, name in order if kind == "grad"]
        assert sorted(grads) == sorted(f"{i}.{p}" for i in range(3) for p in ("weight", "bias")), (rank, order)
        for i in (2, 1):
            pre = order.index((PRE_BACKWARD, str(i)))
            post = order.index((POST_BACKWARD, str(i)))
            taken = [order.index(("grad", f"{i}.{p}")) for p in ("weight", "bias")]
            assert all(pre < at < post for at in taken), (rank, i, order)
            between = [entry for entry in order[pre + 1:post] if entry[0] != "grad"]
            assert between == [], (rank, i, order)
