"""Buffers are freed when they are done with, not when Python's cyclic collector next runs.

An exchange's job and its batch refer to each other, so a job that kept its tensors after its wait held
every finished gather's buffers until a collection ([Note: a finished exchange lets go of its tensors]);
a shard gradient that was a view of the reduce-scatter output kept the whole output alive after it was
paged out to an offload tier. Both are checked with the collector off, by weak references.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from torch._C import DisableTorchFunctionSubclass

import paramfsm
from paramfsm.engine.effects.gloo import exchange
from test_offload import _batch, _model


def exchange_job(rank, world):
    gc.disable()
    try:
        inp = torch.full((1 << 16,), float(rank))
        out = torch.empty(world << 16)
        handle = exchange.exchange_gather(out, inp, dist.group.WORLD, rank, world)
        handle.wait()
        gathered = out.clone()
        sent, received = weakref.ref(inp), weakref.ref(out)
        del inp, out
        return handle.job.ops, handle.job.posted is None, sent() is None, received() is None, gathered
    finally:
        gc.enable()


def test_a_waited_exchange_lets_go_of_its_tensors(ranks2):
    for ops, posted_dropped, sent_freed, received_freed, gathered in ranks2.run(exchange_job):
        assert torch.equal(gathered, torch.cat([torch.zeros(1 << 16), torch.ones(1 << 16)]))
        assert ops == () and posted_dropped
        assert sent_freed and received_freed, "the exchange's tensors outlived it"


def grads_job(rank, world, folder):
    model = _model()
    rt = paramfsm.shard(model, offload=paramfsm.Offload(grads="disk", path=folder))
    model(_batch(0).chunk(world)[rank]).pow(2).mean().backward()
    with DisableTorchFunctionSubclass():
        views = [rec.name for rec in rt._by_id.values() if rec.shard.grad._is_view()]
    rt.close()
    return views


def test_an_offloaded_shard_gradient_is_not_a_view_of_the_reduce_output(ranks2, tmp_path):
    for views in ranks2.run(grads_job, str(tmp_path)):
        assert views == [], f"paged-out gradients that still hold their reduce-scatter output: {views}"
