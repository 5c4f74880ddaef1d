"""Ranks that run different units raise RankDesync on every rank under the default settings (no ``debug=True``).

Two desyncs that pair collectives of different sizes, which gloo cannot
survive (``Received data size doesn't match``: the process aborts): each
rank's loss reads a different output head, and a unit applied a different
number of times per rank. Each happens at the first step (every batch of
exchanges agrees its header first) and at a later one, once the steps
repeat and their exchanges move without headers (see [Note: a repeating
sequence needs no header] in paramfsm.engine.effects.rankcheck). Each rank catches
its error, so the test asserts both ranks' messages, then checks the ranks
are in step again: the same runtime recovers and closes, a plain all-reduce
works, and a new runtime trains. A program whose data-dependent branch is
the same on every rank, also when it leaves a repeating sequence, still
trains like plain torch with the check on.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

import paramfsm
from paramfsm import RankDesync
from paramfsm.testing import Reference, assert_close_dicts, global_batch, rank_slice, sharded_params
from paramfsm.verify.reproduction import run_saved


@pytest.fixture(scope="module")
def ranks2(in_process2):
    """This file's two ranks are threads of the test process (``gloo_ranks.py``), where ``make mutate`` sees
    them; a test that needs processes of its own asks for ``suite_ranks2``."""
    return in_process2


class Heads(nn.Module):
    """A body and two output heads of different sizes, both run forward."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.a = nn.Linear(16, 4)
        self.b = nn.Linear(16, 12)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        return self.a(h), self.b(h)


class Repeat(nn.Module):
    """A body and a head applied ``times`` times (the head is larger than the body)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.head = nn.Linear(16, 16)

    def forward(self, x, times: int):
        h = self.body(x)
        for _ in range(times):
            h = torch.tanh(self.head(h))
        return h


def _in_step_again(rank, world, rt, model, initial) -> dict:
    """After the error: the runtime resets and closes to the untouched weights, the group all-reduces,
    and a new runtime's gradients equal plain torch's."""
    rt.reset()
    closed = {n: p.detach().clone() for n, p in rt.close().named_parameters()}
    return {"closed_untouched": all(torch.equal(closed[n], initial[n]) for n in initial),
            "all_reduce": _group_and_new_runtime_work(rank, world)}


def _group_and_new_runtime_work(rank, world, clip: float | None = None) -> float:
    """A plain all-reduce (returns its sum), then a new runtime's gradients (clipped to ``clip`` by
    ``rt.clip_grad_norm_``, with the same norm) equal plain torch's."""
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    torch.manual_seed(1)
    fresh = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
    ref = Reference(fresh)
    rt2 = paramfsm.shard(fresh, collective_timeout=30)
    x, = global_batch(world, 2, (4,), seed=3)
    fresh(rank_slice(x, rank, world)).pow(2).mean().backward()
    ref.model(x).pow(2).mean().backward()
    if clip is not None:
        norm = rt2.clip_grad_norm_(clip)
        want = torch.nn.utils.clip_grad_norm_(ref.model.parameters(), clip)
        assert want > clip and torch.allclose(norm, want), (norm, want)  # it clipped, with the same norm
    grads = {n: rt2.full_grad(n) for n, _ in fresh.named_parameters()}
    rt2.close()
    assert_close_dicts(grads, ref.grads(), what="a new runtime after the desync")
    return total.item()


def _caught(exc: RankDesync) -> dict:
    return {"type": type(exc).__name__, "rank": exc.rank, "unit": exc.unit, "message": str(exc)}


def heads_job(rank, world, first=0):
    """From step ``first`` on, rank 1's loss reads head b; before it, every rank's reads head a."""
    torch.manual_seed(0)
    model = Heads()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    rt = paramfsm.shard(model, collective_timeout=30)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    caught = None
    try:
        for step in range(first + 3):
            a, b = model(x)
            (b if rank == 1 and step >= first else a).pow(2).mean().backward()
    except RankDesync as exc:
        caught = _caught(exc)
    return caught, _in_step_again(rank, world, rt, model, initial)


def repeat_job(rank, world, first=0):
    """From step ``first`` on, rank 1 applies the head three times; every other step applies it once."""
    torch.manual_seed(0)
    model = Repeat()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    rt = paramfsm.shard(model, collective_timeout=30)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    caught = None
    try:
        for step in range(first + 3):
            model(x, 3 if rank == 1 and step >= first else 1).pow(2).mean().backward()
    except RankDesync as exc:
        caught = _caught(exc)
    return caught, _in_step_again(rank, world, rt, model, initial)


def _assert_desync_on_every_rank(results, units) -> None:
    for rank, (caught, after) in enumerate(results):
        assert caught is not None, f"rank {rank}: trained on without RankDesync"
        assert caught["type"] == "RankDesync" and caught["rank"] == rank, caught
        message = caught["message"]
        for unit in units:
            assert f"unit '{unit}'" in message, message
        assert "ranks [0, 1]" in message and "rank 0:" in message and "rank 1:" in message, message
        assert "units=[type(model)]" in message, message  # the fix: the model enclosing the branch is one unit
        assert after == {"closed_untouched": True, "all_reduce": 3.0}, after


@pytest.mark.parametrize("first", [0, 6], ids=["first_step", "repeating_steps"])
def test_a_loss_reading_another_head_per_rank_raises_rank_desync_on_every_rank(ranks2, first):
    results = ranks2.run(heads_job, first, timeout=90)
    _assert_desync_on_every_rank(results, ("a", "b"))
    assert [caught["unit"] for caught, _ in results] == ["a", "b"], results


@pytest.mark.parametrize("first", [0, 6], ids=["first_step", "repeating_steps"])
def test_a_unit_applied_a_different_number_of_times_raises_rank_desync_on_every_rank(ranks2, first):
    results = ranks2.run(repeat_job, first, timeout=90)
    _assert_desync_on_every_rank(results, ("head",))
    assert "head" in {caught["unit"] for caught, _ in results}, results


class Stack(nn.Module):
    """Blocks large enough to be gathered in place, a few to a bucket, run to ``depth``."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(256, 256) for _ in range(8))

    def forward(self, x, depth: int):
        for block in self.blocks[:depth]:
            x = torch.tanh(block(x))
        return x


def early_exit_job(rank, world):
    """Rank 1 leaves the stack two blocks early from step 6 on, with gathers prefetched and in flight."""
    torch.manual_seed(0)
    model = Stack()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    rt = paramfsm.shard(model, bucket_bytes=1 << 18, collective_timeout=30)
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(rank))
    caught = None
    try:
        for step in range(9):
            model(x, 6 if rank == 1 and step >= 6 else 8).pow(2).mean().backward()
    except RankDesync as exc:
        caught = _caught(exc)
    return caught, _in_step_again(rank, world, rt, model, initial)


def test_an_early_exit_on_one_rank_in_repeating_steps_raises_rank_desync_on_every_rank(ranks2):
    results = ranks2.run(early_exit_job, timeout=90)
    _assert_desync_on_every_rank(results, ())
    assert all(caught["unit"].startswith("blocks.") for caught, _ in results), results


class Branchy(nn.Module):
    """A body, a unit applied ``times`` times, then one of two heads of different sizes."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.loop = nn.Linear(16, 16)
        self.a = nn.Linear(16, 4)
        self.b = nn.Linear(16, 12)

    def forward(self, x, head: str, times: int):
        h = torch.tanh(self.body(x))
        for _ in range(times):
            h = torch.tanh(self.loop(h))
        return self.a(h) if head == "a" else self.b(h)


#: Branches the batches route to, in turn: a run of repeating steps, then other branches (the same on
#: every rank), back to the first, and a second run that a branch leaves again.
ROUTES = [("a", 1)] * 4 + [("b", 2), ("a", 1), ("a", 1)] + [("b", 3)] * 4 + [("a", 1), ("a", 2)]
BRANCHES = sorted(set(ROUTES))


def branch_job(rank, world):
    torch.manual_seed(0)
    model = Branchy()
    ref = Reference(model, lambda params: torch.optim.SGD(params, lr=0.1))
    rt = paramfsm.shard(model, collective_timeout=30)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    checked = (rt.executor.rank_check, rt.executor.agree_sizes)
    chosen = []
    for step, route in enumerate(ROUTES):
        x, = global_batch(world, 2, (8,), seed=10 + step)
        x[0, 0] = BRANCHES.index(route)  # the batch carries its route, as a data loader may
        # Decided from the global batch, which every rank holds: the same branch on every rank.
        head, times = BRANCHES[int(x[0, 0])]
        chosen.append((head, times))
        opt.zero_grad()
        ref.zero_grad()
        model(rank_slice(x, rank, world), head, times).pow(2).mean().backward()
        ref.model(x, head, times).pow(2).mean().backward()
        opt.step()
        ref.optimizer.step()
        assert_close_dicts(sharded_params(rt, model), ref.params(), atol=1e-6, what=f"step {step}")
    rt.close()
    return checked, chosen


def test_a_branch_taken_alike_on_every_rank_trains_like_plain_torch(ranks2):
    for checked, chosen in ranks2.run(branch_job, timeout=90):
        assert checked == ("tag", True), checked  # the default: tags, and sizes agreed first
        assert chosen == ROUTES, chosen


REPRODUCTIONS = Path(__file__).resolve().parent / "reproductions"


def test_a_rank_that_never_waits_for_a_gather_of_another_unit_raises_rank_desync_too(ranks2):
    """Each rank's loss reads another unit's output and one of the units is kept from its forward: the rank
    whose unit is kept issues the bucket gather its peer waits for, never waits for it, and goes on to a
    reduce-scatter. It reads its copy of that gather's tags before posting the reduce, so it raises
    RankDesync as its peer does, instead of a CollectiveTimeout on one rank (a loop verify drew)."""
    results = ranks2.run(run_saved, str(REPRODUCTIONS / "rank_loss_kept_unit.py"), timeout=240)
    for status, output in results:
        assert status == 0, output
        assert "every rank raised RankDesync" in output, output


def skipped_step_clip_job(rank, world):
    """Rank 1 skips step 2's forward and backward (``continue`` before the forward, but it clips and steps),
    so its gradient-norm all-reduce meets rank 0's first gather of that step. The ranks have issued
    different gathers since, so this runtime cannot close in step; a new one trains."""
    torch.manual_seed(0)
    model = Heads()
    rt = paramfsm.shard(model, collective_timeout=20)
    opt = torch.optim.SGD(rt.shard_parameters(), lr=0.1)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    caught = None
    try:
        for step in range(4):
            if not (rank == 1 and step == 2):
                opt.zero_grad()
                a, _ = model(x)
                a.pow(2).mean().backward()
            rt.clip_grad_norm_(1.0)
            opt.step()
    except paramfsm.ParamFSMError as exc:
        caught = {"type": type(exc).__name__, "message": str(exc)}
    rt.reset()
    return caught, _group_and_new_runtime_work(rank, world, clip=0.1)


def test_a_rank_that_skips_a_step_but_clips_raises_rank_desync_on_every_rank(ranks2):
    results = ranks2.run(skipped_step_clip_job, timeout=120)
    for rank, (caught, total) in enumerate(results):
        assert caught is not None and caught["type"] == "RankDesync", f"rank {rank}: {caught}"
        message = caught["message"]
        assert "ranks [0, 1]" in message and "unit '<all-reduce of the gradient norm>'" in message, message
        assert "unit 'body'" in message, message  # rank 0's side: the first gather of its step
        assert total == 3.0


class SmallAndLargeHead(nn.Module):
    """A body and two heads: ``small`` is gathered in one exchange, ``large``'s weight (64 KiB, gathered in
    place) in one of its own beside the packed rest, two exchanges."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.small = nn.Linear(16, 4)
        self.large = nn.Linear(16, 1024)

    def forward(self, x, head: str):
        return getattr(self, head)(torch.tanh(self.body(x)))


def uneven_exchanges_job(rank, world):
    """Rank 1's forward runs the large head where rank 0's runs the small one, so the refused gathers took
    one exchange tag on rank 0 and two on rank 1 (case 7 of the issue on tests that catch what users hit)."""
    torch.manual_seed(0)
    model = SmallAndLargeHead()
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    rt = paramfsm.shard(model, units=[model.body, model.small, model.large], collective_timeout=20)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))
    caught = None
    try:
        model(x, "large" if rank == 1 else "small").pow(2).mean().backward()
    except RankDesync as exc:
        caught = _caught(exc)
    return caught, _in_step_again(rank, world, rt, model, initial)


def test_after_a_desync_whose_ranks_took_different_numbers_of_exchanges_the_runtime_recovers(ranks2):
    """The ranks' exchange tag counters restart at the same tag after the refusal: ``rt.reset(); rt.close()``
    then gathers in step (not a CollectiveTimeout), and a new runtime trains like plain torch."""
    for rank, (caught, after) in enumerate(ranks2.run(uneven_exchanges_job, timeout=120)):
        assert caught is not None and caught["type"] == "RankDesync", (rank, caught)
        assert "unit 'small'" in caught["message"] and "unit 'large'" in caught["message"], caught
        assert after == {"closed_untouched": True, "all_reduce": 3.0}, (rank, after)
