"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), reloadable at any world size.

Each rank saves only its shards, and a checkpoint saved on N ranks loads on M.
:func:`save` is atomic (the previous checkpoint at ``path`` survives a crash at
any moment; :mod:`paramfsm.checkpoint.folders`), can run in the background
(``async_save=True``; :mod:`paramfsm.checkpoint.background`) and prunes old
checkpoints (``keep_last=``); :func:`latest` finds the newest complete one.
:func:`load` checks every key and shape before it writes anything
(:mod:`paramfsm.checkpoint.saving`; under offload it streams unit by unit,
:mod:`paramfsm.checkpoint.streamed_load`). The sharded state dicts they build
on are :mod:`paramfsm.checkpoint.state_dicts`, in the standard layout of
:mod:`paramfsm.checkpoint.layout`. DCP itself is imported only when a
checkpoint is saved or loaded, so ``import paramfsm`` does not pay for it.

This module is the face only: every name here is defined in one of those.
"""

from paramfsm.checkpoint.background import SaveHandle
from paramfsm.checkpoint.folders import latest
from paramfsm.checkpoint.saving import load, save
from paramfsm.checkpoint.state_dicts import (
    LAYOUTS, OPTIM_PREFIX, flat_dtensor, load_sharded_optim_state_dict, load_sharded_state_dict,
    sharded_optim_state_dict, sharded_state_dict,
)

__all__ = ["LAYOUTS", "OPTIM_PREFIX", "SaveHandle", "flat_dtensor", "latest", "load", "load_sharded_optim_state_dict",
           "load_sharded_state_dict", "save", "sharded_optim_state_dict", "sharded_state_dict"]
