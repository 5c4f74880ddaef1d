"""PEFT adapters (LoRA and others) on a model sharded by :func:`paramfsm.shard`: saving them.

Shard the ``PeftModel`` itself (``rt = paramfsm.shard(get_peft_model(base, config))``):
adapters added after ``shard()`` would be parameters it does not know.
Training needs nothing more; an optimizer over the trainable parameters steps
their shards, as for any model.

Saving does. PEFT's ``model.save_pretrained(d)`` reads ``model.state_dict()``,
whose tensors hold no values between iterations, and raises ``NotGathered``.
:func:`save_adapter` gathers the trainable parameters only (the adapter: a few
MB, where the frozen base model can be many GB) and hands them to PEFT's own
``save_pretrained``, which keeps the adapter's keys and writes the same files
as a plain PEFT model: ``PeftModel.from_pretrained(base, d)`` loads them
without paramfsm. :func:`trainable_state_dict` is the gathering step alone.
Both are collective: every rank calls them.

An adapter whose saved tensors are not all trainable parameters (VeRA's shared
random projections, saved as buffers with ``save_projection=True``) needs the
whole state dict: ``save_adapter(rt, d, state_dict=rt.full_state_dict(rank0_only=True))``
on every rank.

[Note: PEFT lists some keys from the live module]
PEFT takes the tensors from the state dict it is given, but for its
auxiliary training wrappers (``modules_to_save``'s ``ModulesToSaveWrapper``,
trainable tokens) it lists which keys to take by calling ``state_dict()`` on
the live wrapped module. On a sharded model that call reads placeholders and
raised ``NotGathered`` on rank 0, while the other ranks waited in the barrier.
So every rank holds those wrappers' units gathered, read-only, while rank 0
writes: collective, and only the wrappers' units (a task head or an output
layer), never the whole model.
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch
import torch.distributed as dist

from paramfsm.errors import ParamFSMError
from paramfsm.sharding.rank_errors import agreed

logger = logging.getLogger(__name__)


def trainable_state_dict(rt, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """The full tensors of the model's trainable parameters, under their state-dict keys. Collective.

    Every rank gathers the same parameters in the same order (a parameter's
    ``requires_grad`` must agree across ranks, as it must for training). Tied
    keys of one parameter share one tensor. ``rank0_only=True``: rank 0 gets
    the tensors on the CPU and the other ranks an empty dict; every rank still
    takes part in each gather.
    """
    keep = not rank0_only or _global_rank(rt) == 0
    out: dict[str, torch.Tensor] = {}
    done: dict[int, torch.Tensor | None] = {}  # id(parameter) -> its full tensor (None: gathered, not kept)
    for key, value in rt.model.state_dict(keep_vars=True).items():
        if not (isinstance(value, torch.nn.Parameter) and value.requires_grad):
            continue
        if id(value) not in done:
            full = rt.full_param(value) if _partitioned(rt, value) else value.detach().clone()
            done[id(value)] = (full.to("cpu") if rank0_only else full) if keep else None
        if keep:
            out[key] = done[id(value)]
    return out


def save_adapter(rt, directory, **kwargs) -> None:
    """Save the adapter of the sharded ``PeftModel`` as ``model.save_pretrained(directory)`` would. Collective.

    Every rank gathers the trainable parameters (:func:`trainable_state_dict`);
    global rank 0 writes ``adapter_model.safetensors`` and ``adapter_config.json``
    with PEFT's own ``save_pretrained(directory, state_dict=..., **kwargs)``
    (``selected_adapters=``, ``safe_serialization=`` and the rest pass
    through); then every rank waits for the files, so any rank can read them
    once this returns, and a write that fails on rank 0 raises on every rank. ``state_dict=``: the tensors to save instead of the
    trainable parameters, on rank 0 (``rt.full_state_dict(rank0_only=True)``,
    called on every rank, for an adapter that also saves buffers).
    """
    save = getattr(rt.model, "save_pretrained", None)
    if save is None or not hasattr(rt.model, "peft_config"):
        raise ParamFSMError(f"save_adapter: the sharded {type(rt.model).__name__} is not a PEFT model (rank "
                            f"{rt.rank}); shard the PeftModel (paramfsm.shard(get_peft_model(base, config))), or "
                            "save a plain model with save_pretrained(d, state_dict=rt.full_state_dict(rank0_only=True))")
    given = kwargs.pop("state_dict", None)
    if given is None and not any(p.requires_grad for p in rt.model.parameters()):  # alike on every rank
        raise ParamFSMError(f"save_adapter: '{type(rt.model).__name__}' has no trainable parameter to save (rank "
                            f"{rt.rank}); an adapter is saved from its trainable parameters (was the model frozen "
                            "after get_peft_model?)")
    state_dict = given if given is not None else trainable_state_dict(rt, rank0_only=True)
    wrappers = _listing_wrappers(rt.model)
    with rt.gathered(*wrappers, writeback=False) if wrappers else contextlib.nullcontext():
        # Every rank waits for rank 0's files, and raises with it when it fails ([Note: an error one rank meets]).
        with agreed(None, f"save_adapter to '{directory}'"):
            if _global_rank(rt) == 0:
                logger.info("writing %d adapter tensors to %s", len(state_dict), directory)
                save(os.fspath(directory), state_dict=state_dict, **kwargs)


def _listing_wrappers(model) -> list:
    """The PEFT modules whose saving calls ``state_dict()`` on the live module (see [Note: PEFT lists some
    keys from the live module])."""
    try:
        from peft.utils.other import AuxiliaryTrainingWrapper
    except ImportError:  # a PEFT before the auxiliary wrappers: ModulesToSaveWrapper alone
        from peft.utils.other import ModulesToSaveWrapper as AuxiliaryTrainingWrapper
    return [m for m in model.modules() if isinstance(m, AuxiliaryTrainingWrapper)]


def _partitioned(rt, parameter) -> bool:
    """Whether the runtime partitions ``parameter`` (one it keeps whole has no record)."""
    try:
        rt.record(parameter)
    except ParamFSMError:
        return False
    return True


def _global_rank(rt) -> int:
    """The writer's rank: rank 0 of the default group (of the whole mesh under hybrid sharding)."""
    return dist.get_rank() if dist.is_initialized() else rt.rank
