"""Default units of any model: a module smaller than ``min_unit_bytes`` joins its parent's unit.

In-process checks of the choice (sizes, reasons, ``units=`` overriding it, the
``torch.nn`` modules that stay whole, the argument's checks, ``rt.describe_units()``
and its log line under ``debug=True``), and training through merged units at
world 2 against plain torch.
"""

from __future__ import annotations

import logging

import pytest
import torch
from one_rank import one_rank  # noqa: F401  (fixture)
from patterns_common import Pair, batch
from torch import nn

import paramfsm
from paramfsm import State
from paramfsm.engine.storage.default_units import MIN_UNIT_BYTES, MIN_UNIT_BYTES_ENV
from paramfsm.engine.storage.units import build_units, select_unit_modules


@pytest.fixture(autouse=True)
def real_default(monkeypatch):
    """The suite sets $PARAMFSM_MIN_UNIT_BYTES=0 (tests/conftest.py); these tests are of the real default."""
    monkeypatch.delenv(MIN_UNIT_BYTES_ENV, raising=False)


class Mixed(nn.Module):
    """A big block holding small children, a small block, tiny layers and a big head."""

    def __init__(self):
        super().__init__()
        self.big = nn.Sequential(nn.Linear(128, 128), nn.LayerNorm(128), nn.Linear(128, 128))  # 2 x 66,048 B
        self.small = nn.Sequential(nn.Linear(128, 16), nn.Linear(16, 128))  # 8,256 + 8,704 B
        self.norm = nn.LayerNorm(128)
        self.head = nn.Linear(128, 160)  # 82,560 B

    def forward(self, x):
        return self.head(self.norm(x + self.small(self.big(x))))


def test_small_modules_join_their_parents_unit():
    chosen = select_unit_modules(Mixed(), None)
    assert list(chosen) == ["", "big.0", "big.2", "head"]
    assert chosen.merged == {"": ["big.1", "small.0", "small.1", "norm"]}
    assert select_unit_modules(Mixed(), None, min_unit_bytes=17_000).merged[""] == ["big.1", "small.0", "small.1",
                                                                                    "norm"]
    assert list(select_unit_modules(Mixed(), None, min_unit_bytes=0)) == [
        "", "big.0", "big.1", "big.2", "small.0", "small.1", "norm", "head"]


def test_a_parent_owning_parameters_takes_its_small_children():
    model = nn.Sequential(nn.Linear(4, 4))
    model.block = nn.Linear(128, 128)
    model.block.add_module("adapter", nn.Linear(4, 4))
    chosen = select_unit_modules(model, None)
    assert list(chosen) == ["", "block"] and chosen.merged == {"": ["0"], "block": ["block.adapter"]}
    units, _ = build_units(model, None, rank=0, world=2)
    assert [[r.name for r in u.records] for u in units] == [
        ["0.weight", "0.bias"], ["block.weight", "block.bias", "block.adapter.weight", "block.adapter.bias"]]


def test_a_stack_of_tiny_layers_is_one_unit():
    stack = nn.Sequential(*(nn.Linear(8, 8) for _ in range(200)))
    assert list(select_unit_modules(stack, None)) == [""]
    assert len(select_unit_modules(stack, None, min_unit_bytes=0)) == 201
    assert len(select_unit_modules(stack, None, min_unit_bytes=288 * 2)) == 1
    assert len(select_unit_modules(stack, None, min_unit_bytes=288)) == 201, "288 bytes each: not smaller"


def test_units_override_the_size_rule():
    stack = nn.Sequential(*(nn.Linear(8, 8) for _ in range(4)))
    assert list(select_unit_modules(stack, [nn.Linear], min_unit_bytes=1 << 30)) == ["", "0", "1", "2", "3"]
    assert list(select_unit_modules(stack, lambda name, module: name == "2")) == ["", "2"]


def test_modules_reading_their_children_stay_whole():
    big = nn.TransformerEncoderLayer(64, 2, dim_feedforward=128, batch_first=True)
    model = nn.Sequential(nn.MultiheadAttention(8, 2, batch_first=True), big)
    chosen = select_unit_modules(model, None)
    assert list(chosen) == ["", "1"] and chosen.reasons["1"] == "reads its children (TransformerEncoderLayer)"
    assert chosen.merged == {"": ["0"]}, "the small attention joins the root whole, its out_proj with it"


@pytest.mark.parametrize("bad, error", [(-1, paramfsm.ArgumentError), (1.5, paramfsm.ArgumentTypeError),
                                        (True, paramfsm.ArgumentTypeError), ("64K", paramfsm.ArgumentTypeError)])
def test_min_unit_bytes_is_checked_before_anything_changes(bad, error):
    model = Mixed()
    with pytest.raises(error, match="min_unit_bytes="):
        paramfsm.shard(model, min_unit_bytes=bad)
    assert model.big[0].weight.numel() == 128 * 128 and model.big[0].weight.data.numel() == 128 * 128


def test_the_environment_sets_the_default_and_an_argument_overrides_it(monkeypatch):
    stack = nn.Sequential(*(nn.Linear(8, 8) for _ in range(20)))
    monkeypatch.setenv(MIN_UNIT_BYTES_ENV, "0")
    assert len(select_unit_modules(stack, None)) == 21
    assert len(select_unit_modules(stack, None, min_unit_bytes=MIN_UNIT_BYTES)) == 1
    monkeypatch.setenv(MIN_UNIT_BYTES_ENV, "64K")
    with pytest.raises(paramfsm.ArgumentError, match=f"{MIN_UNIT_BYTES_ENV}='64K'"):
        paramfsm.shard(stack)
    assert stack[0].weight.numel() == 64, "refused before anything is partitioned"


def test_describe_units_names_each_unit_and_is_logged_under_debug(one_rank, caplog):
    with caplog.at_level(logging.INFO, logger="paramfsm"):
        rt = paramfsm.shard(Mixed(), debug=True)
        table = rt.describe_units()
        rt.close()
    rows = [line.split() for line in table.splitlines()]
    assert rows[0] == ["unit", "module", "params", "elements", "bytes", "why"]
    assert [row[1] for row in rows[1:]] == ["<root>", "big.0", "big.2", "head"]
    assert rows[1][2:6] == ["8", "4,752", "19,008", "root;"] and "big.1, small.0, small.1, norm" in table
    assert rows[4][2:] == ["2", "20,640", "82,560", "owns", "parameters"]
    assert [r.message for r in caplog.records if table in r.getMessage()], caplog.text
    assert MIN_UNIT_BYTES == 64 << 10


def merged_job(rank, world):
    torch.manual_seed(0)
    pair = Pair(Mixed(), rank, world, min_unit_bytes=MIN_UNIT_BYTES)  # ranks inherit the suite's 0
    for step in range(3):
        x, y = batch(step, world, 2, (128,), (160,))
        pair.zero_grad()
        torch.nn.functional.mse_loss(pair.model(pair.local(x)), pair.local(y)).backward()
        torch.nn.functional.mse_loss(pair.ref.model(x), y).backward()
        pair.assert_states(State.NOT_AVAILABLE, what=f"step {step}")
        pair.check_grads(f"step {step}")
        pair.step(f"step {step}")
    report = pair.finish()
    report["units"] = [u.name for u in pair.rt.units]
    return report


def test_training_through_merged_units_matches_plain_torch(ranks2):
    for report in ranks2.run(merged_job):
        assert report["units"] == ["<root>", "big.0", "big.2", "head"]
        assert report["checks"] == 6
