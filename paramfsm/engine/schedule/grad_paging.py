"""Offloaded shard gradients: paged out once reduced, paged in to accumulate into and to step.

``paramfsm.Offload(grads="cpu" | "disk")`` keeps a unit's shard gradients
(``shard.grad``, 1/world of the full gradients) in a tier between the backward
that produced them and the optimizer step that reads them. Each one is a
placement of kind ``"grad"`` of the residency machine (``[residency]`` in the
spec), stepped through the runtime's :class:`~paramfsm.engine.schedule.residency.Residency`
like shards and optimizer state, so its moves are traced, replayable and checked.

* A reduce-scatter's result is added into ``shard.grad`` by :meth:`GradPaging.accumulate`: the
  executor hands its reduced shards back (``Executor.hand_back_reduced``) and the schedule adds them,
  with :meth:`GradPaging.opening` first (a shard gradient already there from an earlier backward is
  needed: paged in) and :meth:`GradPaging.closing` after (it is written, and released: with no bound
  on the resident set it is written to its tier and dropped at once). A gradient new to the tier
  gets its placement there. No effect steps a placement.
* The optimizer step (:mod:`paramfsm.optim.offload_step`) needs each unit's shard
  gradients with its shards and optimizer state (:meth:`GradPaging.of`).
* Any other reader (``rt.clip_grad_norm_``, ``GradScaler.unscale_``,
  ``zero_grad(set_to_none=False)``, user code) pages a gradient in on demand,
  as for a shard (:mod:`paramfsm.engine.storage.paged`).

[Note: a placement follows one gradient tensor]
``zero_grad()`` sets ``shard.grad`` to None, and user code may assign another
tensor; neither passes through paramfsm. So a gradient's placement is bound
to the tensor it was made for: its values are that tensor only while it is
still ``shard.grad``, and none afterwards, so a placement left behind can
neither read its old tier copy into a new gradient nor write a new gradient
over it. Such placements are renewed (the residency machine's ``renew``: the
tier copy is of the old value) and forgotten before the next accumulation or
step (:meth:`GradPaging.prune`), and the next gradient gets a placement of its
own, starting where ``renew`` left the value's trace (DIRTY), with a new
version, in the same tier slot.
"""

from __future__ import annotations

import weakref

from paramfsm.engine.effects.shard_grads import accumulate as add_into_shard_grad
from paramfsm.engine.schedule.residency import Paged


class GradPaging:
    """The shard gradients of the records in ``pagers`` (record -> the Pager of its unit's grads tier)."""

    def __init__(self, residency, pagers: dict, index: dict):
        self.residency = residency
        self.pagers = pagers
        self.index = index  # id(record) -> its place in the model (tier keys)
        self.placed: dict = {}  # record -> Paged of its current shard gradient
        # Each gradient's slot is reserved now, sized like its shard (a shard gradient is accumulated in the
        # shard's dtype): a full disk fails at shard(), not in the middle of a backward.
        for rec, pager in pagers.items():
            pager.tier.place(self._key(rec), rec.shard, rec.name)

    # ------------------------------------------------------------------ reduced gradients, added
    def accumulate(self, pieces) -> None:
        """Add the executor's reduced gradient shards (``(record, shard)`` pairs, in the order they completed)
        into the shard gradients: paged in before, written and released after."""
        records = [rec for rec, _ in pieces]
        self.opening(records)
        try:
            for rec, piece in pieces:
                add_into_shard_grad(rec, piece)
        finally:
            self.closing(records)  # a write-back too many is safe; a lost one is not

    def opening(self, records) -> None:
        """Reduced gradients are about to be added into the shard gradients of ``records``."""
        placements = [self._current(rec) for rec in records if rec in self.pagers]
        self.residency.need(placements, ahead=False)

    def closing(self, records) -> None:
        """Reduced gradients were added: each shard gradient is written and released (or placed, if new)."""
        residency, placed = self.residency, self.placed
        written = []
        for rec in records:
            if rec not in self.pagers or rec.shard.grad is None:
                continue
            p = placed.get(rec)
            if p is not None and self._tracks(p, rec):
                written.append(p)
                continue
            if p is not None:
                residency.renew([p])
            placed[rec] = self._place(rec)
        residency.written(written)
        residency.release(written)

    # ------------------------------------------------------------------ the optimizer step's side
    def of(self, records) -> list:
        """The placements of the current shard gradients of ``records`` (None where not offloaded)."""
        return [self._current(rec) for rec in records]

    def placements(self) -> list:
        """Every gradient placement held now (closing pages them back in)."""
        return list(self.placed.values())

    def prune(self) -> None:
        """Forget placements whose gradient is gone (see [Note: a placement follows one gradient tensor])."""
        stale = [rec for rec, p in self.placed.items() if not self._tracks(p, rec)]
        if stale:
            self.residency.renew([self.placed.pop(rec) for rec in stale])

    # ------------------------------------------------------------------ placements
    def _current(self, rec):
        p = self.placed.get(rec)
        if p is None:
            return None
        if self._tracks(p, rec):
            return p
        self.residency.renew([self.placed.pop(rec)])
        return None

    @staticmethod
    def _tracks(p: Paged, rec) -> bool:
        grad = p.tensor()
        return grad is not None and grad is rec.shard.grad

    def _place(self, rec) -> Paged:
        return self.residency.add(grad_placement(rec, self.pagers[rec], self._key(rec)))

    def _key(self, rec) -> tuple:
        return self.index[id(rec)], "grad"


def grad_placement(rec, pager, key) -> Paged:
    """The placement of ``rec``'s shard gradient tensor as it is now (see [Note: a placement follows one
    gradient tensor]): its values are that tensor while it is still ``shard.grad``, and none after."""
    tensor = weakref.ref(rec.shard.grad)
    shard = weakref.ref(rec.shard)

    def values():
        current, owner = tensor(), shard()
        return ((key, current),) if current is not None and owner is not None and current is owner.grad else ()
    return Paged(rec.name, rec.unit, "grad", values, pager, key, tensor)
