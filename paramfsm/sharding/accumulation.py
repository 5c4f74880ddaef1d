"""Gradient accumulation with one reduce-scatter per optimizer step: ``rt.no_sync()`` and its relatives.

By default every backward reduce-scatters its gradients into the shard
gradients, so K micro-batches cost K reduce-scatters per bucket. Under
``rt.no_sync()`` (DDP's and FSDP1's name) or after
``rt.set_requires_gradient_sync(False)`` (FSDP2's), backward keeps each
parameter's full gradient on this rank, summed over the micro-batches
(:mod:`paramfsm.engine.effects.grad_sync`; the spec's ``grad_kept`` / ``grad_sync``
events), and the first backward with sync on reduce-scatters the sum once::

    for i, batch in enumerate(micro_batches):
        with rt.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
            loss_fn(model(batch)).backward()
    opt.step(); opt.zero_grad()

``rt.sync_gradients()`` reduce-scatters explicitly (e.g. when every
micro-batch ran under ``no_sync``). The price is memory: one full gradient
per parameter stays alive between micro-batches.

What needs the synchronised gradient refuses to run on an unsynchronised one,
with :class:`~paramfsm.errors.UnsyncedGradients` and nothing changed: an
optimizer step (over this model's parameters or shards), ``rt.clip_grad_norm_``,
``paramfsm.amp.GradScaler.unscale_``, ``rt.full_grad`` and ``rt.close()``.
``zero_grad`` between micro-batches drops what was accumulated, as in plain
torch. Checkpoints (``rt.sharded_state_dict``, ``rt.full_state_dict``) hold
parameters and optimizer state, never gradients, as in plain torch, so they
may be taken inside ``no_sync``: they save the parameters as they are, and the
kept gradients stay for the next backward.
"""

from __future__ import annotations

import contextlib

from paramfsm.engine.effects.grad_sync import UNSYNCED
from paramfsm.errors import ParamFSMError


@contextlib.contextmanager
def no_sync(rt):
    """Backward passes inside keep their gradients on this rank; sync is restored (not run) on exit."""
    grads = rt.grads
    before = grads.sync
    grads.sync = False
    try:
        yield
    finally:
        grads.sync = before


def set_requires_gradient_sync(rt, requires_gradient_sync: bool) -> None:
    """Turn the reduce-scatter of gradients at the end of backward on or off (FSDP2's switch)."""
    if not isinstance(requires_gradient_sync, bool):
        raise ParamFSMError(f"rt.set_requires_gradient_sync({requires_gradient_sync!r}): expected True or False")
    rt.grads.sync = requires_gradient_sync


def sync_gradients(rt) -> None:
    """Reduce-scatter every gradient kept under ``no_sync`` into the shard gradients now. Collective.

    Every rank calls it, between backward passes. It sends every parameter of
    the units a backward reached under ``no_sync`` since the last
    synchronisation, zeros where this rank kept none (see [Note: ranks
    synchronise the same parameters] in :mod:`paramfsm.engine.effects.grad_sync`), and
    nothing when no such backward ran.
    """
    if rt.grads.backward_running():
        raise ParamFSMError("rt.sync_gradients() was called inside a backward (from a hook?); call it between "
                            "backward passes, on every rank")
    unsynced = rt.unsynced
    lost = [rec for rec in unsynced.pending() if unsynced.entries[rec].grad is None]
    if lost:
        unsynced.refuse("rt.sync_gradients()", lost)
    with rt._reporting():
        rt.grads.sync_kept(force=True)


def require_synced(rt, what: str) -> None:
    """Raise UnsyncedGradients naming the first parameter of ``rt`` whose gradient is not synchronised."""
    unsynced = rt.unsynced
    if unsynced:
        unsynced.refuse(what)


def refuse_step(optimizer) -> None:
    """The optimizer step check: never step a parameter whose gradient is unsynchronised or lost."""
    params = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for store in list(UNSYNCED):
        chosen = [rec for rec in store.pending() if id(rec.shard) in params or id(rec.param) in params]
        if chosen:
            store.refuse(f"{type(optimizer).__name__}.step()", chosen)
