"""This rank's unsynchronised full gradients: the ``keep_grad`` and ``sync_grad`` effects (``rt.no_sync``).

While gradient sync is off, the scheduler steps ``grad_kept`` instead of
``grad_ready`` (see the spec's header): autograd's full gradient leaves the
parameter at once, as always, but into :class:`UnsyncedGrads` instead of a
reduce bucket, and later backward passes add to it. It is reduce-scattered
once: folded into the parameter's next ``reduce_grad`` (the first backward
with sync on), or by ``sync_grad`` (the end of that backward, for parameters
it did not reach, and ``rt.sync_gradients()``). So K micro-batches cost one
reduce-scatter per bucket, at the price of one full gradient per parameter.

[Note: the shard gradient stands for the kept one]
``zero_grad`` must drop an accumulated gradient, as plain torch does, but it
only reaches the shard gradients (``shard.grad = None``, or zeroing them in
place). So when a parameter's first unsynchronised gradient is kept, its
shard gradient is made to exist (zeros when it had none: adding the reduced
sum to zeros later is exact) and the kept entry remembers that tensor and its
version. A shard gradient that is another object, or was zeroed in place,
since then means ``zero_grad`` ran: the entry is dropped before anything uses
it. A shard gradient changed in place to anything but zeros (clipping a
partial gradient) cannot be honoured and raises :class:`UnsyncedGradients`.
Plain torch also shows a non-None ``.grad`` after such a backward.

[Note: ranks synchronise the same parameters]
Ranks whose graphs differ inside a unit (a mixture of experts made one unit)
keep different parameters: an expert that got no tokens on a rank has no
gradient there. A backward with sync on sends every parameter of each unit it
reaches in the unit's order, zeros where it has none, kept sums folded in
(see [Note: a unit's gradients go out in the unit's order] in
paramfsm.engine.schedule.grad_order), so the ranks pair the same parameters. What is
synchronised without such a backward (``rt.sync_gradients()``, or units the
synchronising backward did not reach) follows the same rule: the units a
backward reached under no_sync are remembered (``reached``, which the ranks
agree on whenever they agree on which units run), and each of their
parameters goes out in model order, the kept sum or zeros flagged as no
gradient here, never only the parameters this rank happens to keep.

[Note: an interrupted accumulation is never stepped]
An interrupted backward contributes nothing to shard gradients (see
``Executor.abort_reduces``). A kept gradient it already added to, or one
whose reduce-scatter it had taken, would so be partial: such an entry is
marked lost (its memory freed), and every later use of the gradient raises
until ``zero_grad`` drops it. Silently stepping without those micro-batches
is the one outcome ruled out.
"""

from __future__ import annotations

import weakref

import torch

from paramfsm.engine.effects.grad_flags import staged
from paramfsm.engine.storage.partitioned import real_grad, set_real_grad
from paramfsm.errors import UnsyncedGradients

#: Stores holding at least one entry (the optimizer step check reads it; empty costs one truth test).
UNSYNCED: "weakref.WeakSet[UnsyncedGrads]" = weakref.WeakSet()


class Kept:
    """One parameter's unsynchronised gradient (None once lost) and the shard gradient that stands for it."""

    __slots__ = ("grad", "token", "version")

    def __init__(self, grad, token):
        self.grad, self.token, self.version = grad, token, token._version


class UnsyncedGrads:
    """Record -> :class:`Kept`, for one executor; see the module docstring."""

    def __init__(self, executor):
        self.executor = executor
        self.entries: dict = {}
        self.touched: set = set()  # kept into since the last completed backward
        self.syncing: set = set()  # taken into a reduce bucket that has not completed yet
        self.reached: dict = {}  # units a backward reached under no_sync, not sent since ([Note: ranks ...])

    def __bool__(self) -> bool:
        return bool(self.entries)

    @property
    def nbytes(self) -> int:
        return sum(k.grad.numel() * k.grad.element_size() for k in self.entries.values() if k.grad is not None)

    # ------------------------------------------------------------------ effects
    def keep(self, records) -> None:
        """The keep_grad effect: add each parameter's autograd gradient to its unsynchronised one."""
        dtype = self.executor.reduce_dtype
        for rec in records:
            grad = real_grad(rec.param)
            if grad is None:
                continue
            set_real_grad(rec.param, None)
            kept = self._current(rec)
            self.touched.add(rec)
            if kept is not None:
                if kept.grad is not None:
                    kept.grad.add_(grad.detach())
                continue
            owned = not grad.requires_grad and (dtype is None or grad.dtype == dtype)
            grad = grad if owned else grad.detach().to(dtype or grad.dtype, copy=True)
            shard = rec.shard
            if shard.grad is None:  # see [Note: the shard gradient stands for the kept one]
                shard.grad = torch.zeros_like(shard)
            self.entries[rec] = Kept(grad, shard.grad)
            UNSYNCED.add(self)

    def fold(self, rec, grad):
        """For ``reduce_grad``: the new gradient plus the kept one, which leaves the store."""
        kept = self._current(rec)
        if kept is None or kept.grad is None:
            return grad
        del self.entries[rec]
        self.syncing.add(rec)
        if not self.entries:
            UNSYNCED.discard(self)
        return kept.grad.add_(grad.detach())

    def due(self) -> list:
        """The records to synchronise, in an order every rank shares: each parameter that requires grad of
        the units a backward reached under no_sync, in model order (see [Note: ranks synchronise the same
        parameters]), then any other kept one, first kept first."""
        out = []
        if not self.executor.local:
            for unit in sorted(self.reached, key=lambda u: u.index):
                out += [rec for rec in unit.records if rec.requires_grad and staged(rec)]
        chosen = set(out)
        return out + [rec for rec in self.pending(lost=False) if rec not in chosen]

    def sync(self, records) -> None:
        """The sync_grad effect: queue each kept gradient for reduce-scatter; a parameter of a reached unit
        goes out in its unit's way, its kept sum or zeros flagged as no gradient here (lost ones stay, to
        raise)."""
        executor = self.executor
        for rec in records:
            if staged(rec) and not executor.local:
                executor.take_ordered([(rec, None)])  # zeros, with the kept sum folded in (Executor._take)
                continue
            kept = self._current(rec)
            if kept is None or kept.grad is None:
                continue
            del self.entries[rec]
            self.syncing.add(rec)
            self.executor.queue_grad(rec, kept.grad, True)
        if not self.entries:
            UNSYNCED.discard(self)

    # ------------------------------------------------------------------ bookkeeping
    def settled(self) -> None:
        """Every reduce-scatter completed at the end of a backward (or of rt.sync_gradients)."""
        self.touched.clear()
        self.syncing.clear()

    def interrupted(self) -> None:
        """A backward was interrupted: see [Note: an interrupted accumulation is never stepped]."""
        for rec in self.touched | self.syncing:
            kept = self.entries.get(rec)
            token = kept.token if kept is not None else rec.shard.grad
            if token is not None:
                self.entries[rec] = Kept(None, token)
                UNSYNCED.add(self)
        self.touched.clear()
        self.syncing.clear()

    def pending(self, lost: bool = True) -> list:
        """The records whose unsynchronised gradient is still alive (after dropping zeroed ones), in the
        order they were first kept (the same on every rank); ``lost=False`` leaves lost ones out."""
        return [rec for rec in list(self.entries)
                if (kept := self._current(rec)) is not None and (lost or kept.grad is not None)]

    def drop(self) -> None:
        """Forget every entry (rt.detach)."""
        self.entries.clear()
        self.reached.clear()
        UNSYNCED.discard(self)

    def _current(self, rec):
        """``rec``'s entry, or None after dropping it when zero_grad ran since it was kept."""
        kept = self.entries.get(rec)
        if kept is None:
            return None
        token = kept.token
        grad = rec.shard.grad
        if grad is token and token._version == kept.version:
            return kept
        if grad is token and bool(token.any()):
            raise UnsyncedGradients(
                param=rec.name, unit=rec.unit, rank=self.executor.rank, what="accumulating gradients",
                detail="is not synchronised yet, but its shard gradient was changed in place (clipped or "
                       "scaled?) after a backward under rt.no_sync(). Such a change would apply to a partial "
                       "gradient. What to do: change gradients after the last micro-batch's backward, "
                       "outside no_sync (or after rt.sync_gradients()).")
        del self.entries[rec]
        if not self.entries:
            UNSYNCED.discard(self)
        return None

    def refuse(self, what: str, records=None) -> None:
        """Raise :class:`UnsyncedGradients` for the first of ``records`` (default: any) still unsynchronised."""
        chosen = self.pending() if records is None else [r for r in records if r in self.entries]
        for rec in chosen:
            kept = self._current(rec)
            if kept is None:
                continue
            if kept.grad is None:
                detail = ("is lost: a backward under rt.no_sync() (or the one that was to synchronise it) was "
                          "interrupted by an exception, so its accumulated micro-batches are incomplete. "
                          "What to do: call zero_grad() and run those micro-batches again.")
            else:
                detail = ("is not synchronised: backward ran under rt.no_sync() (or with "
                          "rt.set_requires_gradient_sync(False)), so each rank holds only its own micro-batches' "
                          "sum. What to do: run the last micro-batch's backward outside no_sync, or call "
                          "rt.sync_gradients() on every rank first (or zero_grad() to drop the gradients).")
            raise UnsyncedGradients(param=rec.name, unit=rec.unit, rank=self.executor.rank, what=what,
                                    detail=detail)
