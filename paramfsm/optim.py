"""Optimizers built over a sharded model's own parameters step its shards.

``torch.optim.AdamW(model.parameters())`` is how most training code builds an
optimizer, Hugging Face's Trainer included (param groups from
``model.named_parameters()``, weight decay chosen by name). After
``paramfsm.shard`` those parameters are empty between iterations and their
gradients live on the shards, so stepping them would silently change nothing.

One global optimizer step pre-hook (registered by the first ``paramfsm.shard``)
maps them instead: the first time an optimizer steps, every partitioned
parameter in its param groups is replaced by that parameter's shard, in place,
keeping each group's options (lr, weight decay, betas, ...). After that the
optimizer *is* an optimizer over shards: ``zero_grad``, LR schedulers and
``state_dict()`` / ``load_state_dict()`` work as usual. Until it first steps,
``zero_grad()`` already reaches the shard gradients through the parameters'
``.grad`` (see :mod:`paramfsm.engine.partitioned`).

State the optimizer holds for a parameter it is about to map:

* shard-shaped (``load_state_dict`` of a checkpoint saved from a mapped
  optimizer, before the first step) moves to the shard;
* anything else (the optimizer stepped the full parameters before ``shard``)
  cannot be mapped without guessing, so the step raises
  :class:`OptimizerStateMismatch` naming the parameter.

[Note: mapping cost]
The hook runs on every ``step()`` of every optimizer in the process. An
optimizer that has been scanned is remembered with its number of param groups
and the sharding generation (bumped by every ``paramfsm.shard``), so a later
step costs one weak-dictionary lookup; a group added with ``add_param_group``,
or a model sharded after the optimizer first stepped, is mapped at the next step.
"""

from __future__ import annotations

import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from paramfsm.engine.partitioned import OWNERS, record_of
from paramfsm.errors import ParamFSMError

_MAPPED: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, int]]" = weakref.WeakKeyDictionary()
_hook_handle = None
_generation = 0


class OptimizerStateMismatch(ParamFSMError):
    """An optimizer holds state for a full parameter that paramfsm would have to map to its shard."""


def install() -> None:
    """Register the global step pre-hook once per process; called by every ``paramfsm.shard``."""
    global _hook_handle, _generation
    _generation += 1
    if _hook_handle is None:
        _hook_handle = register_optimizer_step_pre_hook(_before_step)


def _before_step(optimizer, args, kwargs) -> None:
    seen = _MAPPED.get(optimizer)
    if seen == (_generation, len(optimizer.param_groups)) or not OWNERS:
        return
    start = seen[1] if seen is not None and seen[0] == _generation else 0
    for group in optimizer.param_groups[start:]:
        params = group["params"]
        if any(record_of(p) is not None for p in params):
            group["params"] = [_shard_for(optimizer, p) for p in params]
    _MAPPED[optimizer] = (_generation, len(optimizer.param_groups))


def map_optimizer(optimizer) -> None:
    """Map ``optimizer`` now rather than at its first step (what the hook does; idempotent)."""
    _before_step(optimizer, (), {})


def _shard_for(optimizer, param):
    rec = record_of(param)
    if rec is None:
        return param
    shard = rec.shard
    state = optimizer.state.pop(param, None)
    if state:
        mismatched = [key for key, value in state.items()
                      if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != shard.shape]
        if mismatched:
            optimizer.state[param] = state
            raise OptimizerStateMismatch(
                f"{type(optimizer).__name__} holds state {mismatched} for the full parameter '{rec.name}' "
                f"(shape {tuple(next(state[k] for k in mismatched).shape)}), but paramfsm steps its shard "
                f"(shape {tuple(shard.shape)}). It stepped before paramfsm.shard partitioned the model. "
                "What to do: create the optimizer after paramfsm.shard (or before its first step), or load "
                "its state from a checkpoint of the sharded run (paramfsm.checkpoint).")
        optimizer.state[shard] = state
    return shard
