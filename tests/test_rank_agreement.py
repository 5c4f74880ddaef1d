"""Same model on every rank (2 gloo ranks): ``shard()`` refuses different models on every rank, warns
when the values differ, and ``sync_module_states=True`` starts every rank from rank 0's values
(compared with plain torch built from rank 0's model)."""

from __future__ import annotations

import os
import warnings

import torch
from patterns_common import Pair, batch
from torch import nn

import paramfsm
from paramfsm import ModelMismatch
from paramfsm.sharding.rank_agreement import RanksDiffer


def stack(depth: int, width: int = 8) -> nn.Sequential:
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(depth)))


def _shard_error(model, **kwargs) -> str:
    try:
        rt = paramfsm.shard(model, **kwargs)
    except ModelMismatch as exc:
        return str(exc)
    rt.close()
    return "no error"


def agreement_job(rank, world):
    torch.manual_seed(0)
    out = {"depth": _shard_error(stack(3 if rank == 0 else 4)),
           "width": _shard_error(nn.Sequential(nn.Linear(8, 8 if rank == 0 else 6))),
           "synced_depth": _shard_error(stack(3 if rank == 0 else 4), sync_module_states=True)}
    torch.manual_seed(rank)  # seeded by rank: the same model, different values
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        paramfsm.shard(stack(2)).close()
    out["differ"] = [str(w.message) for w in caught if issubclass(w.category, RanksDiffer)]
    out["differ_at"] = [os.path.basename(w.filename) for w in caught if issubclass(w.category, RanksDiffer)]
    torch.manual_seed(0)
    reference = stack(2)  # rank 0's model, on every rank
    torch.manual_seed(rank)
    model = stack(2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pair = Pair(model, rank, world, sync_module_states=True)
    out["synced_warnings"] = [str(w.message) for w in caught if issubclass(w.category, RanksDiffer)]
    pair.ref.model.load_state_dict(reference.state_dict())
    pair.ref.optimizer = torch.optim.SGD(pair.ref.model.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        (x,) = batch(step, world, 2, (8,))
        pair.zero_grad()
        pair.model(pair.local(x)).pow(2).mean().backward()
        pair.ref.model(x).pow(2).mean().backward()
        pair.check_grads(f"step {step}")
        pair.step(f"step {step}")
    out["report"] = pair.finish()
    # A meta model with sync_module_states=True: nothing to broadcast yet (meta tensors have no values);
    # rt.init_weights() then gives every rank the same values, rank 0's plain init.
    torch.manual_seed(0)
    plain = stack(2)
    with torch.device("meta"):
        meta = stack(2)
    rt = paramfsm.shard(meta, sync_module_states=True)
    torch.manual_seed(0)
    rt.init_weights()
    out["meta_synced"] = all(torch.equal(rt.full_param(name), p) for name, p in plain.named_parameters())
    rt.close()
    return out


def test_ranks_must_hold_the_same_model(ranks2):
    for rank, out in enumerate(ranks2.run(agreement_job)):
        other = 1 - rank
        assert f"rank {rank} and rank {other} hold different models" in out["depth"], out["depth"]
        assert "'3.weight'" in out["depth"] and "exists only" in out["depth"], out["depth"]
        assert "parameter '0.weight' has shape" in out["width"], out["width"]
        # sync_module_states=True checks the structures before it broadcasts (else the ranks block).
        assert f"rank {rank} and rank {other} hold different models" in out["synced_depth"], out["synced_depth"]
        assert len(out["differ"]) == 1 and "sync_module_states=True" in out["differ"][0], out["differ"]
        assert "torch.manual_seed" in out["differ"][0]
        assert out["differ_at"] == ["test_rank_agreement.py"], out["differ_at"]  # the line that called shard
        assert out["synced_warnings"] == [], out["synced_warnings"]
        assert out["report"]["checks"] == 4
        assert out["meta_synced"] is True
