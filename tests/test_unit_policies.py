"""``units=paramfsm.by_size(min_bytes=...)``: which modules become units, and training through them."""

from __future__ import annotations

import pytest
import torch
from patterns_common import Pair, batch
from torch import nn

import paramfsm
from paramfsm import State
from paramfsm.engine.storage.units import build_units, select_unit_modules


class Tower(nn.Module):
    """Two big blocks, a stack of tiny layers, and a head tied to the embedding."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 32)  # 2048 bytes
        self.big = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32)) for _ in range(2))
        self.tiny = nn.Sequential(*(nn.Linear(4, 4) for _ in range(6)))  # 80 bytes each
        self.down, self.up = nn.Linear(32, 4), nn.Linear(4, 32)
        self.head = nn.Linear(32, 16, bias=False)
        self.head.weight = self.embed.weight
        nn.init.normal_(self.embed.weight, std=0.1)  # N(0, 1) through a tied head makes SGD blow up

    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.big:
            x = x + block(x)
        return self.head(x + self.up(self.tiny(self.down(x))))


def test_by_size_chooses_modules_bottom_up():
    model = Tower()
    # Each big block holds 2 x 4224 bytes; a Linear(32, 32) alone is 4224.
    assert paramfsm.by_size(min_bytes=8000).select(model) == {"big.0", "big.1"}
    assert paramfsm.by_size(min_bytes=4000).select(model) == {
        "big.0.0", "big.0.2", "big.1.0", "big.1.2"}
    # The tiny stack (480 bytes) becomes one unit, not six; the embedding and its tied head are counted once.
    assert paramfsm.by_size(min_bytes=400).select(model) >= {"tiny", "embed"}
    assert not {f"tiny.{i}" for i in range(6)} & paramfsm.by_size(min_bytes=400).select(model)
    assert paramfsm.by_size(min_bytes=1 << 30).select(model) == set()
    units, _ = build_units(Tower(), paramfsm.by_size(min_bytes=1 << 30), rank=0, world=2)
    assert [u.name for u in units] == ["<root>"], "everything left belongs to the root"
    assert list(select_unit_modules(model, paramfsm.by_size(min_bytes=8000))) == ["", "big.0", "big.1"]


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_by_size_rejects_a_bad_size(bad):
    with pytest.raises(paramfsm.ParamFSMError, match="by_size"):
        paramfsm.by_size(min_bytes=bad)


def by_size_job(rank, world, min_bytes):
    torch.manual_seed(0)
    pair = Pair(Tower(), rank, world, units=paramfsm.by_size(min_bytes=min_bytes))
    model, ref = pair.model, pair.ref.model
    names = [u.name for u in pair.rt.units]
    for step in range(3):
        tokens = torch.randint(0, 16, (world * 2, 5), generator=torch.Generator().manual_seed(step))
        y, = batch(step, world, 2, (5, 16))
        out = model(pair.local(tokens))
        pair.zero_grad()
        torch.nn.functional.mse_loss(out, pair.local(y)).backward()
        torch.nn.functional.mse_loss(ref(tokens), y).backward()
        pair.assert_states(State.NOT_AVAILABLE, what=f"step {step}")
        pair.check_grads(f"step {step}")
        pair.step(f"step {step}")
    pair.finish()
    return names


def test_training_through_size_based_units_matches_plain_torch(ranks2):
    assert ranks2.run(by_size_job, 400)[0] == [
        "<root>", "embed", "big.0.0", "big.0.2", "big.1.0", "big.1.2", "tiny", "down", "up"]
    assert ranks2.run(by_size_job, 8000)[0] == ["<root>", "big.0", "big.1"]
    assert ranks2.run(by_size_job, 1 << 30)[0] == ["<root>"]
