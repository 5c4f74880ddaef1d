"""The per-step hot path: gloo's collectives by point-to-point exchange or all-reduce, chained
post-backward hooks, lazily registered higher-order hooks, and forward calls that a backward consumed.

Each of these saves work on every step, so a regression would not break correctness loudly; these
tests pin both the saving (which path ran, how many hooks were registered, which events arrived)
and the result (sums, gradients against plain torch, parameter states).
"""

from __future__ import annotations

import pytest
import torch
from patterns_common import Pair, batch
from test_patterns_higher_order import PenaltyNet
from torch import nn

import paramfsm
from paramfsm import State
from paramfsm.engine.effects.collectives import (
    GLOO_ALL_REDUCE_BYTES, _ViaAllReduce, all_gather_flat, reduce_scatter_flat,
)
from paramfsm.engine.effects.gloo.exchange import Exchange
from paramfsm.engine.events.events import GRAPH_FREED
from paramfsm.testing import Reference, assert_close_dicts, rank_slice, sharded_grads

_FLOATS = GLOO_ALL_REDUCE_BYTES // 4  # float32 elements of an input exactly at the threshold


def reduce_scatter_job(rank, world):
    """For inputs just below, at and above the threshold, blocking or not: which path ran, and errors."""
    rows = []
    above = -(-_FLOATS // world) * world  # the smallest multiple of the world at or above the threshold
    for numel in (2 * world, above - world, above, above + 6 * world):
        for async_op in (True, False):
            # Rank-distinct small integers, so float32 sums are exact.
            make = lambda r: (torch.arange(numel, dtype=torch.float32) % 97) * (r + 1) + 1000 * r  # noqa: E731
            total = sum(make(r) for r in range(world))
            size = numel // world
            want = total[rank * size:(rank + 1) * size]
            inp, out = make(rank), torch.full((size,), float("nan"))
            handle = reduce_scatter_flat(out, inp, None, async_op=async_op)
            ready_on_return = bool(torch.equal(out, want))  # a blocking call must leave `out` filled
            if handle is not None:
                handle.wait()
            rows.append({"numel": numel, "async": async_op, "via_all_reduce": isinstance(handle, _ViaAllReduce),
                         "exchanged": isinstance(handle, Exchange),
                         "ready_on_return": ready_on_return, "out_ok": bool(torch.equal(out, want)),
                         "inp_is_sum": bool(torch.equal(inp, total)), "inp_kept": bool(torch.equal(inp, make(rank)))})
    return rows


def test_reduce_scatter_by_all_reduce_on_gloo(ranks3):
    """At world 3, inputs of at least GLOO_ALL_REDUCE_BYTES are summed whole in place ([Note: gloo
    reduces by all-reduce]) and smaller ones reduce-scattered; either way `out` is this rank's slice of
    the sum. The path is checked (handle type, `inp` overwritten by the sum), so the test fails if the
    big path silently stops being taken or the small one starts taking it."""
    for rank, rows in enumerate(ranks3.run(reduce_scatter_job)):
        for row in rows:
            big = row["numel"] * 4 >= GLOO_ALL_REDUCE_BYTES
            assert row["out_ok"], f"rank {rank}: wrong slice of the sum: {row}"
            assert row["via_all_reduce"] == big and not row["exchanged"], f"rank {rank}: wrong path: {row}"
            assert row["inp_is_sum"] == big and row["inp_kept"] == (not big), f"rank {rank}: {row}"
            if not row["async"]:
                assert row["ready_on_return"], f"rank {rank}: blocking call returned before `out` was set: {row}"


def test_reduce_scatter_by_exchange_at_world_2(ranks2):
    """At world 2 every size is exchanged point to point ([Note: gloo exchanges shards point to
    point]): `out` is this rank's slice of the sum, `inp` is left as it was, and a blocking call
    returns with `out` filled."""
    for rank, rows in enumerate(ranks2.run(reduce_scatter_job)):
        for row in rows:
            assert row["out_ok"] and row["inp_kept"], f"rank {rank}: {row}"
            assert row["exchanged"] == row["async"] and not row["via_all_reduce"], f"rank {rank}: wrong path: {row}"
            if not row["async"]:
                assert row["ready_on_return"], f"rank {rank}: blocking call returned before `out` was set: {row}"


def all_gather_job(rank, world):
    """Every rank's distinct shard lands in its slot, for a few sizes, blocking or not, twice in flight."""
    rows = []
    for numel in (1, 7, 4096):
        shards = [torch.arange(numel, dtype=torch.float32) + 1000 * r for r in range(world)]
        outs = [torch.full((world * numel,), float("nan")) for _ in range(2)]
        handles = [all_gather_flat(out, shards[rank] * (i + 1), None, async_op=True) for i, out in enumerate(outs)]
        for handle in handles:
            handle.wait()
        blocking = torch.full((world * numel,), float("nan"))
        none = all_gather_flat(blocking, shards[rank], None, async_op=False)
        rows.append({"exchanged": all(isinstance(h, Exchange) for h in handles), "none": none is None,
                     "ok": all(torch.equal(out, torch.cat(shards) * (i + 1)) for i, out in enumerate(outs))
                     and torch.equal(blocking, torch.cat(shards))})
    return rows


def posting_thread_job(rank, world):
    """Which thread posted each send and receive of an all-gather and a reduce-scatter, and their results.

    The group starts a new sequence of exchanges, as a new runtime does: an earlier test's exchanges on these
    shared ranks announce a run, and a batch that deviates from it moves again at its wait, on the waiting
    thread ([Note: a repeating sequence needs no header])."""
    import threading

    import torch.distributed as dist

    from paramfsm.engine.effects.gloo import exchange

    exchange.agree_sizes(dist.group.WORLD, True, forget=True)
    posted, originals = [], (dist.isend, dist.irecv)

    def spy(original):
        return lambda *args, **kwargs: (posted.append(threading.current_thread().name), original(*args, **kwargs))[1]

    dist.isend, dist.irecv = spy(originals[0]), spy(originals[1])
    try:
        shard = torch.arange(4, dtype=torch.float32) + 10 * rank
        gathered = torch.empty(4 * world)
        all_gather_flat(gathered, shard, None).wait()
        summed = torch.empty(4)
        reduce_scatter_flat(summed, torch.arange(8, dtype=torch.float32) * (rank + 1), None).wait()
    finally:
        dist.isend, dist.irecv = originals
    want_sum = (torch.arange(8, dtype=torch.float32) * 3)[rank * 4:(rank + 1) * 4]
    return posted, torch.equal(gathered, torch.cat([torch.arange(4.0) + 10 * r for r in range(world)])), \
        torch.equal(summed, want_sum)


def test_exchanges_are_posted_off_the_callers_thread(ranks2):
    """[Note: an exchange is posted off the caller's thread]: every send and receive of an exchange is
    posted by the exchange thread, never by the caller's, and the results are the collectives' own."""
    for rank, (posted, gathered_ok, summed_ok) in enumerate(ranks2.run(posting_thread_job)):
        # one send and one receive each for the all-gather and the reduce-scatter, and as many for the
        # size-agreeing header before each ([Note: an exchange agrees its sizes first])
        assert len(posted) == 8 and set(posted) == {"paramfsm-exchange"}, (rank, posted)
        assert gathered_ok and summed_ok, rank


@pytest.mark.parametrize("world", [2, 3])
def test_all_gather_by_exchange(ranks2, ranks3, world):
    """All-gathers on gloo are exchanged point to point; two in flight at once keep their messages
    apart (each exchange has its own tag) and every slot holds its rank's shard."""
    pool = ranks2 if world == 2 else ranks3
    for rank, rows in enumerate(pool.run(all_gather_job)):
        for row in rows:
            assert row == {"exchanged": True, "none": True, "ok": True}, (rank, world, row)


class ReluBetween(nn.Module):
    """Linear units with torch.relu between them in the parent's forward: no chain can be formed."""

    def __init__(self, n: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def chain_job(rank, world, kind):
    """One forward+backward, counting Tensor.register_hook calls; returns hooks, unit order, trace."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4))) if kind == "sequential" else ReluBetween(4)
    ref = Reference(model)
    rt = paramfsm.shard(model, trace=True, strict=True)
    x = torch.randn(5, 8)
    calls, original = [], torch.Tensor.register_hook
    torch.Tensor.register_hook = lambda self, hook: calls.append(1) or original(self, hook)
    try:
        start = len(rt.trace.records)
        model(x).pow(2).mean().backward()
    finally:
        torch.Tensor.register_hook = original
    ref.model(x).pow(2).mean().backward()
    assert_close_dicts(sharded_grads(rt, model), ref.grads(), atol=1e-6, what=kind)
    records = [(r.unit, r.event, r.dst) for r in rt.trace.records[start:] if r.graph_task >= 0]
    units = [u.name for u in rt.units if u.records]  # the root unit of a Sequential owns nothing
    rt.close()
    return len(calls), units, records


@pytest.mark.parametrize("kind,hooks", [("sequential", 0), ("relu_between", 3)])
def test_chained_units_share_one_hook(ranks1, kind, hooks):
    """[Note: a chain of units shares one hook]: in a Sequential, unit k+1's post-backward rides on
    unit k's output-node hook, so a forward+backward registers no tensor hook at all; with relu between
    units the fallback tensor hook is used, one per unit with a non-leaf input. Gradients match plain
    torch either way (checked in the job), and in both, unit k+1 is released (its parameters back to
    NOT_AVAILABLE) before unit k is fetched for backward ([Note: a unit is released before the unit
    below it is fetched])."""
    count, units, records = ranks1.run(chain_job, kind)[0]
    assert count == hooks, f"{kind}: {count} Tensor.register_hook calls, expected {hooks}"
    for below, above in zip(units, units[1:]):
        released = max(i for i, (u, ev, dst) in enumerate(records)
                       if u == above and ev == "release" and dst == "NOT_AVAILABLE")
        fetched = min(i for i, (u, ev, _) in enumerate(records) if u == below and ev == "fetch")
        assert released < fetched, f"{kind}: unit {above} released at {released}, unit {below} fetched at {fetched}"


def _penalty(model, x, wrt):
    """loss + ||d loss / d wrt||^2, where wrt is the input or the root unit's own parameters only."""
    loss = model(x).pow(2).mean()
    targets = [x] if wrt == "input" else [model.proj, model.scale]
    return loss + sum(g.pow(2).sum() for g in torch.autograd.grad(loss, targets, create_graph=True))


def higher_order_job(rank, world, wrt):
    """Hook counts per parameter after a first-order step and after each of two gradient-penalty steps.

    As in test_patterns_higher_order, regather / no buckets / no prefetch make the penalty's gradients
    depend on the routing hooks fetching the units (nothing stays gathered by accident)."""
    torch.manual_seed(0)
    pair = Pair(PenaltyNet(), rank, world, make_optimizer=lambda ps: torch.optim.SGD(ps, lr=0.01),
                retain="regather", bucket_bytes=0, prefetch=0)
    records = pair.rt.scheduler.records
    counts = lambda: {r.name: len(r.grad_hooks) for r in records}  # noqa: E731
    seen = [counts()]
    x, = batch(0, world, 2, (4,))
    pair.model(pair.local(x)).pow(2).mean().backward()
    pair.ref.model(x).pow(2).mean().backward()
    pair.check_grads("first order")
    pair.step("first order")
    seen.append(counts())
    for step in (1, 2):
        x, = batch(step, world, 2, (4,))
        pair.zero_grad()
        _penalty(pair.model, pair.local(x).clone().requires_grad_(wrt == "input"), wrt).backward()
        total = sum(_penalty(pair.ref.model, part.clone().requires_grad_(wrt == "input"), wrt)
                    for part in x.chunk(world)) / world
        total.backward()
        pair.check_grads(f"penalty step {step}", atol=1e-5)
        pair.step(f"penalty step {step}")
        seen.append(counts())
    pair.finish()
    return seen


@pytest.mark.parametrize("wrt", ["input", "root"])
def test_higher_order_hooks_come_when_needed(ranks2, wrt):
    """[Note: higher-order hooks come when they are needed]: first-order training leaves each
    parameter with its one post-accumulate-grad hook; the first create_graph backward adds the routing
    hook to the parameters of the units it reached, exactly once (a second penalty step adds none).
    With the penalty taken w.r.t. the root unit's own parameters (proj, scale), autograd.grad reaches
    no node of the `lin` and `norm` units, so they keep one hook. Penalty gradients match plain torch
    (checked in the job)."""
    reached = {"input": {"lin", "norm", "proj", "scale"}, "root": {"proj", "scale"}}[wrt]
    for rank, seen in enumerate(ranks2.run(higher_order_job, wrt)):
        at_shard, first_order, *penalties = seen
        assert set(at_shard.values()) == {1} and set(first_order.values()) == {1}, (rank, at_shard, first_order)
        want = {name: 2 if name.split(".")[0] in reached else 1 for name in first_order}
        for i, got in enumerate(penalties):
            assert got == want, f"rank {rank}, penalty step {i + 1}: {got} != {want}"


def graph_freed_job(rank, world, how):
    """Counts GRAPH_FREED events reaching the scheduler around a backward and the graph's deletion."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(8, 8) for _ in range(3)))
    rt = paramfsm.shard(model, trace=True, strict=True)
    handlers, freed = rt.scheduler._handlers, []
    handlers[GRAPH_FREED] = lambda ev, original=handlers[GRAPH_FREED]: (freed.append(ev.unit.name), original(ev))
    x, = batch(0, world, 2, (8,))
    out = model(rank_slice(x, rank, world))
    first, second = out.pow(2).mean(), out.tanh().mean()
    first.backward(retain_graph=how != "plain")
    after_first = set(rt.states().values())
    if how == "retained_then_consumed":
        second.backward()
    freed_before_del = list(freed)
    del out, first, second
    result = {"after_first": after_first, "freed_before_del": freed_before_del, "freed": freed,
              "states": set(rt.states().values()), "deferred_bytes": rt.deferred_bytes,
              "live_graphs": [u.live_graphs for u in rt.units]}
    rt.close()
    return result


@pytest.mark.parametrize("how", ["plain", "retained_then_dropped", "retained_then_consumed"])
def test_consumed_forward_call_emits_no_graph_freed(ranks2, how):
    """A backward that does not keep its graph consumes the forward calls it reached (`_consume`), so
    deleting their outputs later must emit no GRAPH_FREED (it would count a graph out twice:
    live_graphs would go negative). A graph that was only retained still reports its collection: one
    GRAPH_FREED per unit call, and the deferred parameters return to NOT_AVAILABLE."""
    for rank, res in enumerate(ranks2.run(graph_freed_job, how)):
        assert res["freed_before_del"] == [], (rank, res)
        expected_first = {State.NOT_AVAILABLE} if how == "plain" else {State.DEFERRED_RELEASE}
        assert res["after_first"] == expected_first, (rank, res)
        want = ["0", "1", "2", "<root>"] if how == "retained_then_dropped" else []  # the root is a unit too
        assert sorted(res["freed"]) == want, (rank, res)
        assert res["states"] == {State.NOT_AVAILABLE} and res["deferred_bytes"] == 0, (rank, res)
        assert res["live_graphs"] == [0, 0, 0, 0], (rank, res)


def fresh_groups_job(rank, world):
    """Groups made and destroyed in turn, each with another number of exchanges (the verify runner's
    pattern): every new group's exchanges start from tag 0 and its results are right."""
    import torch.distributed as dist

    from paramfsm.engine.effects.gloo import exchange

    rows = []
    for round_ in range(6):
        group = dist.new_group()
        for i in range(round_ % 3 + 1):
            out = torch.full((world * 3,), float("nan"))
            all_gather_flat(out, torch.full((3,), float(10 * rank + i)), group).wait()
            rows.append(torch.equal(out, torch.tensor([float(10 * r + i) for r in range(world) for _ in range(3)])))
        rows.append(exchange._tags.get(group) == round_ % 3 + 1)
        dist.destroy_process_group(group)
    return rows


def test_a_new_group_never_inherits_a_destroyed_groups_tags(ranks2):
    """Per-group state is keyed by the group, not by id(group): a destroyed group's id is reused by the
    next one differently on each rank, which would misalign the exchanges' tags (a hang, or a process
    aborted on a message of the wrong size)."""
    for rank, rows in enumerate(ranks2.run(fresh_groups_job)):
        assert all(rows), (rank, rows)


def small_units_job(rank, world):
    """A root without parameters over 24 small units: after the first step each pass gathers its one
    bucket with one all-gather, and training matches plain torch."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(24)])
    ref = Reference(model, lambda params: torch.optim.SGD(params, lr=0.1))
    rt = paramfsm.shard(model)
    opt = torch.optim.SGD(rt.shard_parameters(), lr=0.1)
    counts = []
    for step in range(3):
        x, = batch(step, world, 2, (4,))
        opt.zero_grad()
        before = rt.counters["all_gathers"]
        out = model(rank_slice(x, rank, world))
        forward = rt.counters["all_gathers"] - before
        out.pow(2).mean().backward()
        counts.append((forward, rt.counters["all_gathers"] - before - forward))
        ref.optimizer.zero_grad()
        ref.model(x).pow(2).mean().backward()
        assert_close_dicts(sharded_grads(rt, model), ref.grads(), what=f"grads, step {step}")
        opt.step()
        ref.optimizer.step()
    buckets = (len(rt.scheduler.prefetch.fwd_plan.buckets), len(rt.scheduler.prefetch.bwd_plan.buckets))
    rt.close()
    return counts, buckets


def test_a_pass_over_small_units_gathers_once_per_bucket(ranks2):
    counts, buckets = ranks2.run(small_units_job)[0]
    assert buckets == (1, 1), buckets
    assert counts[1:] == [(1, 1), (1, 1)], f"all-gathers per (forward, backward) after the first step: {counts}"
