"""Accumulated gradients are stepped together just before the next event ([Note: accumulated
gradients are stepped together]): the saving must not move a gradient past its unit's events, and the
result must match plain torch."""

from __future__ import annotations

import torch
from patterns_common import Pair, batch
from torch import nn

from paramfsm.engine.events.events import POST_BACKWARD, PRE_BACKWARD


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
            # the root, a unit that owns nothing, shares unit 2's output node: its events hold no gradient
            between = [entry for entry in order[pre + 1:post] if entry[0] != "grad" and entry[1] != "<root>"]
            assert between == [], (rank, i, order)
