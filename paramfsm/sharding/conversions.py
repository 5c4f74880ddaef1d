"""``model.double()``, ``.half()``, ``.to(dtype or device)`` on a sharded model: refused before anything changes.

Every conversion of a module goes through ``nn.Module._apply(fn)``, which
walks the children first and, in each, converts the parameters and then the
buffers. A partitioned parameter cannot be converted through its module: its
values live on the shards, its optimizer state and the schedule's buffers
have the shard's dtype and device. So the conversion used to fail at the first
partitioned parameter, after every module before it had its buffers
converted: the next forward then failed on a dtype mismatch.

[Note: probing a conversion]
``shard()`` gives each module of the model its own ``_apply`` (an instance
attribute, removed by ``rt.close()`` / ``rt.detach()``). It runs ``fn`` on an
empty tensor of each partitioned parameter's dtype and device first; when
``fn`` would change either, it raises naming the parameter and converts
nothing. A conversion that changes no parameter (``model.float()`` on a float
model, ``model.to(its own device)``, a buffers-only module) runs as torch's.
The check runs once per call, not once per level of the recursion.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from paramfsm.engine.storage.partitioned import owner, record_of
from paramfsm.errors import ConversionRefused

_checking = threading.local()


class _CheckedApply:
    """A module's ``_apply`` while its model is sharded (see [Note: probing a conversion])."""

    __slots__ = ("module",)

    def __init__(self, module: nn.Module):
        self.module = module

    def __call__(self, fn, recurse: bool = True):
        module = self.module
        if getattr(_checking, "active", False):
            return type(module)._apply(module, fn, recurse)
        _refuse_if_changed(module, fn, recurse)
        _checking.active = True
        try:
            return type(module)._apply(module, fn, recurse)
        finally:
            _checking.active = False


def guard(model: nn.Module) -> None:
    """Give every module of ``model`` the checked ``_apply``."""
    for module in model.modules():
        object.__setattr__(module, "_apply", _CheckedApply(module))


def unguard(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module.__dict__.get("_apply"), _CheckedApply):
            del module.__dict__["_apply"]


def _refuse_if_changed(module: nn.Module, fn, recurse: bool) -> None:
    for name, param in module.named_parameters(recurse=recurse):
        rec = record_of(param)
        if rec is None:
            continue
        probe = torch.empty(0, dtype=param.dtype, device=param.device)
        out = fn(probe)
        if out.dtype == probe.dtype and out.device == probe.device:
            continue
        qualified, unit, rank = owner(param)
        holder = qualified.rpartition(".")[0] or "<root>"
        change = (f"its dtype from {probe.dtype} to {out.dtype}" if out.dtype != probe.dtype
                  else f"its device from {probe.device} to {out.device}")
        raise ConversionRefused(
            f"converting {type(module).__name__} refused on rank {rank}: parameter '{qualified}' (module "
            f"'{holder}', unit '{unit}', state {rec.state.name}) is partitioned by paramfsm, and the conversion "
            f"would change {change}. Its values, gradient and optimizer state live on this rank's shard, so "
            "it cannot be converted through its module; nothing was converted. What to do: convert the model "
            "before paramfsm.shard(...); to compute in another precision, keep the parameters as they are and "
            "pass paramfsm.shard(..., param_dtype=torch.bfloat16); or rt.close() first, which hands back a "
            "plain model.")
