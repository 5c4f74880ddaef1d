"""The in-process ranks of ``gloo_ranks.py`` themselves: what they patch is put back, and the turn the ranks
take to build their models passes at a collective instead of holding the other ranks up.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import ProcessGroup

import gloo_ranks
from gloo_ranks import on_gloo_ranks, unwrap


def test_a_call_leaves_the_process_groups_methods_and_torchs_seed_as_they_were():
    before = {name: ProcessGroup.__dict__[name] for name in gloo_ranks._COLLECTIVES}
    seed = torch.manual_seed
    unwrap(*on_gloo_ranks(2, lambda rank: dist.all_reduce(torch.ones(1)), turns=True))
    assert {name: ProcessGroup.__dict__[name] for name in gloo_ranks._COLLECTIVES} == before
    assert torch.manual_seed is seed
    # A one-rank group of this process still runs its collectives: the one an earlier test left
    # (``paramfsm.shard(..., group="single")`` keeps its group), else a new one.
    left = dist.is_initialized()
    if not left:
        dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        where = ["here"]
        dist.broadcast_object_list(where, src=0)
        assert where == ["here"]
    finally:
        if not left:
            dist.destroy_process_group()


def test_a_rank_that_seeds_and_then_meets_a_collective_gives_up_its_turn():
    """Each rank seeds, draws a model's worth of numbers, then all-reduces without calling ``paramfsm.shard``:
    the draws are each rank's own sequence, and nobody waits out ``TURN_S`` for the turn."""

    def job(rank):
        torch.manual_seed(0)
        drawn = torch.randn(64)
        total = drawn.clone()
        dist.all_reduce(total)
        return drawn, total

    waited = len(gloo_ranks.WAITED_OUT)
    results = unwrap(*on_gloo_ranks(2, job, turns=True))
    assert gloo_ranks.WAITED_OUT[waited:] == [], "a rank went on without the turn after TURN_S"
    (drawn0, total0), (drawn1, total1) = results
    assert torch.equal(drawn0, drawn1), "the ranks drew from one sequence in turns"
    assert torch.equal(total0, 2 * drawn0) and torch.equal(total1, total0)
