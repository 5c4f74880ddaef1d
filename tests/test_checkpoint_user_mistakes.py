"""Checkpoint folders as users leave them: other tools' checkpoints beside ours, a copy cut short, a bigger model's.

One rank in the test process (quick, and ``make mutate`` reaches it). Each case is a mistake a user makes or an
accident a disk has, checked against the documented contract:

* ``save(..., keep_last=N)`` removes only checkpoints paramfsm saved: a DCP checkpoint another tool wrote into
  the same folder (an FSDP2 export) is complete but has no paramfsm manifest, and stays.
* A checkpoint whose last bytes were cut off (a copy interrupted, a full disk) is not complete: ``latest()``
  passes over it to the older good one, and ``load`` of it raises ``ParamFSMError`` naming the file.
* A checkpoint of a bigger model (more layers) does not load into a smaller one: the keys this model lacks are
  named, and nothing is loaded.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from one_rank import one_rank  # noqa: F401  (fixture)

import paramfsm
import paramfsm.checkpoint as ck
from paramfsm.errors import ParamFSMError
from paramfsm.testing.models import mlp


@pytest.fixture
def rt(one_rank):  # noqa: F811
    torch.manual_seed(0)
    runtime = paramfsm.shard(mlp(width=8, depth=3, d_in=4, d_out=3))
    yield runtime
    runtime.close()


def test_keep_last_leaves_a_checkpoint_another_tool_saved(rt, tmp_path):
    dcp.save({"w": torch.arange(6.0)}, checkpoint_id=str(tmp_path / "fsdp-export"))  # complete, not paramfsm's
    for step in range(3):
        ck.save(rt, tmp_path / f"step-{step}", keep_last=1)
    assert sorted(os.listdir(tmp_path)) == ["fsdp-export", "step-2"]
    loaded = {"w": torch.zeros(6)}
    dcp.load(loaded, checkpoint_id=str(tmp_path / "fsdp-export"))
    assert torch.equal(loaded["w"], torch.arange(6.0))


def test_a_checkpoint_cut_short_by_a_few_bytes_is_neither_latest_nor_loaded(rt, tmp_path):
    ck.save(rt, tmp_path / "step-1")
    want = rt.full_state_dict()
    with torch.no_grad():
        for shard in rt.shard_parameters():
            shard.add_(1.0)
    ck.save(rt, tmp_path / "step-2")
    data = max((p for p in (tmp_path / "step-2").iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    data.write_bytes(data.read_bytes()[:-3])  # the last three bytes lost
    assert ck.latest(tmp_path) == tmp_path / "step-1"
    with pytest.raises(ParamFSMError, match=f"data file '{data}' is truncated"):
        ck.load(rt, tmp_path / "step-2")
    ck.load(rt, ck.latest(tmp_path))
    got = rt.full_state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_bigger_models_checkpoint_does_not_load_into_a_smaller_one(one_rank, tmp_path):  # noqa: F811
    def layers(depth):  # the same first layers, then more of them: a config with fewer layers
        return torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(depth)))

    torch.manual_seed(0)
    bigger = paramfsm.shard(layers(3))
    ck.save(bigger, tmp_path / "ck")
    bigger.close()
    torch.manual_seed(1)
    rt = paramfsm.shard(layers(2))
    try:
        before = rt.full_state_dict()
        with pytest.raises(ParamFSMError, match="holds '2.weight', which this model does not have") as caught:
            ck.load(rt, tmp_path / "ck")
        assert "Nothing was loaded" in str(caught.value)
        after = rt.full_state_dict()
        assert all(torch.equal(after[k], before[k]) for k in before)
    finally:
        rt.close()


def _saved(tmp_path, model, optimizer=False) -> str:
    rt = paramfsm.shard(model)
    opt = None
    if optimizer:
        opt = torch.optim.Adam(rt.model.parameters(), lr=0.1)
        rt.model(torch.ones(2, model[0].in_features)).sum().backward()
        opt.step()
    ck.save(rt, tmp_path / "ck", optimizer=opt)
    rt.close()
    return str(tmp_path / "ck")


def _refused_load(model, path, optimizer=False) -> str:
    rt = paramfsm.shard(model)
    opt = torch.optim.Adam(rt.model.parameters(), lr=0.1) if optimizer else None
    before = rt.full_state_dict()
    try:
        with pytest.raises(ParamFSMError) as caught:
            ck.load(rt, path, optimizer=opt)
        after = rt.full_state_dict()
        assert all(torch.equal(after[k], before[k]) for k in before), "a refused load changed the model"
    finally:
        rt.close()
    return str(caught.value)


def _linears(*widths):
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:])))


def test_a_smaller_models_checkpoint_names_the_first_key_it_lacks(one_rank, tmp_path):  # noqa: F811
    path = _saved(tmp_path, _linears(8, 8))
    message = _refused_load(_linears(8, 8, 8), path)
    assert message == (f"paramfsm.checkpoint.load: '{path}' has no '1.weight' (this model's shape (8, 8)); it was "
                       "saved from another model. Nothing was loaded (rank 0)")


def test_another_shape_is_named_with_both_shapes(one_rank, tmp_path):  # noqa: F811
    path = _saved(tmp_path, _linears(8, 6))
    message = _refused_load(_linears(8, 5), path)
    assert message == (f"paramfsm.checkpoint.load: '0.weight' has shape (6, 8) in '{path}' but shape (5, 8) in "
                       "this model; it was saved from another model. Nothing was loaded (rank 0)")


def test_the_same_number_of_values_in_another_shape_is_refused_by_the_manifest(one_rank, tmp_path):  # noqa: F811
    """(6, 4) and (4, 6) hold as many values: only the shapes the manifest keeps tell them apart."""
    path = _saved(tmp_path, _linears(4, 6, 4))
    message = _refused_load(_linears(6, 4, 6), path)
    assert message == (f"paramfsm.checkpoint.load: '0.weight' has shape (6, 4) in '{path}' but shape (4, 6) in "
                       "this model; it was saved from another model. Nothing was loaded (rank 0)")


def test_an_optimizer_load_from_a_checkpoint_without_one_says_so(one_rank, tmp_path):  # noqa: F811
    path = _saved(tmp_path, _linears(8, 8))
    message = _refused_load(_linears(8, 8), path, optimizer=True)
    assert message == (f"paramfsm.checkpoint.load(optimizer=...): '{path}' was saved without optimizer state; "
                       "nothing was loaded. What to do: load it without optimizer=, or load a checkpoint saved with "
                       "save(rt, path, optimizer=opt) (rank 0)")


def test_optimizer_state_of_another_shape_is_refused(one_rank, tmp_path):  # noqa: F811
    path = _saved(tmp_path, _linears(8, 8), optimizer=True)
    rt = paramfsm.shard(_linears(8, 8))
    opt = torch.optim.Adam(rt.model.parameters(), lr=0.1)
    rt.model(torch.ones(2, 8)).sum().backward()
    opt.step()
    for state in opt.state.values():
        state["exp_avg"] = torch.zeros(3)  # not the shape the checkpoint holds
    try:
        with pytest.raises(ParamFSMError) as caught:
            ck.load(rt, path, optimizer=opt)
    finally:
        rt.close()
    assert str(caught.value) == (f"paramfsm.checkpoint.load: optimizer state 'optim.0.weight.exp_avg' has shape "
                                 f"(8, 8) in '{path}' but (3,) here; nothing was loaded (rank 0)")
