"""The reduce bucket's bookkeeping of which ranks produced which gradient, and which gradients are staged.

The schedule decides the order gradients go out in (see [Note: a unit's
gradients go out in the unit's order] and [Note: a gradient no rank produced
stays None] in :mod:`paramfsm.engine.schedule.grad_order`); the executor packs
them. What both need to know about a gradient lives here, below both.
"""

from __future__ import annotations

import torch


def staged(rec) -> bool:
    """Whether ``rec``'s gradient goes out in its unit's order (it belongs to one unit only)."""
    return len(rec.units) == 1


class Flags:
    """The extra "parameter" of a packed reduce bucket: whether each rank had each gradient
    (see [Note: a gradient no rank produced stays None])."""

    __slots__ = ("records", "numel", "unit")

    def __init__(self, records, world: int):
        self.records = records
        self.numel = world * len(records)
        self.unit = records[0].unit


def add_flags(pending: list, had: dict, world: int) -> list:
    """``pending`` (record, gradient) pairs, plus the flags of those in ``had`` (popped from it).

    A parameter may be pending twice (zeros when its unit closed, then its late gradient: [Note: late
    gradients] in paramfsm.engine.schedule.grad_order); it has one flag, and both pieces are accumulated
    or neither.
    """
    flagged = list(dict.fromkeys(rec for rec, _ in pending if rec in had))
    if not flagged:
        return pending
    values = [1.0 if had.pop(rec) else 0.0 for rec in flagged]
    device = pending[0][1].device
    return pending + [(Flags(flagged, world), torch.tensor(values, device=device).repeat(world))]


def without_unproduced(records, pieces) -> list:
    """(record, reduced shard) pairs to accumulate: a flagged parameter no rank had a gradient for is left out."""
    if not records or type(records[-1]) is not Flags:
        return list(zip(records, pieces))
    flags, pieces = records[-1], list(pieces)
    if pieces[-1].is_meta:  # a memory plan's rehearsal (paramfsm.planning): every rank is taken to have one
        return list(zip(records[:-1], pieces[:-1]))
    nobody = {rec for rec, any_rank in zip(flags.records, (pieces[-1] != 0).tolist()) if not any_rank}
    return [(rec, piece) for rec, piece in zip(records[:-1], pieces[:-1]) if rec not in nobody]
