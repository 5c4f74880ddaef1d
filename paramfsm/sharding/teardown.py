"""Handing a model back: ``rt.close()`` restores plain full parameters, ``rt.detach()`` just lets go.

Both remove every hook and forget the model, so it can be sharded again.
``close`` is collective (it all-gathers every parameter and gradient);
``detach`` issues no collective, for recovery after a peer rank failed.
"""

from __future__ import annotations

import sys

from torch import nn

from paramfsm.sharding import accumulation, conversions, full_state, model_changes
from paramfsm.sharding.assembly import PARTITIONED, SHARDED
from paramfsm.engine.events import hooks
from paramfsm.engine.storage import partitioned, placeholder


def remove_hooks(rt) -> None:
    for handle in rt._handles:
        handle.remove()
    rt._handles = []
    for rec in rt._by_id.values():
        hooks.unwatch_grads(rec)


def _forget(rt) -> None:
    """Stop the scheduler and trace and drop the model from the registries."""
    rt.scheduler.close()
    model_changes.forget(rt._watch, rt.model)
    rt.unsynced.drop()
    rt.trace.close()
    SHARDED.pop(rt.model, None)
    conversions.unguard(rt.model)
    for rec in rt._by_id.values():
        PARTITIONED.pop(rec.param, None)
    placeholder.forget_demands(rt._by_id.values())
    saves = sys.modules.get("paramfsm.checkpoint.background")
    if saves is not None:
        saves.release_group(rt)


def _page_in(rt, strict: bool = True) -> None:
    """Bring every offloaded value back into working memory and remove the tiers' files."""
    plan, rt.offload = getattr(rt, "offload", None), None
    if plan is not None:
        plan.close(strict=strict)


def detach(rt) -> None:
    """Remove every hook and forget the model; parameters stay as they are (their shards are lost)."""
    _page_in(rt, strict=False)  # detach follows failures: it must not raise
    remove_hooks(rt)
    for rec in rt._by_id.values():
        partitioned.release(rec.param)
    _forget(rt)


def close(rt) -> nn.Module:
    """All-gather every parameter and gradient, restore them as plain tensors, remove every hook."""
    if rt.scheduler.closed:
        return rt.model
    saves = sys.modules.get("paramfsm.checkpoint.background")  # imported by a save: none made, none to wait for
    if saves is not None:
        saves.settle(rt, "rt.close()")  # an asynchronous save still writing from the shards' staged copy
    accumulation.require_synced(rt, "rt.close()")  # it would hand back a partial .grad
    rt.flush()
    _page_in(rt)
    with rt._reporting():
        fulls = {id(rec): full_state.gather(rt, rec, rec.shard) for rec in rt._by_id.values()}
        grads = {id(rec): full_state.gather(rt, rec, rec.shard.grad, full_state.GRADIENT)
                 for rec in rt._by_id.values() if rec.shard.grad is not None}
    remove_hooks(rt)
    _forget(rt)
    for rec in rt._by_id.values():
        placeholder.reveal(rec.param)
        partitioned.release(rec.param)
        rec.param.data = fulls[id(rec)]
        if id(rec) in grads:
            rec.param.grad = grads[id(rec)]
    return rt.model
