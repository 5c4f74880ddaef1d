"""The rank-order check: every rank's collectives must be the same collectives, or RankDesync is raised.

Every rank runs the same program, so the n-th all-gather of every rank is
for the same unit at the same step with the same size. When a branch runs
on one rank only, the ranks pair different collectives. Each gather therefore
carries a small tag ``(gather number, step, unit index, elements)`` and every
rank compares the tags of all ranks.

[Note: two ways to carry the tag]
By default the tag rides inside every all-gather bucket, as an extra
"parameter" of :data:`TAG_NUMEL` elements per rank holding the tag's bytes
(values 0..255 are exact in every floating dtype, bf16 included). That costs
no collective and catches every desync whose paired gathers have the same
size: identical blocks in a different order, the same bucket fetched from a
different unit, a unit run at different steps. Collectives of different
sizes cannot be paired at all: gloo aborts the process ("Received data size
doesn't match expected size") before any tag could be read, and NCCL may
hang. That is the usual outcome of a branch one rank skips or repeats, or of
a loss that reads another output unit on each rank. So, by default on gloo,
sizes are agreed before anything moves. At world 2 (and for gathers up to
:data:`~paramfsm.engine.effects.gloo.exchange.MAX_WORLD` ranks) every collective is a
point-to-point exchange, agreed on the exchange threads (see [Note: an
exchange agrees its sizes first]); a gloo collective (a reduce-scatter beyond
world 2) is preceded by a blocking header all-gather instead. Either way a
desync raises RankDesync on every rank at the first differing collective.
``paramfsm.shard(..., debug=True)`` all-gathers a header on the caller's
thread before every all-gather and every reduce-scatter, on every backend, at
the price of one small blocking collective each.

The in-bucket tag is read on the host, so it is used where the buffers are
CPU tensors; on CUDA only ``debug=True`` checks (a host synchronisation per
collective is what debugging pays for).

The sizes agreed before a gloo exchange moves, its headers and runs, are the gloo
transport's: :mod:`paramfsm.engine.effects.gloo.agreement`.
"""

from __future__ import annotations

import torch

from paramfsm.engine.effects.groups import all_gather_tags
from paramfsm.engine.storage.default_units import one_unit
from paramfsm.engine.storage.units import ROOT as ROOT_NAME
from paramfsm.errors import RankDesync

TAG_FIELDS = ("gather", "step", "unit", "elements")
_BYTES = 4
TAG_NUMEL = len(TAG_FIELDS) * _BYTES
_SHIFTS = torch.tensor([8 * i for i in range(_BYTES)] * len(TAG_FIELDS), dtype=torch.int64)

GATHER, REDUCE = 1, 2  # the kinds of collective a header names (and paramfsm.engine.effects.gloo.agreement's)


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
    raise _desync([("all-gather", *tag, "") for tag in decode(rows)], rank, unit_names)


def check_header(fields: tuple[int, ...], rank: int, world: int, group, unit_names, what: str,
                 wait=None) -> None:
    """A blocking header before the collective ``what`` ("all-gather" or "reduce-scatter"): all-gather its
    kind and tag alone (fixed size), raise RankDesync unless every rank's is the same. ``wait`` waits for
    the header's all-gather (a time-limited waiter from the executor)."""
    header = torch.tensor([_CODES.get(what, 0)] + [f & 0xFFFFFFFF for f in fields], dtype=torch.int64)
    rows = all_gather_tags(header, world, group, wait)
    if bool((rows == rows[:1]).all()):
        return
    raise _desync([(_KINDS.get(int(row[0]), what), *(int(v) for v in row[1:]), "") for row in rows],
                  rank, unit_names)


def refused(rows: torch.Tensor, rank: int, unit_names, what: str, step: int) -> RankDesync:
    """The RankDesync of an exchange whose ranks' headers differed (``rows``: one :data:`HEADER` per
    rank); ``what`` and ``step`` stand for this rank's own collective when its header names none."""
    described, table = [], rows.tolist()
    counts, runs = {row[2] for row in table}, {tuple(row[5:7]) for row in table}
    for named, kind, exchanges, _, nbytes, _, _, number, at, unit, elements in table:
        extra = f" in {exchanges} exchange{'s' * (exchanges != 1)}" if len(counts) > 1 else ""
        extra += " (after other collectives than the other ranks')" if len(runs) > 1 else ""
        kind = _KINDS.get(kind, what)
        described.append((kind, number, at, unit, elements, extra) if named else (kind, None, step, -1, nbytes, extra))
    return _desync(described, rank, unit_names, what)


_KINDS = {GATHER: "all-gather", REDUCE: "reduce-scatter"}
_CODES = {name: code for code, name in _KINDS.items()}


def _unit_name(index: int, unit_names) -> str:
    return unit_names[index] if 0 <= index < len(unit_names) else f"#{index}"


def _line(row, unit_names) -> str:
    kind, number, step, unit, elements, extra = row
    if number is None:
        return f"{kind} of {elements} bytes per peer that names no unit (a full tensor's gather){extra}"
    return (f"{kind} #{number} for unit '{_unit_name(unit, unit_names)}' at step {step} "
            f"({elements} elements per rank){extra}")


def _desync(rows: list[tuple], rank: int, unit_names, what: str = "") -> RankDesync:
    """RankDesync on ``rank`` from every rank's (kind, number or None, step, unit, elements, extra)."""
    mine = rows[rank]
    lines = "; ".join(f"rank {r}: {_line(row, unit_names)}" for r, row in enumerate(rows))
    differing = sorted({rank, *(r for r, row in enumerate(rows) if row != mine)})
    names = list(dict.fromkeys(_unit_name(row[3], unit_names) for row in rows if row[1] is not None))
    scope = enclosing_module(names)
    if scope is None and ROOT_NAME in names:  # their backward passes put different units in the root's buckets
        scope = ""
    held = [n for n in names if n[:1] != "<"]
    advice = "" if scope is None else (
        "if a data-dependent branch runs a module on some ranks only, or more often on some (a mixture of "
        "experts, an early exit, a loss that reads another output head on each rank), make the module "
        "enclosing the branch one unit, so every rank gathers and reduces it whole: " + (
            f"probably '{scope}': paramfsm.shard(model, units={one_unit(scope)}) or units=[its class]" if scope
            else "here the model itself" + (", which holds " + " and ".join(f"'{n}'" for n in held) if held else "")
            + ": paramfsm.shard(model, units=[type(model)])"))
    unit = _unit_name(mine[3], unit_names) if mine[1] is not None else what
    return RankDesync(rank=rank, unit=unit, step=mine[2],
                      detail=f"ranks {differing} issued different collectives ({lines})", advice=advice)


def enclosing_module(unit_names) -> str | None:
    """The module that probably holds the branch between ``unit_names`` (the units the ranks disagree on):
    the deepest parent of one of them, past ``ModuleList``-style containers (a numeric last name); ``""``
    (the model itself) when they are its children; None when none is a module (full tensors, the root)."""
    parents, modules = [], False
    for name in unit_names:
        parts = name.split(".") if name and not name.startswith("<") else []
        modules = modules or bool(parts)
        if parts and parts.pop().isdigit() and parts:
            parts.pop()  # an indexed child of a container (ModuleList): the container's owner holds the branch
        if parts:
            parents.append(".".join(parts))
    return max(parents, key=lambda p: p.count("."), default="" if modules else None)
