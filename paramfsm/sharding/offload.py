"""Offload: shards, their gradients and optimizer state kept in host memory or on disk, paged in when used.

``paramfsm.shard(model, offload=paramfsm.Offload(params="disk", grads="disk", optimizer="disk", path=...))``
keeps every rank's parameter shards, shard gradients and optimizer state in a tier (``"cpu"``:
host memory, pinned when CUDA is available; ``"disk"``: one file per rank
under ``path``) and only a bounded resident set of them in working memory.
Where each value lives is a lifetime of its own, declared in the spec as the
residency machine (``[residency]`` in ``specs/param_lifetime.toml``) and
driven by :mod:`paramfsm.engine.schedule.residency`: traced, replayable and
checked like the parameters' data lifetime. A read of a value that is not
resident is an illegal transition, and a tier copy older than the working
value is refused (:class:`~paramfsm.errors.StaleOffloadCopy`): never a stale value.

``offload=`` takes an :class:`Offload` for every unit, or a predicate
``(unit name, module) -> Offload | None`` to choose per unit (``""`` is the
root), as ``reshard_after_forward`` does. ``Offload(ratio=...)`` offloads the
optimizer state of only that fraction of the units (by shard bytes, in unit
order), as DeepSpeed's ``offload_optimizer.ratio`` does.

The optimizer step over offloaded state runs unit by unit
(:mod:`paramfsm.optim.offload_step`): each unit's shards and optimizer state are
paged in, stepped, written back and released in turn, so an optimizer built
over ``model.parameters()`` keeps working and never needs the whole state at once.

The tier is scratch space, not a checkpoint: ``rt.close()`` pages everything
back in and removes the files; save checkpoints with :mod:`paramfsm.checkpoint`.
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path

import attrs

from paramfsm.engine.effects.paging import Pager
from paramfsm.engine.effects.streams import PAGE, DeviceStreams
from paramfsm.engine.schedule.grad_paging import GradPaging
from paramfsm.engine.schedule.residency import Paged, Residency
from paramfsm.sharding import meta
from paramfsm.engine.storage.tiers import DiskTier, HostTier, RehearsalTier
from paramfsm.errors import ArgumentError, ArgumentTypeError

TIERS = (None, "cpu", "disk")


@attrs.frozen
class Offload:
    """Where a unit's shards and optimizer state live (see the module docstring).

    ``params``, ``grads``, ``optimizer``: None (working memory), ``"cpu"``
    (host memory) or ``"disk"`` (a file per rank under ``path``) for the
    parameter shards, their gradients (paged out once reduced, paged in to
    accumulate into and for the step) and their optimizer state. ``path``: the folder for
    ``"disk"`` (required then; created if missing). ``max_resident_bytes``:
    the most bytes of offloaded values in working memory at once, at least one
    unit's (None: only the values in use and one unit paged in ahead).
    ``pin_memory``: pin the host tier when CUDA is available. ``ratio``: the
    fraction of the units whose optimizer state is offloaded. ``copy_stream``:
    on CUDA, copy between the device and the host tier on a stream of its own,
    so a page-in ahead of use overlaps compute (see [Note: the copy lane] in
    :mod:`paramfsm.engine.effects.paging`); off by default until a GPU run has
    measured it, and nothing to do on the CPU, where a host tier is read in place.
    """

    params: str | None = None
    optimizer: str | None = None
    grads: str | None = None
    path: str | os.PathLike | None = None
    max_resident_bytes: int | None = None
    pin_memory: bool = True
    ratio: float = 1.0
    copy_stream: bool = False

    def __attrs_post_init__(self):
        for name in ("params", "optimizer", "grads"):
            value = getattr(self, name)
            if value not in TIERS:
                raise ArgumentError(f"Offload({name}={value!r}): expected None, 'cpu' or 'disk'")
        if "disk" in (self.params, self.optimizer, self.grads) and self.path is None:
            raise ArgumentError("Offload(...='disk') needs path=: the folder for this run's offload files "
                                "(one per rank, removed by rt.close())")
        if self.path is not None and not isinstance(self.path, (str, os.PathLike)):
            raise ArgumentTypeError(f"Offload(path={self.path!r}): expected a folder path")
        if self.max_resident_bytes is not None and (
                not isinstance(self.max_resident_bytes, int) or isinstance(self.max_resident_bytes, bool)
                or self.max_resident_bytes < 0):
            raise ArgumentError(f"Offload(max_resident_bytes={self.max_resident_bytes!r}): expected None or a "
                                "number of bytes >= 0")
        if not isinstance(self.ratio, (int, float)) or isinstance(self.ratio, bool) or not 0 <= self.ratio <= 1:
            raise ArgumentError(f"Offload(ratio={self.ratio!r}): expected a fraction between 0 and 1")
        if not isinstance(self.copy_stream, bool):
            raise ArgumentTypeError(f"Offload(copy_stream={self.copy_stream!r}): expected True or False")


class OffloadPlan:
    """What one runtime offloads: the residency component, the tiers and which units offload what."""

    def __init__(self, residency: Residency, pagers: dict, optimizer_units: dict, grads: GradPaging | None):
        self.residency, self.pagers = residency, pagers
        self.optimizer_units = optimizer_units  # unit name -> Pager of its optimizer state
        self.grads = grads  # the shard gradients' paging (None: no unit offloads its gradients)

    def memory(self) -> dict[str, int]:
        """Bytes each tier holds, and the bytes of offloaded values now in working memory."""
        held = {f"tier_{where}": 0 for where in ("cpu", "disk")}
        for (where, _), pager in self.pagers.items():
            held[f"tier_{where}"] += pager.tier.nbytes
        held["offload_resident"] = self.residency.resident_bytes
        return held

    def traffic(self) -> dict[str, int]:
        """Bytes read from and written to the tiers so far."""
        return {"read": sum(p.bytes_read for p in self.pagers.values()),
                "written": sum(p.bytes_written for p in self.pagers.values())}

    def close(self, *, strict: bool = True) -> None:
        """Page every value back in, then remove the tiers' files (always; see ``Residency.page_in_all``
        for ``strict``)."""
        try:
            self.residency.page_in_all(strict=strict, also=self.grads.placements() if self.grads else ())
        finally:
            for pager in self.pagers.values():
                pager.close()


def check_offload(offload) -> None:
    if offload is not None and not isinstance(offload, Offload) and not callable(offload):
        raise ArgumentTypeError(f"offload={offload!r}: expected None, a paramfsm.Offload, or a predicate "
                                "(unit name, module) -> Offload | None")


def plan(offload, *, units, index: dict, rank: int, world: int, ctx) -> OffloadPlan | None:
    """Resolve ``offload`` per unit and build the plan (None when nothing is offloaded).

    ``index`` numbers each parameter's record (its slot in the tiers), ``ctx`` is the step context the
    residency shares with the schedule."""
    if offload is None:
        return None
    per_unit = {unit.name: _for_unit(offload, unit) for unit in units}
    chosen = [o for o in per_unit.values() if o is not None]
    if not chosen:
        return None
    bounds = {o.max_resident_bytes for o in chosen}
    if len(bounds) > 1:
        raise ArgumentError(f"offload: units give different max_resident_bytes {sorted(bounds, key=str)}; the "
                            "resident set is one per rank, so give every unit the same bound")
    bound = bounds.pop()
    residency = Residency(ctx, max_resident_bytes=bound)
    pagers: dict = {}

    def pager(where: str, o: Offload, owner: str) -> Pager:
        key = (where, str(Path(o.path).expanduser().resolve()) if where == "disk" else "")
        if key not in pagers:
            if meta.REHEARSING[0]:  # a memory plan's rehearsal: sizes only, nothing allocated or written
                tier = RehearsalTier(where, rank)
            elif where == "disk":
                tier = DiskTier(o.path, rank, owner)
            else:
                tier = HostTier(rank, o.pin_memory)
            pagers[key] = Pager(tier, rank, _copy_lane(units, o))
        return pagers[key]

    try:
        return _build(units, index, world, per_unit, residency, pagers, pager, bound)
    except BaseException:
        residency.page_in_all(strict=False)  # shards already paged out come back before their tier goes
        for made in pagers.values():
            made.close()
        raise


def _build(units, index, world, per_unit, residency, pagers, pager, bound) -> OffloadPlan:
    grad_pagers: dict = {}
    for unit in units:
        o = per_unit[unit.name]
        if o is None or (o.params is None and o.grads is None):
            continue
        _check_bound(bound, unit)
        if o.grads is not None:
            for rec in unit.records:
                grad_pagers.setdefault(rec, pager(o.grads, o, rec.name))
        if o.params is None:
            continue
        if world == 1:
            raise ArgumentError(
                f"offload params={o.params!r} for unit '{unit.name}': on one rank a parameter is a view of its "
                "shard, so the shard cannot leave working memory. What to do: offload the optimizer state "
                "(Offload(optimizer=...)), or shard over two or more ranks.")
        for rec in unit.records:
            if rec in residency.shards:
                continue
            residency.shards[rec] = Paged(rec.name, unit.name, "shard", _shard_values(rec, index[id(rec)]),
                                          pager(o.params, o, rec.name), index[id(rec)])
    optimizer_units = _optimizer_units(units, per_unit, pager)
    grads = GradPaging(residency, grad_pagers, index) if grad_pagers else None
    result = OffloadPlan(residency, pagers, optimizer_units, grads)
    for p in list(residency.shards.values()):
        residency.add(p)
    return result


def _for_unit(offload, unit):
    if isinstance(offload, Offload):
        return offload
    name = "" if unit.name == "<root>" else unit.name
    chosen = offload(name, unit.module)
    if chosen is not None and not isinstance(chosen, Offload):
        raise ArgumentTypeError(f"offload predicate returned {chosen!r} for unit '{unit.name}': expected a "
                                "paramfsm.Offload or None")
    return chosen


def _check_bound(bound, unit) -> None:
    shard_bytes = sum(rec.shard.numel() * rec.shard.element_size() for rec in unit.records)
    if bound is not None and bound < shard_bytes:
        raise ArgumentError(
            f"Offload(max_resident_bytes={bound}) is smaller than unit '{unit.name}' ({shard_bytes} bytes of "
            "shards on this rank, first parameter "
            f"'{unit.records[0].name if unit.records else '?'}'): a unit in use must fit. What to do: raise "
            "the bound to at least the largest unit's shard bytes, or split that unit (units=).")


def _optimizer_units(units, per_unit, pager) -> dict:
    """Unit name -> the pager of its optimizer state, for the first ``ratio`` of the units by bytes."""
    chosen = [(unit, per_unit[unit.name]) for unit in units
              if per_unit[unit.name] is not None and per_unit[unit.name].optimizer is not None]
    total = sum(unit.nbytes for unit, _ in chosen)
    result, placed = {}, 0
    for unit, o in chosen:
        if placed < o.ratio * total or o.ratio == 1:
            if o.ratio > 0 and unit.records:
                result[unit.name] = pager(o.optimizer, o, unit.records[0].name)
        placed += unit.nbytes
    return result


def _copy_lane(units, o: Offload):
    """The copy lane of a host tier (``Offload(copy_stream=True)`` on CUDA), or None."""
    devices = {rec.shard.device for unit in units for rec in unit.records}
    if not o.copy_stream or len(devices) != 1 or next(iter(devices)).type != "cuda":
        return None
    return DeviceStreams(next(iter(devices)), lanes=(PAGE,))


def _shard_values(rec, index):
    key = (index, "shard")
    return lambda: ((key, rec.shard),)


def optimizer_placement(plan_: OffloadPlan, optimizer, rec, unit_name: str, index: int):
    """The placement of ``rec``'s optimizer state in ``optimizer`` (None when not offloaded or no state).

    A new placement is added to the residency (DIRTY: its values are written to the tier before they are
    dropped). One whose tensors the optimizer no longer holds (``optimizer.load_state_dict`` replaced them)
    is forgotten and made again from the new tensors, so the old tier copy is never read into them (see
    [Note: a placement stands for the tensors it was made for])."""
    residency = plan_.residency
    key = (id(optimizer), rec)
    p = residency.optim.get(key)
    if p is not None and p.values() and residency.tracks(p):
        return p
    if p is not None:  # its tensors were replaced (optimizer.load_state_dict): the old tier copy is stale
        residency.renew([p])
        del residency.optim[key]
    if unit_name not in plan_.optimizer_units:
        return None
    state = optimizer.state.get(rec.shard)
    if not state:
        return None
    values = _state_values(optimizer, rec, index)
    if not values():
        return None
    p = residency.optim[key] = Paged(rec.name, unit_name, "optim", values, plan_.optimizer_units[unit_name],
                                     key)
    return residency.add(p)


def _state_values(optimizer, rec, index):
    """The ``values`` of a placement of ``rec``'s optimizer state: the tensors the optimizer holds now, and
    afterwards those same tensors only, while it still holds exactly them.

    [Note: a placement stands for the tensors it was made for]
    ``optimizer.load_state_dict`` (torch's own) replaces the state tensors between two steps. The
    schedule notices at the next step (:func:`optimizer_placement`), but a page-in ahead of use may step
    the old placement before that: the backward's last unit pages in the first unit's step values. Were
    ``values`` to read the optimizer's state as it is now, that page-in would read the old tier copy into
    the new, loaded tensors, and the step would run on the state the load replaced, silently. So a
    placement keeps weak references to the tensors it was made for and gives them while the optimizer
    still holds exactly them; once one is replaced it gives nothing, and effects on it touch nothing,
    as a shard gradient's placement does after ``zero_grad`` (``grad_paging``).
    """
    def now():
        current = optimizer.state.get(rec.shard, {})
        return tuple(((id(optimizer), index, name), t) for name, t in current.items()
                     if hasattr(t, "dim") and t.dim() > 0)
    made = tuple((key, weakref.ref(t)) for key, t in now())

    def values():
        held = dict(now())
        out = tuple((key, ref()) for key, ref in made)
        if len(held) != len(out) or any(t is None or held.get(key) is not t for key, t in out):
            return ()
        return out
    return values
