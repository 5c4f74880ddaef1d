"""Freezing and unfreezing between iterations: a record's flag, its shard's and its gradient hooks follow."""

from __future__ import annotations

from paramfsm.engine.events import hooks
from paramfsm.engine.storage import partitioned


def apply_requires_grad_changes(mine: set, emit) -> None:
    """Freezing or unfreezing since the last root forward: the shard and the gradient hooks follow.

    [Note: requires_grad changes apply at the next root forward]
    User code flips ``requires_grad`` between iterations (gradual unfreezing).
    The record's flag decides whether pre-backward takes a gradient hold and
    whether the gradient hooks exist, so the scheduler applies changes once per
    iteration, at the root forward's start, where no backward is in progress.
    The shard's flag follows, so an optimizer treats the shard as plain torch
    treats the parameter. Callers check ``REQUIRES_GRAD_CHANGED`` first, so the
    common case costs one truth test.
    """
    changed = [rec for rec in partitioned.REQUIRES_GRAD_CHANGED if rec in mine]
    partitioned.REQUIRES_GRAD_CHANGED.difference_update(changed)
    for rec in changed:
        wanted = partitioned.real_requires_grad(rec.param)
        rec.requires_grad = wanted
        rec.shard.requires_grad_(wanted)
        if wanted:
            hooks.watch_grads(rec, emit)
        else:
            hooks.unwatch_grads(rec)
