"""Models built on the meta device: where their shards go, their buffers, and a guard until their values are set.

``with torch.device("meta"): model = build()`` allocates nothing; then
``paramfsm.shard(model, device=...)`` gives each rank only its shards, on
``device`` (:func:`placement`), and the parameters stay empty until
``rt.init_weights()`` (:mod:`paramfsm.init_weights`) or a load
(``rt.load_full_state_dict``, ``paramfsm.integrations.hf.load_pretrained``,
``rt.load_sharded_state_dict``) sets them.

Buffers are not sharded: every rank holds them whole. A meta buffer is
allocated on ``device`` at ``shard``, uninitialised; a buffer already off the
meta device (``accelerate.init_empty_weights()`` keeps buffers on the CPU) is
moved to ``device`` with its values.

[Note: the values guard]
A shard made from a meta parameter holds whatever the allocator left there.
Training on it would be a silent wrong result, so until the values are set a
forward of the root module raises :class:`~paramfsm.errors.ParamFSMError`
saying what to call. The same guard comes back when a load or
``init_weights`` fails part-way, so a half-loaded model is never trained on.
A meta buffer counts as set once anything writes it in place (its version
counter moves: ``reset_parameters``, ``fn``, a load, or a plain
``model.buf.copy_(...)``) or replaces it; the guard names those still unset.
"""

from __future__ import annotations

import contextlib
import os
from functools import partial
from typing import Iterator

import torch
from torch import nn

from paramfsm.errors import ParamFSMError


#: Set while :mod:`paramfsm.planning.rehearsal` shards a meta model onto meta shards (nothing allocated).
REHEARSING = [False]


@contextlib.contextmanager
def rehearsing() -> Iterator[None]:
    """Within the block, ``shard(meta_model, device="meta")`` keeps the shards on the meta device: the memory
    plan's rehearsal of a step (:mod:`paramfsm.planning.rehearsal`), which allocates nothing."""
    REHEARSING[0] = True
    try:
        yield
    finally:
        REHEARSING[0] = False


def assume_values(rt) -> None:
    """A rehearsal's meta shards have no values to set: drop the values guard (see [Note: the values guard])."""
    values = rt._values
    values.unset, values.buffers = None, []
    _check(values)


def placement(model: nn.Module, device, mesh=None) -> tuple[torch.device, bool]:
    """``(device of the shards, whether the model was built on meta)`` for ``paramfsm.shard(model, device=)``.

    A model off the meta device keeps its device, and a ``device`` that contradicts
    it is refused. A meta model's shards go on ``device``; without one, on the
    mesh's device type, else the current CUDA device when CUDA is available,
    else the CPU.
    """
    named = list(model.named_parameters())
    meta = [name for name, p in named if p.is_meta]
    if meta and len(meta) < len(named):
        real = next(f"'{name}' on {p.device}" for name, p in named if not p.is_meta)
        raise ParamFSMError(f"parameter '{meta[0]}' is on the meta device but {real}: build the whole model "
                            "on the meta device (with torch.device('meta'): ...) or none of it, then paramfsm.shard")
    if not meta:
        devices = {p.device for _, p in named}
        if len(devices) > 1:
            raise ParamFSMError(f"the model's parameters are on several devices ({sorted(map(str, devices))}); "
                                "move the whole model to one device (model.to(device)) before paramfsm.shard")
        current = devices.pop() if devices else torch.device("cpu")
        if device is not None and not same_device(current, torch.device(device)):
            raise ParamFSMError(f"paramfsm.shard(device={str(device)!r}): the model's parameters are on {current}. "
                                "device= places the shards of a model built on the meta device; move this model "
                                f"(model.to({str(device)!r})) before sharding it, or leave device= out")
        return current, False
    if device is None:
        device = default_device(mesh)
    device = torch.device(device)
    if device.type == "meta" and not REHEARSING[0]:
        raise ParamFSMError("paramfsm.shard(device='meta'): the shards need a real device ('cuda', 'cpu', ...)")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device, True


def default_device(mesh=None) -> torch.device:
    """Where a meta model's shards go when ``device=`` is not given (see :func:`placement`)."""
    if mesh is not None:
        kind = mesh.device_type
        return torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else torch.device(kind)
    if not torch.cuda.is_available():
        return torch.device("cpu")
    current, count, local = torch.cuda.current_device(), torch.cuda.device_count(), os.environ.get("LOCAL_RANK")
    if count > 1 and local is not None and local.isdigit() and int(local) != 0 and current == 0:
        raise ParamFSMError(
            f"paramfsm.shard of a model on the meta device: device= is missing and cannot be inferred on local rank "
            f"{local}: its current CUDA device is cuda:0, rank 0's device ({count} GPUs here), so every rank "
            "would put its shards there. Call torch.cuda.set_device(local_rank) before paramfsm.shard, or pass "
            "device= (e.g. device=f'cuda:{local_rank}')")
    return torch.device("cuda", current)


def same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return a.index is None or b.index is None or a.index == b.index
    current = torch.cuda.current_device()
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)


#: The guard's advice while a meta-built model has no values yet.
NO_VALUES_YET = ("rt.init_weights() (or rt.init_weights(fn)), or load weights "
                 "(paramfsm.integrations.hf.load_pretrained(rt, path), rt.load_full_state_dict(sd), "
                 "rt.load_sharded_state_dict(sd)) on every rank first")


class Values:
    """What of a sharded model's values is not set (see [Note: the values guard])."""

    __slots__ = ("unset", "advice", "buffers", "handle")

    def __init__(self):
        self.unset: str | None = None  # why the parameters hold no values; None once they do
        self.advice = NO_VALUES_YET  # the guard's "What to do"
        self.buffers: list[tuple[str, nn.Module, str, torch.Tensor, int]] = []  # meta buffers not written yet
        self.handle = None  # the guard's forward pre-hook while one is needed


def watch(rt, born_meta: bool, device: torch.device) -> None:
    """For a meta-built model, materialise its buffers and start the guard over ``rt._values``."""
    if born_meta:
        rt._values.buffers = materialise_buffers(rt.model, device)
        rt._values.unset = "the model was built on the meta device and its parameters have no values yet"
        _guard_on(rt)


def materialise_buffers(model: nn.Module, device: torch.device) -> list:
    """Give every buffer storage on ``device``; returns the formerly meta ones (name, module, key, tensor, version)."""
    done: dict[int, torch.Tensor] = {}
    fresh = []
    for prefix, module in model.named_modules():
        for key, buf in list(module._buffers.items()):
            if buf is None:
                continue
            new = done.get(id(buf))
            if new is None:
                if buf.is_meta:
                    new = torch.empty_like(buf, device=device)
                    fresh.append((f"{prefix}.{key}" if prefix else key, module, key, new, new._version))
                else:
                    new = buf.to(device)
                done[id(buf)] = new
            module._buffers[key] = new
    return fresh


def unset_buffers(values: Values) -> list[str]:
    """Names of the meta-built buffers nothing has written yet (forgetting those that were)."""
    values.buffers = [entry for entry in values.buffers
                      if entry[1]._buffers.get(entry[2]) is entry[3] and entry[3]._version == entry[4]]
    return [entry[0] for entry in values.buffers]


@contextlib.contextmanager
def setting_values(rt, what: str):
    """Around a write of every parameter's values (init or load): the guard holds until it completes."""
    values = rt._values
    values.unset = f"{what} failed part-way, so the parameters hold a mix of old and new values"
    values.advice = (f"run {what} again, or load a good checkpoint (paramfsm.checkpoint.load, "
                     "rt.load_full_state_dict(sd)), on every rank before training; not rt.init_weights(), "
                     "which would replace trained weights")
    _guard_on(rt)
    yield
    values.unset = None
    values.advice = NO_VALUES_YET
    _check(values)


def _guard_on(rt) -> None:
    values = rt._values
    if values.handle is None:
        values.handle = rt.model.register_forward_pre_hook(partial(_guard, values), prepend=True)
        rt._handles.append(values.handle)


def _check(values: Values) -> None:
    """Drop the guard once every value is set."""
    if values.unset is None and not unset_buffers(values) and values.handle is not None:
        values.handle.remove()
        values.handle = None


def _guard(values: Values, module, args) -> None:
    if values.unset is not None:
        raise ParamFSMError(f"forward of the sharded {type(module).__name__}: {values.unset}. "
                            f"What to do: {values.advice}")
    names = unset_buffers(values)
    if names:
        raise ParamFSMError(
            f"forward of the sharded {type(module).__name__}: buffers {names[:5]} were built on the meta device "
            "and nothing has set them (a buffer the model computes itself, such as rotary frequencies, is not in "
            "a checkpoint and no reset_parameters() writes it). What to do: set them in their module's "
            "reset_parameters() or in rt.init_weights(fn), or write them in place on every rank "
            "(model.<path>.copy_(values))")
    _check(values)
