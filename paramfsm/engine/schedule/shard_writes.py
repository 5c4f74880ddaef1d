"""Shard writes: what happens to gathered copies when a parameter's shard changes, or is written back.

A shard is the one true value of a partitioned parameter; every full copy is
gathered from it. Four things write shards from outside the lifetime: an
optimizer step, a load (``rt.load_full_state_dict``,
``rt.load_sharded_state_dict``, ``paramfsm.checkpoint.load``) and
``rt.init_weights``. Each of them first emits ``SHARDS_WRITTEN`` naming the
parameters, and the spec's ``shard_written`` rows decide what becomes of the
copies (see the comment above ``[machine]`` in ``specs/param_lifetime.toml``):

* a deferred copy (kept for a later backward over a retained graph) or an
  unused prefetch is dropped, so the next use gathers the new values; this
  is the GAN loop's case (a retained backward, a step of ``D``, a new
  forward of ``D`` on the retained activations);
* a unit that a forward kept gathered for its backward
  (``reshard_after_forward=False``) is released first, here, so it behaves
  like any other unit;
* a copy someone holds (inside ``rt.gathered()``) is refused with
  :class:`~paramfsm.errors.IllegalTransition` before anything is written.

[Note: a write bumps the parameter's version]
Plain torch's optimizer writes the parameter in place, which bumps its
version counter, and autograd refuses a backward that needs a saved tensor
whose version moved ("modified by an inplace operation"). Here the optimizer
writes the shard, a different tensor, so the parameter's counter would stay
put and a backward over a graph recorded before the step would silently use
the re-gathered new values. So the parameters a write changes have their
version bumped (``torch.autograd.graph.increment_version``, one C call for
all of them): autograd then raises exactly where plain torch raises, and
nowhere else. An optimizer step changes only parameters that have a
gradient (every ``torch.optim`` optimizer skips the others), so only those
are bumped; a graph over a frozen or untouched part stays usable, as in
plain torch. Their copies are still dropped: a re-gather costs a
collective, a stale copy would cost a silent wrong result.

``WRITTEN_BACK`` is the other direction: ``rt.gathered(writeback=True)``
found full copies changed in place (see :mod:`paramfsm.sharding.gathered`), and the
``written_back`` rows copy each rank's slice of the held copy into its shard.
"""

from __future__ import annotations

from torch.autograd.graph import increment_version

from paramfsm.core.spec import State
from paramfsm.errors import IllegalTransition


class ShardWrites:
    """The scheduler's handling of ``SHARDS_WRITTEN`` and ``WRITTEN_BACK`` (see the module docstring).

    It owns no state: it is given the scheduler's step, a way to release the
    units a forward kept for its backward, and nothing else.
    """

    __slots__ = ("_step", "_release_kept")

    def __init__(self, step, release_kept):
        self._step, self._release_kept = step, release_kept

    def written(self, ev) -> None:
        """Drop the copies the write makes stale, or refuse it while a copy is held; bump versions."""
        records = ev.records
        self._release_kept({unit for rec in records for unit in rec.units})
        for rec in records:
            if rec.state is not State.NOT_AVAILABLE:
                try:
                    self._step(rec, "shard_written")
                except IllegalTransition as err:
                    raise IllegalTransition(
                        param=err.param, unit=err.unit, state=err.state, event=err.event, rank=err.rank,
                        reason=f"{ev.why} would write its shard: {err.reason}", holds=err.holds,
                        history=err.history,
                        hint=f"What to do: leave `with rt.gathered(...)` before {ev.why} (the optimizer step, "
                             "load or init writes the shards; the block would keep showing the old values), "
                             "and call it between iterations, not inside forward or backward.") from None
        if ev.changed:
            increment_version([rec.param for rec in ev.changed])

    def written_back(self, ev) -> None:
        """Copy each held full copy's slice into this rank's shard (the ``write_back`` effect)."""
        for rec in ev.records:
            self._step(rec, "written_back")
