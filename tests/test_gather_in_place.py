"""[Note: a large parameter is gathered in place] (paramfsm.engine.effects.gathers).

A parameter of at least PERSISTENT_BYTES whose size divides by the world is
all-gathered straight into its full tensor; the rest of its bucket (small or
ragged parameters and the rank-order tag) is packed into one more all-gather.
These tests check the results against plain torch for every mix (in place
only, packed only, both, with and without the tag), that the path is really
taken, that one bucket still counts as one gather, and that the rank-order
check still sees the whole bucket.
"""

from __future__ import annotations

import pytest
import torch
from patterns_common import Pair, batch
from torch import nn

from paramfsm.engine.effects import gathers
from paramfsm.errors import RankDesync

BIG = 128  # Linear(128, 128): a 64 KiB weight (in place at world 2), a 512-byte bias (packed)


class Mixed(nn.Module):
    """Units of every kind at world 2: in place and packed (a), in place only (b, no bias), packed only
    (c and d: their 127 x 128 weights are just under PERSISTENT_BYTES)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(BIG, BIG)
        self.b = nn.Linear(BIG, BIG, bias=False)
        self.c = nn.Linear(BIG, 127)
        self.d = nn.Linear(127, BIG)

    def forward(self, x):
        return self.d(torch.tanh(self.c(self.b(torch.tanh(self.a(x))))))


def mixed_job(rank, world, rank_check, steps=3):
    torch.manual_seed(0)
    issued = []
    original = gathers.all_gather_flat

    def counting(out, inp, group, async_op=True):
        issued.append(out.numel())
        return original(out, inp, group, async_op)

    gathers.all_gather_flat = counting
    try:
        pair = Pair(Mixed(), rank, world, bucket_bytes=0)
        executor = pair.rt.executor
        executor.rank_check = rank_check
        buckets = []
        executor.start_gather = lambda records, start=executor.start_gather: (buckets.append(len(records)),
                                                                               start(records))
        counted = wire = 0  # gathered bytes: the runtime's counter, and what its all-gathers received
        for step in range(steps):
            x, = batch(step, world, 2, (BIG,))
            pair.zero_grad()
            before, issued_before = pair.rt.counters["gathered_bytes"], len(issued)
            pair.model(pair.local(x)).pow(2).mean().backward()
            counted += pair.rt.counters["gathered_bytes"] - before
            wire += 4 * sum(issued[issued_before:])
            pair.ref.model(x).pow(2).mean().backward()
            pair.check_grads(f"step {step}")
            pair.step(f"step {step}")
        logical = len(buckets)
        in_place = sum(1 for rec in pair.rt.scheduler.records if pair.rt.executor._in_place(rec, rec.shard.dtype))
        pair.finish()
    finally:
        gathers.all_gather_flat = original
    assert counted == wire > 0, f"counters['gathered_bytes'] counted {counted} bytes, the all-gathers moved {wire}"
    return logical, len(issued), in_place, pair.checks


@pytest.mark.parametrize("rank_check", ["tag", "header", None])
def test_in_place_and_packed_gathers_match_plain_torch(ranks2, rank_check):
    """Three training steps match plain torch (checked in the job). At world 2 the two square weights
    go in place; every unit is still one logical gather, and the collectives issued are those
    gathers plus one per in-place weight, less the units with nothing left to pack (b, untagged)."""
    for logical, issued, in_place, checks in ranks2.run(mixed_job, rank_check):
        assert in_place == 2 and checks == 6
        packed_b = 1 if rank_check == "tag" else 0  # b's packed part is only its tag
        per_pass = 2 + 1 + packed_b + 1 + 1  # a: weight + rest, b, c, d
        assert logical % 4 == 0 and issued == logical // 4 * per_pass, (logical, issued, rank_check)


def test_ragged_sizes_stay_packed(ranks3):
    """At world 3 no weight divides (128 x 128 = 16384 is not a multiple of 3): everything is packed,
    and training still matches plain torch."""
    for logical, issued, in_place, checks in ranks3.run(mixed_job, "tag"):
        assert in_place == 0 and issued == logical and checks == 6


class Twins(nn.Module):
    """Two bias-free units of the same size (nothing but the tag is packed); ``swap`` runs them in the
    other order."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(BIG, BIG, bias=False)
        self.second = nn.Linear(BIG, BIG, bias=False)

    def forward(self, x, order: str):
        return self.first(self.second(x)) if order == "swap" else self.second(self.first(x))


def desync_job(rank, world):
    import paramfsm

    torch.manual_seed(0)
    model = Twins()
    rt = paramfsm.shard(model, bucket_bytes=0, prefetch=0)
    x = torch.randn(2, BIG)
    model(x, "plain").sum().backward()
    try:
        model(x, "swap" if rank == 0 else "plain").sum().backward()
    except RankDesync as exc:
        return exc.rank, exc.unit
    finally:
        rt.close()
    return None, None


def test_rank_order_tag_still_covers_in_place_units(ranks2):
    """Units gathered in place still carry the rank-order tag: ranks running them in different orders
    raise RankDesync instead of training on each other's weights."""
    results = ranks2.run(desync_job, timeout=60)
    assert [rank for rank, _ in results] == [0, 1], results
    assert results[0][1] != results[1][1], results

