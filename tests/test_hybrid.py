"""Hybrid sharding on a 2 x 2 ``(replicate, shard)`` DeviceMesh of 4 gloo ranks, against plain torch.

Each of the 4 ranks trains on its quarter of every global batch; parameters
are sharded over 2 ranks and replicated twice. Checked against one plain
model on the global batch: the two-loss retained-graph loop, accumulation,
clipping, and a DCP checkpoint saved on 2 x 2 and loaded on 1 x 2 and 4 x 1.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from patterns_common import Pair, batch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.device_mesh import init_device_mesh

import paramfsm
from paramfsm import State
from paramfsm.testing.models import TinyTransformer

# A pool of 4 ranks on two cores costs about 10 s to start; no test of make test needs one.
pytestmark = pytest.mark.slow

VOCAB, SEQ = 29, 6  # odd sizes: shards are padded


def _model():
    torch.manual_seed(0)
    return TinyTransformer(vocab=VOCAB, dim=12, depth=2, seq=SEQ, tied=True)


def _tokens(step: int, world: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (world * 2, SEQ), generator=torch.Generator().manual_seed(step))


def hybrid_job(rank, world, shape, retain, save_to=None):
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    pair = Pair(_model(), rank, world, retain=retain, mesh=mesh)
    model, ref = pair.model, pair.ref.model
    assert pair.rt.world == shape[1] and pair.rt.replicas == shape[0]
    for step in range(3):
        tokens, = [_tokens(step, world)]
        pair.zero_grad()
        out, ref_out = model(pair.local(tokens)), ref(tokens)
        (y,) = batch(step, world, 2, (SEQ, VOCAB))
        l1 = torch.nn.functional.mse_loss(out, pair.local(y))
        l2 = out.pow(2).mean()
        l1.backward(retain_graph=True)
        torch.nn.functional.mse_loss(ref_out, y).backward(retain_graph=True)
        pair.assert_states(State.DEFERRED_RELEASE, State.NOT_AVAILABLE, what="after the retained backward")
        pair.check_grads(f"step {step} first loss")
        l2.backward()
        ref_out.pow(2).mean().backward()
        pair.assert_states(State.NOT_AVAILABLE, what="after the final backward")
        pair.check_grads(f"step {step} both losses")
        for micro in range(2):  # accumulation: two more micro-batches on top
            tokens = _tokens(100 + 10 * step + micro, world)
            (model(pair.local(tokens)).pow(2).mean() / 2).backward()
            (ref(tokens).pow(2).mean() / 2).backward()
        pair.check_grads(f"step {step} accumulated")
        norm = pair.rt.clip_grad_norm_(0.5)
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        assert torch.allclose(norm, want, rtol=1e-5), (norm, want)
        pair.step(f"step {step}")
    written = None
    if save_to is not None:
        written = _chunks_written(lambda: paramfsm.checkpoint.save(pair.rt, save_to))
    params = {n: pair.rt.full_param(n) for n, _ in model.named_parameters()}
    on_rank0 = pair.rt.full_state_dict(rank0_only=True)
    assert bool(on_rank0) == (rank == 0), "rank0_only keeps the full tensors on global rank 0 alone"
    report = pair.finish()
    return params, report["counters"], sorted({(r.rank, r.coord) for r in pair.rt.trace.records}), written


def _chunks_written(save) -> list[tuple[int, str, tuple[int, ...]]]:
    """Run ``save`` and return what every rank wrote to the checkpoint: (rank, key, chunk offset) per item
    (collective). Counted where DCP's file writer reports each item it wrote."""
    mine = []
    original = FileSystemWriter.write_data

    def counting(self, plan, planner):
        future = original(self, plan, planner)
        mine.extend((dist.get_rank(), r.index.fqn, tuple(r.index.offset or ())) for r in future.wait())
        return future

    FileSystemWriter.write_data = counting
    try:
        save()
    finally:
        FileSystemWriter.write_data = original
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return [item for items in everyone for item in items]


def load_job(rank, world, shape, path):
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    model = _model()
    rt = paramfsm.shard(model, mesh=mesh)
    paramfsm.checkpoint.load(rt, path)
    params = {n: rt.full_param(n) for n, _ in model.named_parameters()}
    rt.close()
    return params


@pytest.fixture(scope="module")
def trained_2x2(ranks4, tmp_path_factory):
    """The defer run on 2 x 2, its checkpoint and final parameters."""
    path = tmp_path_factory.mktemp("hybrid") / "ckpt"
    return path, ranks4.run(hybrid_job, (2, 2), "defer", str(path))


@pytest.mark.parametrize("retain", ["defer", "regather"])
def test_hybrid_2x2_matches_plain_torch(ranks4, trained_2x2, retain):
    results = trained_2x2[1] if retain == "defer" else ranks4.run(hybrid_job, (2, 2), retain)
    for rank, (params, counters, trace_ranks, _) in enumerate(results):
        assert trace_ranks == [(rank, divmod(rank, 2))], "records carry the global rank and (replica, shard)"
        assert counters["reduce_scatters"] > 0
        for name, value in params.items():
            assert torch.equal(value, results[0][0][name]), f"replica of rank {rank} differs on {name}"


def test_a_2x2_checkpoint_loads_on_4x1_and_1x2(ranks4, ranks2, trained_2x2):
    path, results = trained_2x2
    saved = results[0][0]
    for pool, shape in ((ranks4, (4, 1)), (ranks2, (1, 2))):
        for got in pool.run(load_job, shape, str(path)):
            for name, value in saved.items():
                assert torch.equal(got[name], value), f"{shape}: {name}"


def test_a_2x2_checkpoint_writes_each_shard_once(trained_2x2):
    """Two replicas hold the same shards: one copy of each goes to the checkpoint, not one per replica
    (twice the write traffic, and two ranks writing one file on a shared file system)."""
    written = trained_2x2[1][0][3]
    chunks = [(key, offset) for _, key, offset in written]
    twice = sorted({chunk for chunk in chunks if chunks.count(chunk) > 1})
    assert not twice, f"written by more than one rank: {twice[:5]}"
    keys = {key for key, _ in chunks}
    assert "blocks.0.qkv.weight" in keys and "head.weight" in keys, sorted(keys)
    shards = {(key, offset) for key, offset in chunks if key == "blocks.0.qkv.weight"}
    assert len(shards) == 2, f"the shard dimension has 2 ranks, so 2 chunks per parameter: {shards}"
