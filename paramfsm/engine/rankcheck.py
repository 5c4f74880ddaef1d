"""The rank-order check: every rank's all-gathers must be the same gathers, or RankDesync is raised.

Every rank runs the same program, so the n-th all-gather of every rank is
for the same unit at the same step with the same size. When a branch runs
on one rank only, the ranks pair different gathers. Each gather therefore
carries a small tag ``(gather number, step, unit index, elements)`` and every
rank compares the tags of all ranks once the gather completes.

[Note: two ways to carry the tag]
By default the tag rides inside every all-gather bucket, as an extra
"parameter" of :data:`TAG_NUMEL` elements per rank holding the tag's bytes
(values 0..255 are exact in every floating dtype, bf16 included). That costs
no collective and catches every desync whose paired gathers have the same
size: identical blocks in a different order, the same bucket fetched from a
different unit, a unit run at different steps. Collectives of different
sizes cannot be paired at all: gloo aborts the process ("Received data size
doesn't match expected size") before any tag could be read, and NCCL may
hang. That is the usual outcome of a branch one rank skips, often first seen
in the gradient reduce-scatter (the skipped unit has no gradient there).
``paramfsm.shard(..., debug=True)`` therefore all-gathers the tag alone, in
a fixed-size header, before every all-gather and every reduce-scatter, so
every desync raises RankDesync on every rank at the first differing
collective, at the price of one small blocking collective each.

The in-bucket tag is read on the host, so it is used where the buffers are
CPU tensors; on CUDA only ``debug=True`` checks (a host synchronisation per
collective is what debugging pays for).
"""

from __future__ import annotations

import torch

from paramfsm.engine.collectives import all_gather_tags
from paramfsm.engine.default_units import one_unit
from paramfsm.errors import RankDesync

TAG_FIELDS = ("gather", "step", "unit", "elements")
_BYTES = 4
TAG_NUMEL = len(TAG_FIELDS) * _BYTES
_SHIFTS = torch.tensor([8 * i for i in range(_BYTES)] * len(TAG_FIELDS), dtype=torch.int64)


def encode(fields: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """The tag as :data:`TAG_NUMEL` small integers (its little-endian bytes) in ``dtype``."""
    values = [(f >> (8 * i)) & 0xFF for f in fields for i in range(_BYTES)]
    return torch.tensor(values, dtype=dtype, device=device)


def decode(rows: torch.Tensor) -> list[tuple[int, ...]]:
    """Tags of every rank from a ``(world, TAG_NUMEL)`` tensor of encoded tags."""
    words = (rows.to(torch.int64).cpu() << _SHIFTS).view(rows.shape[0], len(TAG_FIELDS), _BYTES).sum(-1)
    return [tuple(int(v) for v in row) for row in words]


def check_encoded(rows: torch.Tensor, rank: int, unit_names) -> None:
    """Raise RankDesync unless every rank's encoded tag (one row per rank) is the same."""
    if bool((rows == rows[:1]).all()):
        return
    _raise(decode(rows), rank, unit_names, "all-gather")


def check_header(fields: tuple[int, ...], rank: int, world: int, group, unit_names, what: str,
                 wait=None) -> None:
    """The ``debug=True`` check: all-gather the tag alone (fixed size) before the collective ``what``.

    ``wait`` waits for the header's all-gather (a time-limited waiter from the executor).
    """
    header = torch.tensor([f & 0xFFFFFFFF for f in fields], dtype=torch.int64)
    rows = all_gather_tags(header, world, group, wait)
    if bool((rows == rows[:1]).all()):
        return
    _raise([tuple(int(v) for v in row) for row in rows], rank, unit_names, what)


def _unit_name(index: int, unit_names) -> str:
    return unit_names[index] if 0 <= index < len(unit_names) else f"#{index}"


def _raise(tags: list[tuple[int, ...]], rank: int, unit_names, what: str) -> None:
    mine = tags[rank]
    lines = "; ".join(f"rank {r}: {what} #{n} for unit '{_unit_name(u, unit_names)}' at step {s} "
                      f"({e} elements per rank)" for r, (n, s, u, e) in enumerate(tags))
    differing = sorted({rank, *(r for r, t in enumerate(tags) if t != mine)})
    scope = enclosing_module([_unit_name(t[2], unit_names) for t in tags if t != tags[0]] +
                             [_unit_name(tags[0][2], unit_names)])
    advice = "" if scope is None else (
        f"if a data-dependent branch runs a module on some ranks only (a mixture of experts, an early exit), "
        f"make the module enclosing the branch one unit, probably '{scope}', so every rank gathers and "
        f"reduces it whole: paramfsm.shard(model, units={one_unit(scope)}) or units=[its class]")
    raise RankDesync(rank=rank, unit=_unit_name(mine[2], unit_names), step=mine[1],
                     detail=f"ranks {differing} issued different collectives ({lines})", advice=advice)


def enclosing_module(unit_names) -> str | None:
    """The module that probably holds the branch between ``unit_names`` (the units the ranks disagree on):
    the deepest parent of one of them, past ``ModuleList``-style containers (a numeric last name)."""
    parents = []
    for name in unit_names:
        parts = name.split(".") if name and not name.startswith("<") else []
        if parts and parts.pop().isdigit() and parts:
            parts.pop()  # an indexed child of a container (ModuleList): the container's owner holds the branch
        if parts:
            parents.append(".".join(parts))
    return max(parents, key=lambda p: p.count("."), default=None)
