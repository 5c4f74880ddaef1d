"""``rt.gathered(writeback=True)`` (:mod:`paramfsm.sharding.gathered`) on the one-rank group.

What one rank decides alone: which writes count as changes (in place, ``.data`` of the same shape and dtype),
which cannot be written back (another shape or dtype, a low-precision compute copy), that a block that
raised writes nothing, and the fingerprint the ranks compare (every element, every width). The agreement
between two ranks is in ``test_shard_writes.py`` and ``test_user_paths.py`` (in-process pairs).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import paramfsm
from one_rank import one_rank  # noqa: F401 - fixture
from paramfsm.errors import ParamFSMError
from paramfsm.sharding.gathered import fingerprint


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def _values(rt) -> dict:
    return {key: value.clone() for key, value in rt.full_state_dict().items()}


def _assert_unchanged(rt, before: dict) -> None:
    for key, value in _values(rt).items():
        assert torch.equal(value, before[key]), key


@pytest.mark.parametrize("write", ["in place", "data of the same shape"])
def test_a_change_inside_the_block_reaches_the_shard(one_rank, write):
    model = _model()
    rt = paramfsm.shard(model)
    before = _values(rt)
    with torch.no_grad(), rt.gathered():
        if write == "in place":
            model[0].weight.mul_(2)
        else:
            model[0].weight.data = torch.full((4, 4), 3.0)
    after = _values(rt)
    want = before["0.weight"] * 2 if write == "in place" else torch.full((4, 4), 3.0)
    assert torch.equal(after["0.weight"], want)
    for key in ("0.bias", "2.weight", "2.bias"):
        assert torch.equal(after[key], before[key]), key
    rt.close()


@pytest.mark.parametrize("replacement,words", [
    (torch.zeros(2, 2), "replaced by a torch.float32 tensor of shape (2, 2); a partitioned parameter keeps its shape "
                        "(4, 4) and dtype torch.float32"),
    (torch.zeros(4, 4, dtype=torch.float64), "replaced by a torch.float64 tensor of shape (4, 4); a partitioned "
                                             "parameter keeps its shape (4, 4) and dtype torch.float32"),
])
def test_data_of_another_shape_or_dtype_is_refused_naming_the_parameter(one_rank, replacement, words):
    model = _model()
    rt = paramfsm.shard(model)
    before = _values(rt)
    with pytest.raises(ParamFSMError) as caught, torch.no_grad(), rt.gathered():
        model[0].weight.data = replacement
    message = str(caught.value)
    assert message.startswith("rt.gathered(writeback=True) on rank 0: parameter '0.weight' (unit '0', state "
                              "AVAILABLE, event written_back) cannot be written back: its .data was "), message
    assert words in message and "(rank 0 cannot write it back)" in message, message
    assert "Nothing was written back. What to do:" in message
    _assert_unchanged(rt, before)
    rt.close()


def test_a_write_to_a_low_precision_compute_copy_is_refused(one_rank):
    model = _model()
    rt = paramfsm.shard(model, param_dtype=torch.bfloat16)
    before = _values(rt)
    with pytest.raises(ParamFSMError) as caught, torch.no_grad(), rt.gathered():
        model[2].bias.add_(1)
    message = str(caught.value)
    assert "parameter '2.bias' (unit '2'" in message
    assert ("it was changed, but inside the block it is the torch.bfloat16 compute copy (param_dtype) of a "
            "torch.float32 shard, so writing it back would round the shard; set full-precision values with "
            "rt.load_full_state_dict(...) instead") in message
    _assert_unchanged(rt, before)
    rt.close()


def test_reads_and_unchanged_parameters_write_nothing_back(one_rank):
    model = _model()
    rt = paramfsm.shard(model)
    written = []
    real = rt.scheduler.write_back
    rt.scheduler.write_back = lambda records: (written.append([rec.name for rec in records]), real(records))
    with torch.no_grad(), rt.gathered():
        model[0].weight.sum()
        model[2].weight.add_(0.5)
    assert written == [["2.weight"]]  # only the parameter written to, once
    rt.close()


def test_a_block_that_raises_writes_nothing_back_and_raises_its_own_error(one_rank):
    model = _model()
    rt = paramfsm.shard(model)
    before = _values(rt)
    with pytest.raises(ValueError, match="a bad value"), torch.no_grad(), rt.gathered():
        model[0].weight.add_(1)
        raise ValueError("a bad value")
    _assert_unchanged(rt, before)
    rt.close()


def test_a_read_only_block_drops_its_writes(one_rank):
    model = _model()
    rt = paramfsm.shard(model)
    before = _values(rt)
    with torch.no_grad(), rt.gathered(writeback=False):
        model[0].weight.add_(1)
    assert torch.equal(_values(rt)["0.weight"], before["0.weight"])
    rt.close()


def test_writeback_must_be_true_or_false(one_rank):
    model = _model()
    rt = paramfsm.shard(model)
    with pytest.raises(ParamFSMError, match=r"^rt.gathered\(writeback='yes'\): expected True or False$"):
        with rt.gathered(writeback="yes"):
            pass
    rt.close()


@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16, torch.float32, torch.float64])
def test_the_fingerprint_sees_every_element_at_every_width(dtype):
    values = (torch.arange(12) % 5).to(dtype)
    digest = fingerprint(values)
    assert fingerprint(values.clone()) == digest
    for where in (0, 5, 11):
        changed = values.clone()
        changed[where] += 1
        assert fingerprint(changed) != digest, where
    swapped = values.clone()
    swapped[[0, 1]] = values[[1, 0]]
    assert fingerprint(swapped) != digest  # position-weighted: the same values elsewhere differ
    assert fingerprint(values[:11]) != fingerprint(torch.cat([values[:11], torch.zeros(1, dtype=dtype)]))
