"""A model holding an un-run lazy module is refused at ``shard()`` with a paramfsm error, and nothing changes.

Sharding a model with a ``LazyLinear`` that has not run raised torch's "Attempted to use an uninitialized
parameter" from inside paramfsm. Now ``shard()`` names the parameter, its module and the fix before it
touches anything; after one forward the same model shards and trains like plain torch.
"""

from __future__ import annotations

import torch
from patterns_common import Pair, batch
from torch import nn

import paramfsm

def lazy_job(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(6), nn.Tanh(), nn.Linear(6, 2))
    try:
        paramfsm.shard(model, min_unit_bytes=0)
        message = None
    except paramfsm.ParamFSMError as exc:
        message = str(exc)
    still_lazy = isinstance(model[0].weight, nn.parameter.UninitializedParameter)
    (x,) = batch(0, world, 2, (5,))
    model(x)  # the fix: one forward first (the same global batch on every rank)
    pair = Pair(model, rank, world, min_unit_bytes=0)
    for step in range(2):
        (x,) = batch(step + 1, world, 2, (5,))
        pair.zero_grad()
        pair.model(pair.local(x)).pow(2).mean().backward()
        pair.ref.model(x).pow(2).mean().backward()
        pair.check_grads(f"step {step}")
        pair.step(f"step {step}")
    return message, still_lazy, pair.finish()

def test_an_unrun_lazy_module_is_refused_by_name_and_shards_after_a_forward(ranks2):
    for message, still_lazy, report in ranks2.run(lazy_job):
        assert message is not None, "shard() accepted an uninitialised lazy parameter"
        for fact in ("parameter '0.weight'", "module '0'", "LazyLinear", "run one forward"):
            assert fact in message, (fact, message)
        assert still_lazy  # nothing changed before the refusal
        assert report["checks"] == 4
