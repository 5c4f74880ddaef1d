"""A rank's shard as model-shaped pieces (:mod:`paramfsm.checkpoint.layout`), in the test process: what
``model_shaped`` hands DCP for each rank of a padded shard, what ``write_shard`` accepts back, and what
:class:`~paramfsm.checkpoint.layout.ShardPieces` lets through. ``tests/test_checkpoint_layout.py`` saves and
loads these through DCP, FSDP2 and plain models on two ranks.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from paramfsm.checkpoint.layout import ShardPieces, model_shaped, valid_range, write_shard
from paramfsm.errors import ParamFSMError

SHAPE = (3, 5)  # 15 elements on 2 ranks: shards of 8, rank 1's padded by one


def _rec(shape=SHAPE, world=2, name="proj.weight"):
    numel = 1
    for n in shape:
        numel *= n
    return SimpleNamespace(name=name, shape=torch.Size(shape), numel=numel, shard_numel=-(-numel // world))


def _shard(rank: int, rec=None) -> torch.Tensor:
    """Rank ``rank``'s padded shard of ``arange(numel)`` (padding: -1)."""
    rec = rec or _rec()
    full = torch.cat([torch.arange(float(rec.numel)), torch.full((2 * rec.shard_numel - rec.numel,), -1.0)])
    return full[rank * rec.shard_numel:(rank + 1) * rec.shard_numel].clone()


def test_each_ranks_valid_range_leaves_the_padding_out():
    rec = _rec()
    assert [valid_range(SimpleNamespace(rank=r), rec) for r in range(2)] == [(0, 8), (8, 15)]
    tiny = _rec((5,), world=4)  # shards of 2: the fourth rank's begins past the end and holds only padding
    assert [valid_range(SimpleNamespace(rank=r), tiny) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]


@pytest.mark.parametrize("rank, offsets, sizes", [(0, [(0, 0), (1, 0)], [(1, 5), (1, 3)]),
                                                  (1, [(1, 3), (2, 0)], [(1, 2), (1, 5)])])
def test_a_shard_becomes_views_of_its_boxes_in_the_models_shape(rank, offsets, sizes):
    rec, shard = _rec(), _shard(rank)
    pieces = model_shaped(SimpleNamespace(rank=rank), rec, shard)
    assert isinstance(pieces, ShardPieces) and pieces.shape == SHAPE and pieces.key == "proj.weight"
    assert [o for o, _ in pieces.pieces] == offsets and [tuple(v.shape) for _, v in pieces.pieces] == sizes
    full = torch.arange(15.0).view(SHAPE)
    for (row, col), view in pieces.pieces:
        assert torch.equal(view, full[row:row + view.shape[0], col:col + view.shape[1]])
        assert view.data_ptr() >= shard.data_ptr(), "each box is a view of the shard, not a copy"
    assert pieces.flat.numel() == 8 if rank == 0 else pieces.flat.numel() == 7
    chunks = pieces.__create_chunk_list__()
    assert [tuple(c.offsets) for c in chunks] == offsets and [tuple(c.sizes) for c in chunks] == sizes
    items = pieces.__create_write_items__("proj.weight", pieces)
    assert [tuple(i.index.offset) for i in items] == offsets and all(i.index.fqn == "proj.weight" for i in items)
    assert all(tuple(i.tensor_data.size) == SHAPE for i in items)
    index = SimpleNamespace(offset=torch.Size(offsets[1]))
    assert pieces.__get_tensor_shard__(index) is pieces.pieces[1][1]
    with pytest.raises(ParamFSMError, match=r"'proj.weight': this rank holds no piece at offset \(2, 4\)"):
        pieces.__get_tensor_shard__(SimpleNamespace(offset=torch.Size((2, 4))))
    assert repr(pieces) == (f"ShardPieces('proj.weight', shape={SHAPE}, dtype=torch.float32, pieces=2, "
                            f"numel_here={8 if rank == 0 else 7})")


def test_a_parameter_of_no_elements_is_a_plain_empty_tensor():
    rec = _rec((0, 4))
    got = model_shaped(SimpleNamespace(rank=1), rec, torch.empty(0, dtype=torch.float64))
    assert type(got) is torch.Tensor and got.shape == (0, 4) and got.dtype == torch.float64


def test_pieces_clone_detach_and_copy_between_the_same_boxes_and_nothing_else():
    rt = SimpleNamespace(rank=1)
    pieces = model_shaped(rt, _rec(), _shard(1))
    cloned, detached = pieces.clone(), pieces.detach()
    assert isinstance(cloned, ShardPieces) and cloned.flat.data_ptr() != pieces.flat.data_ptr()
    assert torch.equal(cloned.flat, pieces.flat) and [o for o, _ in cloned.pieces] == [o for o, _ in pieces.pieces]
    assert detached.flat.data_ptr() == pieces.flat.data_ptr()
    target = model_shaped(rt, _rec(), torch.zeros(8))
    target.copy_(pieces)
    assert torch.equal(target.flat, pieces.flat)
    again = model_shaped(rt, _rec(), torch.zeros(8))
    again.copy_(pieces, True)  # non_blocking, passed by position
    assert torch.equal(again.flat, pieces.flat)
    other = model_shaped(SimpleNamespace(rank=0), _rec(), torch.zeros(8))
    for bad in (lambda: other.copy_(pieces), lambda: pieces + 1, lambda: pieces.copy_(torch.zeros(SHAPE))):
        with pytest.raises(ParamFSMError) as info:
            bad()
        assert str(info.value).startswith(
            "'proj.weight': a sharded state dict's value holds only this rank's pieces and supports only clone, "
            "detach and copy_ between the same pieces (not aten.")
        assert str(info.value).endswith("What to do: save or load it with torch.distributed.checkpoint, or use "
                                        "rt.full_state_dict() for full tensors")
    staged = pieces.with_flat(torch.full((7,), 9.0))
    assert staged.key == "proj.weight" and [o for o, _ in staged.pieces] == [o for o, _ in pieces.pieces]
    assert all(bool((view == 9.0).all()) for _, view in staged.pieces)


@pytest.mark.parametrize("source", ["pieces", "full", "local"])  # a flat DTensor: test_checkpoint_layout.py
def test_a_shard_is_written_from_every_accepted_form_and_its_padding_is_left(source):
    rt, rec = SimpleNamespace(rank=1), _rec()
    values = torch.arange(15.0) + 100
    if source == "pieces":
        src = model_shaped(rt, rec, values[8:].clone())
    elif source == "full":
        src = values.view(SHAPE)
    else:
        src = values[8:].clone()
    target = torch.full((8,), -1.0)
    write_shard(rt, rec, target, src, "proj.weight")
    assert torch.equal(target, torch.cat([values[8:], torch.tensor([-1.0])]))


def test_a_shard_of_another_rank_or_shape_is_refused_by_name():
    rt, rec = SimpleNamespace(rank=1), _rec()
    with pytest.raises(ParamFSMError) as info:
        write_shard(rt, rec, torch.zeros(8), torch.zeros(8), "proj.weight")
    assert str(info.value) == ("'proj.weight': expected this rank's pieces of shape (3, 5) (from "
                               "rt.sharded_state_dict()) or a full tensor of that shape, got Tensor (8,)")
    with pytest.raises(ParamFSMError, match=r"got list \(\)"):
        write_shard(rt, rec, torch.zeros(8), [1.0], "proj.weight")
    wrong = model_shaped(SimpleNamespace(rank=0), rec, torch.zeros(8))  # rank 0's eight values, for rank 1's seven
    with pytest.raises(ParamFSMError) as info:
        write_shard(rt, rec, torch.zeros(8), wrong, "proj.weight")
    assert str(info.value) == (
        "'proj.weight': 8 values for this rank's 7 elements of (3, 5); the state dict was made for another rank "
        "or world size. What to do: pass rt.sharded_state_dict() of this runtime, loaded by "
        "torch.distributed.checkpoint")


def test_writing_a_shard_onto_itself_copies_nothing():
    rt, rec = SimpleNamespace(rank=0), _rec()
    shard = _shard(0)
    pieces = model_shaped(rt, rec, shard)
    version = shard._version
    write_shard(rt, rec, shard, pieces, "proj.weight")
    assert shard._version == version, "DCP loaded into the views already"
