"""The gloo transport's exchanges (:mod:`paramfsm.engine.effects.gloo.exchange`) on real gloo ranks in process.

Every gather and reduce of a CPU run at world 2 to 8 goes through these exchanges, so the training tests
reach them; here each is checked on its own against what a collective returns: every rank's shard in its
slot, each half summed on its owner, exchanges in flight together or coalesced keeping their own messages,
a repeating step followed without headers, and a rank whose exchange differs refused on every rank with
nothing moved, after which the ranks go on. The ranks are threads of the test process (``gloo_ranks.py``).
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from gloo_ranks import on_gloo_ranks, unwrap
from paramfsm.engine.effects.gloo import exchange
from paramfsm.engine.effects.gloo.agreement import Dropped, Refused

LIMIT = timedelta(seconds=20)
#: Two units' shards (float32 elements), each long enough to carry a run's marker (agreement.MARK bytes).
SIZES = (40, 70)


def _shard(rank: int, size: int, salt: int = 0) -> torch.Tensor:
    return torch.arange(size, dtype=torch.float32) + 100 * rank + 1000 * salt


def _gather(rank: int, world: int, size: int, salt: int = 0, fields=None):
    out = torch.full((world * size,), -1.0)
    with exchange.coalesced(fields):
        handle = exchange.exchange_gather(out, _shard(rank, size, salt), None, rank, world)
    return out, handle


def _expected(world: int, size: int, salt: int = 0) -> torch.Tensor:
    return torch.cat([_shard(r, size, salt) for r in range(world)])


@pytest.mark.parametrize("world", [2, 3, 4])
def test_an_exchanged_gather_puts_every_rank_s_shard_in_its_slot(world):
    def job(rank):
        out, handle = _gather(rank, world, 5)
        assert handle.wait(LIMIT) is True
        assert handle.is_completed()
        return out

    for out in unwrap(*on_gloo_ranks(world, job)):
        assert torch.equal(out, _expected(world, 5))


def test_an_exchanged_reduce_sums_each_half_on_its_owner():
    def job(rank):
        inp = torch.arange(8, dtype=torch.float32) * (rank + 1)
        out = torch.full((4,), -1.0)
        handle = exchange.exchange_reduce(out, inp, None, rank)
        handle.wait(LIMIT)
        return out

    total = torch.arange(8, dtype=torch.float32) * 3
    outs = unwrap(*on_gloo_ranks(2, job))
    assert torch.equal(outs[0], total[:4]) and torch.equal(outs[1], total[4:])


def test_exchanges_in_flight_together_keep_their_own_messages():
    """Three gathers of the same size posted before any is waited for, waited for in reverse order."""
    def job(rank):
        made = [_gather(rank, 2, 6, salt) for salt in range(3)]
        for _, handle in reversed(made):
            handle.wait(LIMIT)
        return [out for out, _ in made]

    for outs in unwrap(*on_gloo_ranks(2, job)):
        for salt, out in enumerate(outs):
            assert torch.equal(out, _expected(2, 6, salt)), salt


def test_coalesced_exchanges_are_one_submission_with_their_own_handles():
    def job(rank):
        outs, handles = [], []
        with exchange.coalesced((7, 0, 1, 12)):
            for salt, size in enumerate((3, 9)):
                out = torch.full((2 * size,), -1.0)
                outs.append(out)
                handles.append(exchange.exchange_gather(out, _shard(rank, size, salt), None, rank, 2))
            reduced = torch.full((2,), -1.0)
            handles.append(exchange.exchange_reduce(reduced, torch.ones(4) * (rank + 1), None, rank))
            assert not any(handle.issued.done() for handle in handles)  # nothing is posted inside the block
        for handle in handles:
            handle.wait(LIMIT)
        return outs, reduced

    for outs, reduced in unwrap(*on_gloo_ranks(2, job)):
        assert torch.equal(outs[0], _expected(2, 3, 0)) and torch.equal(outs[1], _expected(2, 9, 1))
        assert torch.equal(reduced, torch.full((2,), 3.0))


def test_a_repeating_step_is_followed_and_still_moves_the_right_values():
    """The same cycle of exchanges, step after step: once announced, its batches move without headers, and
    every value still lands where it belongs."""
    def job(rank):
        modes, results = [], []
        for step in range(6):
            for unit, size in enumerate(SIZES):
                out, handle = _gather(rank, 2, size, step, (unit, step, unit, size))
                modes.append(handle.job.batch.mode)
                handle.wait(LIMIT)
                results.append(bool(torch.equal(out, _expected(2, size, step))))
        return modes, results

    for modes, results in unwrap(*on_gloo_ranks(2, job)):
        assert all(results)
        assert modes[:4] == ["header"] * 4
        assert "follow" in modes[4:], modes


def test_a_rank_whose_exchange_differs_is_refused_on_every_rank_and_the_next_exchange_moves():
    def job(rank):
        size = 4 if rank == 0 else 5
        out, handle = _gather(rank, 2, size)
        untouched = out.clone()
        try:
            handle.wait(LIMIT)
        except Refused as refused:
            first = refused
        else:
            first = None
        again, handle = _gather(rank, 2, 3, salt=1)
        handle.wait(LIMIT)
        return first, bool(torch.equal(out, untouched)), again

    for rank, (refused, unmoved, again) in enumerate(unwrap(*on_gloo_ranks(2, job))):
        assert refused is not None, f"rank {rank} was not refused"
        assert refused.rows.tolist()[0] != refused.rows.tolist()[1]
        assert "exchanges differ" in str(refused)
        assert unmoved, "a refused gather moved values"
        assert torch.equal(again, _expected(2, 3, 1))


def test_a_desync_inside_a_followed_run_is_refused_on_every_rank():
    """A rank leaves a repeating cycle (another size where the run predicts the usual one): the stand-in of
    its batch meets the others' marks, and both ranks refuse it instead of moving mismatched bytes."""
    def job(rank):
        seen = []
        for step in range(6):
            for unit, usual in enumerate(SIZES):
                size = usual + 1 if (step, unit, rank) == (5, 1, 1) else usual
                out, handle = _gather(rank, 2, size, step, (unit, step, unit, usual))
                mode = handle.job.batch.mode
                try:
                    handle.wait(LIMIT)
                    seen.append((mode, "moved"))
                except (Refused, Dropped) as exc:
                    seen.append((mode, type(exc).__name__))
        return seen

    for rank, seen in enumerate(unwrap(*on_gloo_ranks(2, job))):
        assert all(outcome == "moved" for _, outcome in seen[:-1]), (rank, seen)
        assert seen[-1] == ("deviate" if rank == 1 else "follow", "Refused"), (rank, seen)


def test_without_size_agreement_a_batch_sends_no_header():
    def job(rank):
        exchange.agree_sizes(None, False)
        group = dist.group.WORLD
        try:
            out, handle = _gather(rank, 2, 4)
            batch = handle.job.batch
            handle.wait(LIMIT)
        finally:
            exchange.agree_sizes(group, True)
        return batch, out

    for batch, out in unwrap(*on_gloo_ranks(2, job)):
        assert batch is None  # posted as it is: no header, no place in a sequence
        assert torch.equal(out, _expected(2, 4))


def test_gloo_exchanges_its_gathers_from_two_to_eight_ranks():
    assert [exchange.usable(world) for world in (1, 2, 8, 9)] == [False, True, True, False]
