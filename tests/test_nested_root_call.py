"""A root module called inside its own forward (``training_step`` run as the forward, a recursive model).

The nested call is part of the one root forward: see [Note: the root called
inside its own forward] in ``paramfsm/engine/events/hooks.py``. Before, it
emitted a second ``FORWARD_BEGIN``, which read as a forward that never ended:
every gathered parameter was reset and the outer forward's release was an
illegal transition.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from patterns_common import Pair, batch
from torch import nn

from paramfsm import State


class Recursive(nn.Module):
    """``forward(x)`` runs ``self(x, inner=True)`` (the real work) and scales it by a parameter of its own."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
        self.gain = nn.Parameter(torch.full((3,), 1.5))

    def forward(self, x, inner=False):
        if inner:
            return self.body(x) * self.gain
        return self(x, inner=True) + self.gain


def nested_job(rank, world, units):
    torch.manual_seed(0)
    pair = Pair(Recursive(), rank, world, units=units)
    for step in range(3):
        x, y = batch(step, world, 2, (4,), (3,))
        pair.zero_grad()
        F.mse_loss(pair.model(pair.local(x)), pair.local(y)).backward()
        F.mse_loss(pair.ref.model(x), y).backward()
        pair.check_grads(f"step {step}")
        pair.step(f"step {step}")
        pair.assert_states(State.NOT_AVAILABLE, what=f"after step {step}")
    return pair.finish()


def test_a_root_called_inside_its_own_forward_trains_like_plain_torch(ranks2):
    for units in (None, [Recursive]):  # per-module units (the root holds `gain`), and the whole model one unit
        for report in ranks2.run(nested_job, units):
            assert report["checks"] == 6, report
