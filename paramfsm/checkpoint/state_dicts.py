"""Sharded state dicts of a runtime's model and optimizer, in the standard DCP layout or the flat one.

:func:`sharded_state_dict` and :func:`sharded_optim_state_dict` give views of
this rank's shards (and optimizer state shaped like them) that DCP saves and
loads in place; :func:`load_sharded_state_dict` and
:func:`load_sharded_optim_state_dict` copy a loaded dict into the shards.
:mod:`paramfsm.checkpoint.saving` builds ``save`` and ``load`` on them.
[Note: the flat DTensor view of a shard]
A rank's shard is its 1/world slice of the flattened parameter, zero-padded
to a multiple of world. Seen as the flattened, *unpadded* parameter of
``numel`` elements, rank r holds elements ``[r*s, min((r+1)*s, numel))``
with ``s = ceil(numel / world)``, which is exactly the chunk
``DTensor``'s ``Shard(0)`` gives rank r on a 1-D mesh. Checkpoints saved
before the standard layout hold every parameter this way, as a 1-D tensor of
``(numel,)``; :func:`paramfsm.checkpoint.load` still reads them
(:func:`flat_dtensor`), key by key, whatever layout each key was saved in.

Checkpoints are saved in the standard layout: every tensor with its model
shape, this rank's range cut into rectangular pieces (see
[Note: a flat slice as rectangular pieces] in :mod:`paramfsm.checkpoint.layout`),
so they load without paramfsm (plain ``dcp.load``, FSDP2, ``dcp_to_torch_save``).
Keys are the model's own ``state_dict`` keys (a tied parameter appears under
each of its names, like in ``model.state_dict()``). Buffers are plain
(replicated) tensors.

Optimizer state (``save``/``load`` with ``optimizer=``) works the same way
for every state tensor shaped like its shard (Adam's moments, SGD's momentum),
saved with its parameter's shape under ``optim.<param name>.<state key>``;
other entries (``step``) are saved as plain tensors, identical on all ranks.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from paramfsm import optim
from paramfsm.sharding import meta
from paramfsm.checkpoint import layout as model_layout
from paramfsm.checkpoint import paged_pieces
from paramfsm.core.spec import State
from paramfsm.engine.storage.partitioned import record_of
from paramfsm.errors import ArgumentError, ParamFSMError

OPTIM_PREFIX = "optim."


def _mesh(rt) -> tuple[DeviceMesh, list]:
    """The mesh the flat DTensors live on, and their placements.

    One process group: a 1-D mesh over it, ``[Shard(0)]``. Hybrid sharding: the
    runtime's 2-D ``(replicate, shard)`` mesh, ``[Replicate(), Shard(0)]``, so
    DCP saves each shard once however many replicas hold it.
    """
    if rt.mesh is not None:
        return rt.mesh, [Replicate(), Shard(0)]
    group = rt.group if rt.group is not None else dist.group.WORLD
    device = next(iter(rt._by_id.values())).shard.device.type
    return DeviceMesh.from_group(group, device), [Shard(0)]


def flat_dtensor(rt, rec, tensor: torch.Tensor, where=None) -> DTensor:
    """The valid part of a shard-shaped tensor as its chunk of the flat ``(numel,)`` DTensor: the layout of
    checkpoints saved before model shapes, read by :func:`paramfsm.checkpoint.load`. ``where``: ``_mesh(rt)``,
    made once by a caller that converts many tensors."""
    start, stop = model_layout.valid_range(rt, rec)
    local = tensor.detach()[: stop - start]
    mesh, placements = where if where is not None else _mesh(rt)
    return DTensor.from_local(local, mesh, placements, run_check=False,
                              shape=torch.Size((rec.numel,)), stride=(1,))


def _require_idle(rt, what: str) -> None:
    rt.flush()
    rt.scheduler.release_forward_holds()  # units kept for a backward: see paramfsm.engine.schedule.reshard
    busy = [rec.name for rec in rt._by_id.values() if rec.state is not State.NOT_AVAILABLE]
    if busy:
        raise ParamFSMError(f"cannot {what} while parameters are gathered: {busy[:5]}; "
                            "call it between iterations (after the final backward and optimizer step)")


def _announce_write(rt, why: str) -> None:
    """Every shard is about to be written: no full copy gathered before may be read again."""
    records = tuple(rt._by_id.values())
    rt.scheduler.shards_written(records, records, why)


LAYOUTS = ("flat", "model")


def _check_layout(value) -> None:
    if value not in LAYOUTS:
        raise ArgumentError(f"layout={value!r}: expected 'model' (every tensor with its model shape, this rank's "
                            "pieces: the standard DCP layout) or 'flat' (1-D DTensors of (numel,))")


def _shaped(rt, rec, tensor: torch.Tensor, where, streaming: bool = False):
    """``tensor`` in the model layout (``where`` None) or as a flat DTensor on ``where`` (``_mesh(rt)``).
    ``streaming``: for a save only, an offloaded tensor as pieces read when DCP writes them ([Note: a save
    streams through the tier]); a load into those would fill copies, so loads never ask for them."""
    if where is not None:
        return flat_dtensor(rt, rec, tensor, where)
    paged = paged_pieces.pieces(rt, rec, tensor) if streaming else None
    return paged if paged is not None else model_layout.model_shaped(rt, rec, tensor)


def sharded_state_dict(rt, layout: str = "model") -> dict:
    """The model's state dict with every parameter viewing this rank's shard.

    ``layout="model"`` (the default): the parameter's model shape, as the
    rectangular pieces this rank holds
    (:class:`paramfsm.checkpoint.layout.ShardPieces`); a DCP checkpoint of it
    is an ordinary checkpoint of the model, the layout :func:`save` writes.
    ``layout="flat"``: a 1-D ``Shard(0)`` DTensor of ``(numel,)`` per
    parameter, the layout of the first releases.
    Save either with ``torch.distributed.checkpoint.save``; load a checkpoint
    of any world size into it with ``torch.distributed.checkpoint.load`` (in
    place: the values are views of the shards), or pass a loaded dict to
    :func:`load_sharded_state_dict`.
    """
    return _model_state(rt, layout)


def _model_state(rt, layout: str, streaming: bool = False, stand_ins: bool = False) -> dict:
    """:func:`sharded_state_dict`; ``streaming``: as :func:`paramfsm.checkpoint.save` asks for it (``_shaped``);
    ``stand_ins``: every shard as a meta tensor of its shape, for a load under offload to check keys and
    shapes and build its staging from, paging nothing in."""
    _check_layout(layout)
    where = _mesh(rt) if layout == "flat" else None
    out = {}
    for key, value in rt.model.state_dict(keep_vars=True).items():
        rec = rt._by_id.get(id(value))
        if rec is None:
            out[key] = value.detach()
            continue
        out[key] = _shaped(rt, rec, _stand_in(rec.shard) if stand_ins else rec.shard, where, streaming)
    return out


def _stand_in(tensor: torch.Tensor) -> torch.Tensor:
    """A meta tensor of ``tensor``'s shape and dtype: its metadata, read without paging its values in."""
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")


def _records_by_key(rt) -> dict:
    """State-dict key -> the parameter's record (``None`` for a buffer)."""
    return {key: rt._by_id.get(id(value)) for key, value in rt.model.state_dict(keep_vars=True).items()}


def load_sharded_state_dict(rt, state_dict) -> None:
    """Copy a state dict shaped like :func:`sharded_state_dict` (either layout) into the shards and buffers."""
    _require_idle(rt, "load a sharded state dict")
    recs = _records_by_key(rt)
    missing = [k for k in recs if k not in state_dict]
    if missing:
        raise ParamFSMError(f"sharded state dict is missing keys {missing[:5]}")
    _announce_write(rt, "rt.load_sharded_state_dict()")
    with meta.setting_values(rt, "rt.load_sharded_state_dict"):
        write_model_values(rt, recs, state_dict)


def write_model_values(rt, recs: dict, state_dict) -> None:
    """Copy ``state_dict``'s values of the keys in ``recs`` (key -> record, ``None`` for a buffer) into the
    shards and buffers: :func:`load_sharded_state_dict`'s writes, and a streamed load's one unit at a time."""
    buffers = {k: v.detach() for k, v in rt.model.state_dict(keep_vars=True).items() if recs.get(k, 0) is None}
    where = None  # the flat DTensors' mesh, made at the first one
    with torch.no_grad():
        for key, rec in recs.items():
            src = state_dict[key]
            if rec is None:
                dst = buffers[key]
            elif isinstance(src, model_layout.ShardPieces):
                model_layout.write_shard(rt, rec, rec.shard, src, key)
                continue
            else:
                where = where if where is not None else _mesh(rt)
                target = flat_dtensor(rt, rec, rec.shard, where)
                if not isinstance(src, DTensor) or src.shape != target.shape:
                    raise ParamFSMError(f"'{key}': expected a DTensor of shape {tuple(target.shape)} or pieces of "
                                        f"shape {tuple(rec.shape)} (from rt.sharded_state_dict()), got "
                                        f"{type(src).__name__} {tuple(getattr(src, 'shape', ()))}")
                if src.placements != target.placements or src.device_mesh != target.device_mesh:
                    src = src.redistribute(target.device_mesh, target.placements)
                dst, src = target.to_local(), src.to_local()
            if dst.data_ptr() != src.data_ptr():
                dst.copy_(src)


def _optim_names(rt, optimizer) -> dict[int, str]:
    """Optimizer parameter index (as in ``optimizer.state_dict()``) -> qualified parameter name."""
    by_shard = {id(rec.shard): rec for rec in rt._by_id.values()}
    by_shard.update({id(rec.param): rec for rec in rt._by_id.values()})  # a whole-parameter optimizer's
    names, index = {}, 0
    for group in optimizer.param_groups:
        for param in group["params"]:
            rec = by_shard.get(id(param))
            if rec is None:
                raise ParamFSMError("the optimizer holds a tensor that is not a shard or a parameter of this "
                                    "runtime; build it on rt.shard_parameters() or model.parameters()")
            names[index] = rec
            index += 1
    return names


def _init_optim_state(optimizer, rt=None) -> None:
    """Create the optimizer's state tensors (one zero-gradient step that leaves shards unchanged). Under
    ``rt``'s offload, one unit at a time, so the shards and new state stream through the tier."""
    optim.map_optimizer(optimizer)  # a new optimizer over model.parameters() is mapped at its first step
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if all(optimizer.state.get(p) for p in params):
        return
    # A whole-parameter optimizer holds the parameters: their shards take the zero gradients and the step.
    shards = [rec.shard if rec is not None else p for p, rec in zip(params, map(record_of, params))]
    if getattr(rt, "offload", None) is None:
        _zero_step(optimizer, shards)
        return
    grads = [(p, p.grad) for p in shards]
    for p in shards:
        p.grad = None
    try:
        for unit in rt.units:
            mine = {id(rec.shard) for rec in unit.records}
            with rt.scheduler.shard_scope(unit.records, write=True):
                _zero_step(optimizer, [p for p in shards if id(p) in mine and not optimizer.state.get(p)])
    finally:
        for p, grad in grads:
            p.grad = grad


def _zero_step(optimizer, shards) -> None:
    """A step of ``optimizer`` with zero gradients on ``shards`` (and none elsewhere), their values kept."""
    if not shards:
        return
    saved = [(p, p.detach().clone(), p.grad) for p in shards]
    for p in shards:
        p.grad = torch.zeros(p.shape, dtype=p.dtype, device=p.device)
    optimizer.step()
    with torch.no_grad():
        for p, value, grad in saved:
            p.copy_(value)
            p.grad = grad


def sharded_optim_state_dict(rt, optimizer, layout: str = "model") -> dict:
    """The optimizer's state keyed ``optim.<param name>.<state key>``; shard-shaped tensors in ``layout``
    (as in :func:`sharded_state_dict`), other entries as they are."""
    return _optim_state(rt, optimizer, layout)


def _optim_state(rt, optimizer, layout: str, streaming: bool = False, stand_ins: bool = False) -> dict:
    """:func:`sharded_optim_state_dict`; ``streaming`` and ``stand_ins`` as in :func:`_model_state`."""
    _check_layout(layout)
    where = _mesh(rt) if layout == "flat" else None
    recs = _optim_names(rt, optimizer)
    whole = not optim.is_elementwise(optimizer)  # its state is of whole parameters (paramfsm.optim.whole_params)
    state = optimizer.state_dict()
    out = {}
    for index, entries in state["state"].items():
        rec = recs[index]
        for key, value in entries.items():
            name = f"{OPTIM_PREFIX}{rec.name}.{key}"
            if isinstance(value, torch.Tensor) and value.shape == rec.shard.shape and not whole:
                out[name] = _shaped(rt, rec, _stand_in(value) if stand_ins else value, where, streaming)
            else:  # a scalar, or a whole-parameter optimizer's state: the same on every rank
                out[name] = value
    groups = []
    for group in state["param_groups"]:
        groups.append({k: (v if k != "params" else [recs[i].name for i in v]) for k, v in group.items()})
    out[f"{OPTIM_PREFIX}param_groups"] = groups
    return out


def load_sharded_optim_state_dict(rt, optimizer, state_dict) -> None:
    """Load an optimizer state saved by :func:`sharded_optim_state_dict` (at any world size)."""
    _init_optim_state(optimizer)
    write_optim_values(rt, optimizer, state_dict)
    write_param_groups(optimizer, state_dict)


def write_optim_values(rt, optimizer, state_dict, records=None, names=None) -> None:
    """Copy ``state_dict``'s optimizer state into ``optimizer``'s (built by :func:`_init_optim_state`), for
    every parameter, or for those whose record is in ``records`` (a streamed load's unit; ``names``: its
    :func:`_optim_names`, made once for all units)."""
    recs = names if names is not None else _optim_names(rt, optimizer)
    whole = not optim.is_elementwise(optimizer)  # its state is of whole parameters (paramfsm.optim.whole_params)
    with torch.no_grad():
        for rec in recs.values():
            if records is not None and rec not in records:
                continue
            key_tensor = rec.param if whole else rec.shard
            entries = optimizer.state[key_tensor]
            if any(f"{OPTIM_PREFIX}{rec.name}.{key}" not in state_dict for key in entries):
                del optimizer.state[key_tensor]  # saved without state: it starts without, as in plain torch
                continue
            for key in list(entries):
                name = f"{OPTIM_PREFIX}{rec.name}.{key}"
                src = state_dict[name]
                if isinstance(entries[key], torch.Tensor) and entries[key].shape == rec.shard.shape and not whole:
                    model_layout.write_shard(rt, rec, entries[key], src, name)
                elif isinstance(entries[key], torch.Tensor):
                    entries[key].copy_(src)
                else:
                    entries[key] = src


def write_param_groups(optimizer, state_dict) -> None:
    """The saved hyperparameters (learning rate, betas, ...) into ``optimizer``'s groups."""
    for group, saved in zip(optimizer.param_groups, state_dict[f"{OPTIM_PREFIX}param_groups"]):
        group.update({k: v for k, v in saved.items() if k != "params"})


def _dcp_group(rt):
    """Every rank takes part in a DCP save or load: with a 2-D mesh, the default group spanning it."""
    return None if rt.mesh is not None else rt.group
