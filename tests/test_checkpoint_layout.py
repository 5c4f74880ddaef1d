"""The standard checkpoint layout: paramfsm's checkpoints are ordinary DCP checkpoints of the model's shapes.

At world 2, with parameters whose shards end mid-row (a ``(3, 5)`` weight is
split at element 8, a conv weight inside its third dimension):
- plain ``dcp.load`` into an unsharded model's ``state_dict()`` and
  ``dcp_to_torch_save`` give ``rt.full_state_dict()``, optimizer state with
  its parameter's shape;
- an FSDP2 ``fully_shard`` model loads a paramfsm checkpoint, and paramfsm
  loads FSDP2's;
- a checkpoint in the flat ``(numel,)`` layout of earlier saves still loads.
"""

from __future__ import annotations

import math
from pathlib import Path

import hypothesis.strategies as st
import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from torch import nn

import paramfsm
import paramfsm.checkpoint as ck
from paramfsm.checkpoint.layout import ShardPieces, boxes
from paramfsm.errors import ParamFSMError


@pytest.fixture(scope="module")
def ranks2(in_process2):
    """This file's two ranks are threads of the test process (``gloo_ranks.py``), where ``make mutate`` sees
    them; a test that needs processes of its own asks for ``suite_ranks2``."""
    return in_process2


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 5), max_size=4), st.data())
def test_boxes_cover_a_flat_range_exactly_each_a_contiguous_block(shape, data):
    n = math.prod(shape)
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    found = boxes(tuple(shape), start, stop)
    full = torch.arange(n).view(shape) if shape else torch.tensor(0)
    covered = []
    for offsets, sizes in found:
        assert math.prod(sizes) > 0, f"an empty box {offsets, sizes}"
        block = full[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))] if shape else full
        assert block.is_contiguous() or block.numel() == 0
        covered += block.reshape(-1).tolist()
    assert covered == list(range(start, stop))
    assert len(found) <= max(1, 2 * len(shape) - 1)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 5, 3)     # (5, 3, 3, 3): 135 elements, split at 68, inside the last dimension
        self.proj = nn.Linear(5, 3)        # (3, 5): split at 8, mid-row
        self.norm = nn.LayerNorm(3)
        self.register_buffer("shift", torch.arange(3.0))

    def forward(self, x):
        return self.norm(self.proj(self.conv(x).mean(dim=(2, 3))) + self.shift)


def _net(seed=0) -> Net:
    torch.manual_seed(seed)
    return Net()


def _train(rt, model, opt, rank, steps=2):
    for step in range(steps):
        x = torch.randn(2, 3, 6, 6, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def _full_optim(rt, opt) -> dict:
    """Each shard-shaped optimizer entry as a full tensor of its parameter's shape (collective)."""
    flat = ck.sharded_optim_state_dict(rt, opt, layout="flat")
    shapes = {rec.name: rec.shape for rec in rt._by_id.values()}
    out = {}
    for key, value in flat.items():
        if isinstance(value, torch.distributed.tensor.DTensor):
            name = key[len(ck.OPTIM_PREFIX):].rsplit(".", 1)[0]
            out[key] = value.full_tensor().view(shapes[name])
    assert len(out) == 2 * len(shapes), sorted(out)  # AdamW's two moments of every parameter
    return out


def _equal(a: dict, b: dict) -> list[str]:
    assert b, "nothing to compare"
    return [k for k in b if k not in a or a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]


def _full(state_dict: dict) -> dict:
    """An FSDP2 state dict with every DTensor gathered (collective)."""
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in state_dict.items()}


def plain_reads_job(rank, world, folder):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    folder = Path(folder)
    model = _net()
    rt = paramfsm.shard(model)
    opt = torch.optim.AdamW(rt.shard_parameters(), lr=1e-2)
    _train(rt, model, opt, rank)
    ck.save(rt, folder / "ck", optimizer=opt)
    full, optim_full = rt.full_state_dict(), _full_optim(rt, opt)
    pieces = {k: len(v.pieces) for k, v in rt.sharded_state_dict(layout="model").items()
              if isinstance(v, ShardPieces)}
    out = {"pieces": pieces}
    if rank == 0:
        plain = _net(seed=5)
        sd = plain.state_dict()
        dcp.load(sd, checkpoint_id=str(folder / "ck"), no_dist=True)
        out["plain"] = _equal(sd, full)
        dcp_to_torch_save(str(folder / "ck"), str(folder / "ck.pt"))
        converted = torch.load(folder / "ck.pt", weights_only=False)
        out["torch_save"] = _equal(converted, full)
        out["torch_save optim"] = _equal(converted, optim_full)
    dist.barrier()
    return out


def test_a_checkpoint_loads_into_a_plain_model_and_converts_to_a_torch_save(ranks2, tmp_path):
    results = ranks2.run(plain_reads_job, str(tmp_path))
    assert results[0]["plain"] == [] and results[0]["torch_save"] == []
    assert results[0]["torch_save optim"] == []
    # the shards end mid-row: rank 0's proj.weight is one whole row and a partial one, rank 1's the rest
    assert results[0]["pieces"]["proj.weight"] == 2 and results[1]["pieces"]["proj.weight"] == 2
    assert results[0]["pieces"]["conv.weight"] == 4  # whole filters, a whole channel, a row, part of a row


def _fsdp2(model):
    from torch.distributed.fsdp import fully_shard

    fully_shard(model.conv)
    fully_shard(model.proj)
    fully_shard(model)
    return model


def fsdp2_job(rank, world, folder):
    folder = Path(folder)
    model = _net()
    rt = paramfsm.shard(model)
    opt = torch.optim.SGD(rt.shard_parameters(), lr=0.1)
    _train(rt, model, opt, rank)
    ck.save(rt, folder / "ours")
    want = rt.full_state_dict()
    fsdp = _fsdp2(_net(seed=7))
    sd = fsdp.state_dict()
    dcp.load(sd, checkpoint_id=str(folder / "ours"))
    out = {"fsdp2 reads ours": _equal(_full(fsdp.state_dict()), want)}
    # FSDP2's own checkpoint (row chunks, no paramfsm manifest), read by paramfsm
    trained = _fsdp2(_net(seed=3))
    fsdp_opt = torch.optim.SGD(trained.parameters(), lr=0.1)
    _train(None, trained, fsdp_opt, rank)
    dcp.save(trained.state_dict(), checkpoint_id=str(folder / "theirs"))
    theirs = _full(trained.state_dict())
    ck.load(rt, folder / "theirs")
    out["ours reads fsdp2"] = _equal(rt.full_state_dict(), theirs)
    return out


def test_fsdp2_loads_a_paramfsm_checkpoint_and_paramfsm_loads_fsdp2s(ranks2, tmp_path):
    for result in ranks2.run(fsdp2_job, str(tmp_path)):
        assert result == {"fsdp2 reads ours": [], "ours reads fsdp2": []}


def legacy_job(rank, world, folder):
    """A checkpoint of the flat layout: paramfsm's earlier saves wrote every parameter as ``(numel,)``."""
    folder = Path(folder)
    model = _net()
    rt = paramfsm.shard(model)
    opt = torch.optim.AdamW(rt.shard_parameters(), lr=1e-2)
    _train(rt, model, opt, rank)
    old = rt.sharded_state_dict(layout="flat")  # as checkpoints were written before the model layout
    old.update(ck.sharded_optim_state_dict(rt, opt, layout="flat"))
    dcp.save(old, checkpoint_id=str(folder / "old"))
    saved = dcp.FileSystemReader(str(folder / "old")).read_metadata().state_dict_metadata
    assert tuple(saved["proj.weight"].size) == (15,) and tuple(saved["optim.proj.weight.exp_avg"].size) == (15,)
    want, want_optim = rt.full_state_dict(), _full_optim(rt, opt)
    other = _net(seed=9)
    rt_other = paramfsm.shard(other)
    opt_other = torch.optim.AdamW(rt_other.shard_parameters(), lr=1e-2)
    ck.load(rt_other, folder / "old", optimizer=opt_other)
    return {"model": _equal(rt_other.full_state_dict(), want), "optim": _equal(_full_optim(rt_other, opt_other),
                                                                                 want_optim)}


def test_a_checkpoint_in_the_earlier_flat_layout_still_loads(ranks2, tmp_path):
    for result in ranks2.run(legacy_job, str(tmp_path)):
        assert result == {"model": [], "optim": []}


def pieces_job(rank, world):
    rt = paramfsm.shard(_net())
    sd = rt.sharded_state_dict(layout="model")
    copy = sd["proj.weight"].clone()
    out = {"clone": isinstance(copy, ShardPieces) and copy.flat.data_ptr() != sd["proj.weight"].flat.data_ptr()
           and torch.equal(copy.flat, sd["proj.weight"].flat)}
    for what, fn in (("add", lambda: sd["proj.weight"] + 1), ("layout", lambda: rt.sharded_state_dict(layout="rows"))):
        try:
            fn()
            out[what] = None
        except ParamFSMError as exc:
            out[what] = str(exc)
    rt.close()
    return out


def test_model_pieces_refuse_tensor_operations_naming_the_parameter(ranks2):
    for result in ranks2.run(pieces_job):
        assert result["clone"]
        assert result["add"].startswith("'proj.weight': a sharded state dict's value holds only this rank's pieces")
        assert "layout='rows'" in result["layout"]
