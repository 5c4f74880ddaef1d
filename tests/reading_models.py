"""Models whose forward reads a parameter outside the unit that owns it, shared by the tests of on-demand reads.

``Block`` is a unit of its own (it owns ``gain``) whose forward reads its child's
weight instead of calling the child; ``Reader`` runs it inside the root's
forward, so two units are running when ``block`` reads ``proj``. ``READ_LINE``
is the line of ``Block.forward`` that reads, where the ``ReadOutsideUnit``
warning must point.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch import nn

DIM = 8


class Block(nn.Module):
    """A unit of its own (it owns ``gain``) whose forward reads its child's weight instead of calling it."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, DIM))

    def forward(self, x):
        return torch.tanh(F.linear(x, self.proj.weight, self.proj.bias)) * self.gain


READ_LINE = inspect.getsourcelines(Block.forward)[1] + 1


class Reader(nn.Module):
    """The root runs ``block``'s forward inside its own: two units run when ``block`` reads ``proj``."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, DIM)
        self.block = Block()
        self.out = nn.Linear(DIM, 2)

    def forward(self, x):
        return self.out(self.block(self.inp(x)))
