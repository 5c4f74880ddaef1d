"""The residency record of one offloaded value: what the residency machine steps.

A :class:`Placement` is to the residency machine (``[residency]`` in the spec)
what :class:`~paramfsm.core.fsm.Lifetime` is to the lifetime machine: its state,
its name for messages and traces, and its recent history. The same
:func:`~paramfsm.core.fsm.step` moves both (through their own compiled
tables), so the residency of a value is assigned nowhere else.

This module imports neither ``torch`` nor ``cupy``.
"""

from __future__ import annotations

from collections import deque

from paramfsm.core.fsm import HISTORY
from paramfsm.core.spec import Residency

#: What a placement's ``kind`` may be: a parameter's shard, its shard gradient, its optimizer state.
KINDS = ("shard", "grad", "optim")


class Placement:
    """One offloaded value of one parameter: ``kind`` says which (see :data:`KINDS`)."""

    __slots__ = ("name", "unit", "kind", "nbytes", "state", "holds", "recent", "__weakref__")
    machine = "residency"  # which machine's records these are, in traces and messages

    def __init__(self, name: str, unit: str, kind: str, nbytes: int = 0):
        if kind not in KINDS:
            raise ValueError(f"a placement's kind is one of {KINDS}, not {kind!r}")
        self.name = name
        self.unit = unit
        self.kind = kind
        self.nbytes = nbytes  # bytes of the value on this rank
        self.state = Residency.DIRTY
        self.holds = 0  # the residency machine counts no holders; step() reads it
        self.recent: deque = deque(maxlen=HISTORY)

    def __repr__(self) -> str:
        return f"<Placement {self.kind} of {self.name!r} [{self.unit}] {self.state.name}>"
