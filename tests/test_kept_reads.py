"""A unit kept from its forward to its backward, read by another unit's forward, is borrowed by the reader.

The root reads the embedding's weight (an output layer tied through ``F.linear``); the embedding is a
unit of its own (over ``min_unit_bytes``), the rest merges into the root under the default units. With
``reshard_after_forward=False`` the embedding is still gathered when the root reads it, so no empty
parameter asks for an on-demand gather: its watching class reports the read instead (see [Note: a read of a
kept parameter outside its unit] in paramfsm.engine.storage.placeholder). Without that, a retained backward
whose deferral bound released the embedding left the root's second backward reading an empty or
half-gathered tensor: gradients off by 0.2 to 5e18, then NaN. Every combination of the three settings
must match plain torch.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from patterns_common import Pair, tokens
from torch import nn

from paramfsm import State
from paramfsm.engine.storage.default_units import MIN_UNIT_BYTES

VOCAB, DIM = 2048, 16  # the embedding holds 128 KiB: over MIN_UNIT_BYTES, a unit of its own


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.b1, self.b2, self.norm = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.LayerNorm(DIM)

    def forward(self, ids):
        h = self.emb(ids)
        h = h + torch.tanh(self.b1(h))
        h = h + torch.tanh(self.b2(h))
        return F.linear(self.norm(h), self.emb.weight)


def tied_job(rank, world, min_unit_bytes, reshard, bound):
    torch.manual_seed(0)
    pair = Pair(TiedLM(), rank, world, min_unit_bytes=min_unit_bytes, reshard_after_forward=reshard,
                max_deferred_bytes=bound)
    units = [u.name for u in pair.rt.units]
    model, ref = pair.model, pair.ref.model
    for step in range(3):
        ids = tokens(step, world, 2, 6, VOCAB)
        targets = tokens(step + 100, world, 2, 6, VOCAB)
        pair.zero_grad()
        loss = F.cross_entropy(model(pair.local(ids)).flatten(0, 1), pair.local(targets).flatten())
        loss.backward(retain_graph=True)
        loss.backward()
        ref_loss = F.cross_entropy(ref(ids).flatten(0, 1), targets.flatten())
        ref_loss.backward(retain_graph=True)
        ref_loss.backward()
        pair.check_grads(f"step {step}")
        pair.step(f"step {step}")
        pair.assert_states(State.NOT_AVAILABLE, what=f"step {step}")
    return units, pair.finish()


@pytest.mark.parametrize("bound", [None, 64 << 10], ids=["unbounded", "bound_below_the_embedding"])
@pytest.mark.parametrize("reshard", [True, False], ids=["resharded", "kept"])
@pytest.mark.parametrize("min_unit_bytes", [MIN_UNIT_BYTES, 0], ids=["default_units", "per_module"])
def test_a_tied_output_layer_trains_like_plain_torch_whatever_is_kept(ranks2, min_unit_bytes, reshard, bound):
    units, report = ranks2.run(tied_job, min_unit_bytes, reshard, bound)[0]
    assert report["checks"] == 6
    if min_unit_bytes:
        assert units == ["<root>", "emb"], units  # the default merged the small modules into the root
    else:
        assert units == ["<root>", "emb", "b1", "b2", "norm"], units
