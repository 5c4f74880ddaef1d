"""What the performance work must keep, in counts (tests cannot assert wall-clock time).

* The batched step (``paramfsm.core.fsm.step_many``) keeps every per-parameter
  transition: a training step still traces the same nine transitions per
  parameter, each with its own sequence number.
* ``paramfsm trace summary`` reports how long each unit's fetches waited for their
  gather ([Note: gather waits] in ``paramfsm.core.trace_report``), from
  hand-built records and from a real world-2 run.
"""

from __future__ import annotations

import torch
from torch import nn

import paramfsm
from paramfsm.core.trace import TraceRecord
from paramfsm.core.trace_report import GatherWait, gather_waits, summarize

NA, IN, AV, DR = "NOT_AVAILABLE", "INFLIGHT", "AVAILABLE", "DEFERRED_RELEASE"


def rec(t, param, unit, event, src, dst, effects=(), *, holds=0, rank=0):
    return TraceRecord(0, t, rank, 1, -1, param, unit, event, src, dst, tuple(effects), False, False, holds, 4)


def test_gather_waits_from_hand_built_records():
    records = [
        # unit a: fetched from rest at 0, its two parameters arrive at 10 and 30: it waited 30
        rec(0, "a.w", "a", "fetch", NA, IN, ["start_gather"]), rec(0, "a.b", "a", "fetch", NA, IN, ["start_gather"]),
        rec(0, "c.w", "c", "prefetch", NA, IN, ["start_gather"]),
        rec(10, "a.w", "a", "arrive", IN, AV, ["unpack"], holds=1),
        rec(30, "a.b", "a", "arrive", IN, AV, ["unpack"], holds=1),
        rec(35, "a.w", "a", "fetch", AV, AV, holds=1),  # a second holder (a gradient hold): not a fetch
        # unit c: prefetched, still in flight when fetched at 40, arrives at 45: it waited 5
        rec(40, "c.w", "c", "fetch", IN, IN), rec(45, "c.w", "c", "arrive", IN, AV, ["unpack"], holds=1),
        rec(50, "c.w", "c", "release", AV, NA, ["free"], holds=1),
        # unit c again: a prefetch that already arrived is ready, and so is a deferred copy
        rec(60, "c.w", "c", "prefetch", NA, IN, ["start_gather"]), rec(65, "c.w", "c", "arrive", IN, AV, ["unpack"]),
        rec(70, "c.w", "c", "fetch", AV, AV),
        rec(80, "c.w", "c", "release", AV, DR, ["defer"], holds=1), rec(90, "c.w", "c", "fetch", DR, AV, ["undefer"]),
        # unit d: fetched and never arrived (a trace cut short): counted, not as a wait
        rec(95, "d.w", "d", "fetch", NA, IN, ["start_gather"]),
    ]
    assert gather_waits(records) == {
        "a": GatherWait(fetches=1, waited=1, total_ns=30, max_ns=30),
        "c": GatherWait(fetches=3, waited=1, total_ns=5, max_ns=5),
        "d": GatherWait(fetches=1, waited=0, total_ns=0, max_ns=0),
    }
    text = summarize(records).format()
    assert "gather waits: 2 of 5 unit fetches waited for their gather, total 0.000 ms" in text
    assert "unit 'a': 1/1 waited" in text and "unit 'd':" not in text


def test_gather_waits_of_nothing():
    assert gather_waits([]) == {}
    assert "gather waits: no holder fetches" in summarize([]).format()


def _tiny(depth: int = 6, width: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(depth)))


def test_a_step_still_traces_every_parameter_transition():
    model = _tiny()
    rt = paramfsm.shard(model, group="single", trace=True)
    opt = torch.optim.SGD(rt.shard_parameters(), lr=0.1)
    x = torch.randn(4, 8)
    for _ in range(2):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    records = [r for r in rt.trace.records if r.step == 2]
    params = len(rt.shard_parameters())
    # per parameter: forward fetch, arrive, release; backward fetch, arrive, gradient-hold fetch,
    # grad_ready, gradient-hold release, unit release
    assert len(records) == 9 * params
    assert sorted(r.seq for r in records) == list(range(records[0].seq, records[0].seq + 9 * params))
    by_param = {}
    for r in records:
        by_param.setdefault(r.param, []).append(r.event)
    assert set(map(tuple, by_param.values())) == {
        ("fetch", "arrive", "release", "fetch", "arrive", "fetch", "grad_ready", "release", "release")}
    rt.close()


def overlap_job(rank, world):
    model = _tiny(depth=4, width=64)
    rt = paramfsm.shard(model, trace=True, bucket_bytes=1)  # every unit its own bucket
    opt = torch.optim.SGD(rt.shard_parameters(), lr=0.1)
    x = torch.randn(4, 64)
    for _ in range(2):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    records = [r for r in rt.trace.records if r.step == 2]
    prefetched = sum(1 for r in records if r.event == "prefetch" and r.src == NA)
    waits = gather_waits(records)
    rt.close()
    return {unit: (w.fetches, w.waited) for unit, w in waits.items()}, prefetched


def test_gather_waits_of_a_world2_run(ranks2):
    for waits, prefetched in ranks2.run(overlap_job):
        # every unit is fetched once in forward and once in backward; on the CPU the host unpacks at
        # the fetch, so each fetch waits (briefly, when the prefetch had time to travel)
        assert waits == {str(i): (2, 2) for i in range(4)}, waits
        # all but the first unit of each pass were prefetched (two parameters each); in forward the first
        # unit fetched is the root, which owns nothing, so all four are
        assert prefetched == 2 * 4 + 2 * 3, prefetched


def test_a_unit_is_released_before_the_unit_below_is_fetched():
    """[Note: a unit is released before the unit below it is fetched]: in backward, at most one
    unit of a chain is gathered at a time (world 1 prefetches nothing)."""
    model = _tiny(depth=5)
    rt = paramfsm.shard(model, group="single", trace=True)
    for _ in range(2):
        model(torch.randn(4, 8)).pow(2).mean().backward()
    gathered: dict[str, set] = {}
    most = 0
    for r in rt.trace.records:
        if r.step != 2 or r.graph_task == -1:
            continue
        if r.dst == AV:
            gathered.setdefault(r.unit, set()).add(r.param)
        elif r.dst == NA:
            gathered.get(r.unit, set()).discard(r.param)
        most = max(most, sum(1 for params in gathered.values() if params))
    assert most == 1, most
    rt.close()


def reduce_job(rank, world):
    model = _tiny(depth=3, width=64)
    rt = paramfsm.shard(model, bucket_bytes=4096)
    reference = _tiny(depth=3, width=64)
    x = torch.randn(4, 64)
    model(x).pow(2).mean().backward()
    reference(x).pow(2).mean().backward()
    before = rt.counters["reduce_scatters"]
    model(x).pow(2).mean().backward()
    reference(x).pow(2).mean().backward()
    per_step = rt.counters["reduce_scatters"] - before
    errors = [(rt.full_grad(name) - p.grad).abs().max().item() for name, p in reference.named_parameters()]
    rt.close()
    return per_step, max(errors)


def test_big_gradients_are_reduced_alone_and_in_place(ranks2):
    for per_step, error in ranks2.run(reduce_job):
        # each 16 KiB weight gradient in a bucket of its own, the three 256-byte biases together
        assert per_step == 3 + 1, per_step
        assert error < 1e-6, error
