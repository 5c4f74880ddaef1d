"""``save`` and ``load``: staged, atomic, checked against the checkpoint before anything is written.

Every failure is agreed among the ranks (:func:`_agree`), so each rank
raises the same :class:`~paramfsm.errors.ParamFSMError` instead of one rank
raising while the others wait in a collective. DCP's own
``CheckpointException`` (a ``BaseException``, which ``except Exception``
misses) never leaves these functions.
"""

from __future__ import annotations

import copy
import logging
import os
import shutil
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from paramfsm.checkpoint import state_dicts as ck
from paramfsm.sharding import memory as runtime_memory
from paramfsm.sharding import meta, rank_errors
from paramfsm.checkpoint import background, folders, layout, streamed_load
from paramfsm.errors import ArgumentError, ParamFSMError

logger = logging.getLogger(__name__)


def _agree(group, error: str | None) -> None:
    """Raise on every rank of ``group`` when any rank has an error (the lowest such rank's, naming it)."""
    found = rank_errors.agree(group, error)
    if found is not None:
        raise ParamFSMError(f"{found[1]} (rank {found[0]})")


def _describe(exc: BaseException) -> str:
    """One line for a failure, DCP's per-rank ``CheckpointException`` unpacked to its first rank's error."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        rank = min(failures)
        inner = failures[rank][0] if isinstance(failures[rank], tuple) else failures[rank]
        return f"rank {rank}: {_describe(inner)}"
    if isinstance(exc, OSError) and exc.strerror:
        return f"{type(exc).__name__}: {exc.strerror}" + (f" ('{exc.filename}')" if exc.filename else "")
    return f"{type(exc).__name__}: {exc}"


def _errors():
    """What a DCP call may raise: any Exception, and DCP's CheckpointException (a BaseException)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def _model_shapes(rt) -> dict[str, tuple[int, ...]]:
    """Every state-dict key of the model with its shape in the model (not the flat saved shape)."""
    out = {}
    for key, value in rt.model.state_dict(keep_vars=True).items():
        rec = rt._by_id.get(id(value))
        out[key] = tuple(rec.shape) if rec is not None else tuple(value.shape)
    return out


def _writer(folder: Path):
    """DCP's file writer into ``folder``, passing the named points of a save (:func:`folders.reach`).

    The class is made at each call, inside it because DCP is imported by the first save, not with paramfsm;
    making it costs microseconds beside a save's file writes, and no state is kept between saves.
    """
    from torch.distributed.checkpoint import FileSystemWriter

    class StagingWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            written = super().write_data(plan, planner)
            folders.reach("data_written")
            return written

        def finish(self, metadata, results) -> None:
            folders.reach("metadata")
            super().finish(metadata, results)

    return StagingWriter(str(folder))


def _check_keep_last(keep_last) -> None:
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ArgumentError(f"paramfsm.checkpoint.save(keep_last={keep_last!r}): expected a whole number >= 1 "
                            "(the newest checkpoints to keep in the parent folder), or None to keep them all")


def save(rt, path, optimizer=None, *, keep_last: int | None = None, async_save: bool = False,
         extra_files: dict[str, bytes] | None = None):
    """Save the model's shards (and the optimizer's, if given) to the checkpoint folder ``path``. Collective.

    Atomic: the files are written beside ``path`` and replace it only once
    every rank has written and the metadata is complete, so a crash at any
    moment leaves the previous checkpoint at ``path`` loadable (see
    [Note: an atomic save] in :mod:`paramfsm.checkpoint.folders`).
    ``keep_last=N`` then removes all but the newest N checkpoints that
    paramfsm saved in ``path``'s parent folder. ``async_save=True`` copies the
    shards and returns a :class:`SaveHandle` at once; the files are written in
    the background (see [Note: what an asynchronous save runs where]). A save
    first waits for the runtime's previous asynchronous save. A failure raises
    ParamFSMError on every rank, naming the path; ``path`` is then unchanged.
    ``extra_files`` (``{file name: bytes}``, rank 0's are used) are written into
    the checkpoint folder with the shards, inside the same atomic swap: a
    framework's own state (Lightning's loops and callbacks) is never newer or
    older than the shards beside it.
    """
    _check_keep_last(keep_last)
    extra = folders.check_extra_files(extra_files)
    background.settle(rt, "save")
    runtime_memory.phase(rt, "checkpoint")  # rt.peak_memory()'s phases
    ck._require_idle(rt, "save a sharded checkpoint")
    path = Path(os.path.abspath(path))
    group = ck._dcp_group(rt)
    # A synchronous save reads offloaded values piece by piece as DCP writes them; an asynchronous one copies
    # everything first anyway (see [Note: a save streams through the tier]).
    state = ck._model_state(rt, "model", streaming=not async_save)
    if optimizer is not None:
        state.update(ck._optim_state(rt, optimizer, "model", streaming=not async_save))
    shapes = {key: list(shape) for key, shape in _model_shapes(rt).items()}
    token = _prepare(group, path)
    folders.reach("prepared")
    if not async_save:
        _write(state, path, token, group, shapes, optimizer is not None, keep_last, extra)
        return None
    staged, nbytes = background.stage(state)
    del state
    writes_on = background.background_group(rt, group)
    write = partial(_write, staged, path, token, writes_on, shapes, optimizer is not None, keep_last, extra)
    del staged  # the thread's reference is the only one: released when the write ends
    handle = background.SaveHandle(path, nbytes, write)
    background.start(rt, handle)
    return handle


def _prepare(group, path: Path) -> str:
    """Rank 0 cleans leftovers and makes the staging folder; every rank gets its token or raises its error."""
    message: list = [None, None]
    if dist.get_rank(group) == 0:
        token = folders.new_token()
        try:
            folders.prepare(path, token)
            message = [token, None]
        except ParamFSMError as exc:
            message = [None, str(exc)]
        except OSError as exc:
            message = [None, f"paramfsm.checkpoint.save: cannot prepare '{path}' ({_describe(exc)}); nothing "
                             "was written. What to do: check that its parent is a writable folder"]
    dist.broadcast_object_list(message, group=group, group_src=0)
    token, error = message
    if error is not None:
        raise ParamFSMError(f"{error} (rank {dist.get_global_rank(group, 0) if group is not None else 0})")
    return token


def _write(state, path: Path, token: str, group, shapes, with_optimizer: bool, keep_last, extra=None) -> None:
    """Write ``state`` into the staging folder, then rank 0 commits it to ``path`` (and prunes). Collective."""
    from torch.distributed.checkpoint import save as dcp_save

    folder = folders.staging(path, token)
    error, committed = None, False
    folders.reach("writing")
    try:
        dcp_save(state, storage_writer=_writer(folder), process_group=group)
        folders.reach("written")
    except _errors() as exc:
        error = _describe(exc)
    is_first = dist.get_rank(group) == 0
    if is_first and error is None:
        try:
            folders.write_extra_files(folder, extra or {})
            folders.write_manifest(folder, shapes, dist.get_world_size(group), with_optimizer)
            folders.reach("manifest_written")
            folders.commit(path, token)
            committed = True
            if keep_last is not None:
                folders.prune(path.parent, keep_last, token)
        except (OSError, ParamFSMError) as exc:
            error = str(exc) if isinstance(exc, ParamFSMError) else _describe(exc)
    if is_first and not committed:
        shutil.rmtree(folder, ignore_errors=True)
    outcome = [committed]
    dist.broadcast_object_list(outcome, group=group, group_src=0)
    if error is not None:
        error = (f"paramfsm.checkpoint.save to '{path}' failed: {error}. "
                 + (f"'{path}' holds the new checkpoint; removing older ones (keep_last={keep_last}) failed"
                    if outcome[0] else
                    f"'{path}' was not replaced: it still holds the previous checkpoint, if there was one, and "
                    "training can continue. What to do: " + _advice(error)))
    _agree(group, error)


def _advice(error: str) -> str:
    """What to do after a failed save: a plan DCP refused is a wrong state dict, anything else the folder."""
    if "validate global plan" in error:
        return ("the pieces the ranks offered do not tile each tensor (a bug in how the sharded state dict was "
                "built, not in the folder); report it with this message. Saving again will fail the same way")
    return "check that the folder is writable with free space, then save again"


def load(rt, path, optimizer=None) -> None:
    """Load a checkpoint saved by :func:`save` on any number of ranks. Collective.

    Every key and shape is checked against the checkpoint's metadata first,
    and the files are read into a staging copy (one copy of this rank's shards
    and optimizer state) that is copied into the shards only once every read
    succeeded: a checkpoint that does not fit, or fails to read, raises
    ParamFSMError on every rank and leaves the model and optimizer unchanged.
    Under offload the load streams unit by unit through the tier instead, and
    a read that fails part-way leaves the forward refused until a load
    completes (:mod:`paramfsm.checkpoint.streamed_load`).
    """
    from torch.distributed.checkpoint import load as dcp_load

    background.settle(rt, "load")
    ck._require_idle(rt, "load a sharded checkpoint")
    path = Path(os.path.abspath(path))
    group = ck._dcp_group(rt)
    folder, error = path, None
    try:
        folder = folders.readable(path)
        metadata = folders.read_metadata(folder).state_dict_metadata
    except ParamFSMError as exc:
        error = str(exc)
    _agree(group, error)
    streams = getattr(rt, "offload", None) is not None  # [Note: a load under offload streams through the tier]
    own = _as_saved(rt, ck._model_state(rt, "model", stand_ins=streams), metadata)
    _agree(group, _model_mismatch(own, _model_shapes(rt), metadata, folders.read_manifest(folder), path))
    if optimizer is not None:
        groups = f"{ck.OPTIM_PREFIX}param_groups"
        if not any(key == groups or key.startswith(f"{groups}.") for key in metadata):  # DCP flattens the list
            error = (f"paramfsm.checkpoint.load(optimizer=...): '{path}' was saved without optimizer state; "
                     "nothing was loaded. What to do: load it without optimizer=, or load a checkpoint saved "
                     "with save(rt, path, optimizer=opt)")
        _agree(group, error)
        ck._init_optim_state(optimizer, rt)
        # A parameter without optimizer state when the checkpoint was saved (no gradient yet) has none
        # saved: it is not asked for, and loads as plain torch's load_state_dict leaves it, without state.
        optim_state = ck._optim_state(rt, optimizer, "model", stand_ins=streams)
        wanted = _as_saved(rt, {key: value for key, value in optim_state.items() if key in metadata or key == groups},
                           metadata)
        _agree(group, _shape_mismatch(wanted, metadata, path))
        own.update(wanted)
    device = next(iter(rt._by_id.values())).shard.device

    def read(staged: dict, left: str) -> dict:
        failure = None
        try:
            dcp_load(staged, checkpoint_id=str(folder), process_group=group)
        except _errors() as exc:
            failure = (f"paramfsm.checkpoint.load of '{path}' failed reading its files ({_describe(exc)}); {left}. "
                       "What to do: load another complete checkpoint")
        _agree(group, failure)
        return staged

    if streams:
        def read_keys(keys, left: str) -> dict:
            return read(_empty_like({key: own[key] for key in keys}, device), left)
        streamed_load.load(rt, own, optimizer, read_keys)
        return
    staged = read(_empty_like(own), "the model and optimizer are unchanged")
    ck._announce_write(rt, "paramfsm.checkpoint.load()")
    with meta.setting_values(rt, "paramfsm.checkpoint.load"):
        ck.load_sharded_state_dict(rt, staged)
    if optimizer is not None:
        ck.load_sharded_optim_state_dict(rt, optimizer, staged)


def _as_saved(rt, state: dict, metadata: dict) -> dict:
    """``state`` with each key the checkpoint holds in the flat ``(numel,)`` layout of older saves asked for as
    a flat DTensor (:func:`paramfsm.checkpoint.flat_dtensor`), so such checkpoints still load."""
    by_name = {rec.name: rec for rec in rt._by_id.values()}
    out, where = dict(state), None
    for key, value in state.items():
        if not isinstance(value, layout.ShardPieces):
            continue
        rec, size = by_name[value.key], getattr(metadata.get(key), "size", None)
        if size is not None and tuple(size) == (rec.numel,) != tuple(rec.shape):
            where = where if where is not None else ck._mesh(rt)
            out[key] = ck.flat_dtensor(rt, rec, value.flat, where)
    return out


def _empty_like(state: dict, device=None) -> dict:
    """Tensors to read a checkpoint into, shaped and placed like ``state``'s (see :func:`load`); a meta
    stand-in's (a load under offload) on ``device``."""
    def empty(tensor):
        if tensor.is_meta and device is not None:
            return torch.empty(tensor.shape, dtype=tensor.dtype, device=device)
        return torch.empty_like(tensor)

    out = {}
    for key, value in state.items():
        if isinstance(value, layout.ShardPieces):
            out[key] = value.with_flat(empty(value.flat))
        elif isinstance(value, DTensor):
            out[key] = DTensor.from_local(empty(value.to_local()), value.device_mesh, value.placements,
                                          run_check=False, shape=value.shape, stride=value.stride())
        elif isinstance(value, torch.Tensor):
            out[key] = empty(value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _model_mismatch(own: dict, model_shapes: dict, metadata: dict, manifest, path: Path) -> str | None:
    """The first model key whose presence or shape differs between the model and the checkpoint, or None."""
    saved_shapes = (manifest or {}).get("shapes", {})
    for key, target in own.items():
        entry = metadata.get(key)
        if entry is None:
            return (f"paramfsm.checkpoint.load: '{path}' has no '{key}' (this model's shape "
                    f"{model_shapes[key]}); it was saved from another model. Nothing was loaded")
        size = getattr(entry, "size", None)
        if size is None or tuple(size) != tuple(target.shape):
            saved = "a non-tensor value" if size is None else f"shape {tuple(saved_shapes.get(key, size))}"
            return (f"paramfsm.checkpoint.load: '{key}' has {saved} in '{path}' but shape {model_shapes[key]} "
                    "in this model; it was saved from another model. Nothing was loaded")
        if key in saved_shapes and tuple(saved_shapes[key]) != model_shapes[key]:
            return (f"paramfsm.checkpoint.load: '{key}' has shape {tuple(saved_shapes[key])} in '{path}' but "
                    f"shape {model_shapes[key]} in this model; it was saved from another model. Nothing was "
                    "loaded")
    extra = [key for key in metadata if not key.startswith(ck.OPTIM_PREFIX) and key not in own]
    if extra:
        return (f"paramfsm.checkpoint.load: '{path}' holds '{extra[0]}', which this model does not have "
                f"({len(extra)} such keys); it was saved from another model. Nothing was loaded")
    return None


def _shape_mismatch(wanted: dict, metadata: dict, path: Path) -> str | None:
    """The first optimizer-state tensor whose saved shape differs from this optimizer's, or None."""
    for key, target in wanted.items():
        size = getattr(metadata.get(key), "size", None)
        if isinstance(target, torch.Tensor) and size is not None and tuple(size) != tuple(target.shape):
            return (f"paramfsm.checkpoint.load: optimizer state '{key}' has shape {tuple(size)} in '{path}' but "
                    f"{tuple(target.shape)} here; nothing was loaded")
    return None
