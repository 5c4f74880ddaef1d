"""Loading safetensors files into a sharded model, each rank reading only its slice of each tensor.

:func:`load_files` is what :func:`paramfsm.integrations.hf.load_pretrained`
runs. It never holds a whole checkpoint, nor a whole parameter:

1. **Headers first.** Every file's header (names, shapes) is read, and every
   parameter and persistent buffer of the model is matched to one tensor of
   the right shape. A missing key or a wrong shape raises
   :class:`~paramfsm.errors.ParamFSMError` naming the parameter before any
   value is written, so the model keeps the values it had (and a model
   built on the meta device stays guarded, :mod:`paramfsm.meta`).
2. **Then slices, one tensor at a time, one file at a time.** A parameter's
   shard is its slice ``[rank * s, (rank + 1) * s)`` of the flattened tensor.
   safetensors slices by index along dimensions, so the rows of the first
   dimension longer than one that cover that range are read (at most one
   partial row more at each end) and the range is cut from them, straight
   into the shard. Buffers (not sharded) are read whole.

A tied parameter is loaded from the first of its keys the files hold (a
``save_pretrained`` file keeps one). Tensors of the files that the model does
not have are ignored, as ``load_state_dict(strict=False)`` would ignore them,
and logged.
"""

from __future__ import annotations

import logging
import math
import os

import torch

from paramfsm import meta
from paramfsm.core.spec import State
from paramfsm.errors import ParamFSMError

logger = logging.getLogger(__name__)


def headers(files) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Tensor name -> (file, shape), from the files' headers only."""
    from safetensors import safe_open

    found: dict[str, tuple[str, tuple[int, ...]]] = {}
    for path in files:
        with safe_open(path, framework="pt") as handle:
            for key in handle.keys():
                found[key] = (path, tuple(handle.get_slice(key).get_shape()))
    return found


def plan(rt, found: dict, where: str) -> list[tuple[str, str, object, torch.Tensor | None]]:
    """(file, key, record or None, buffer or None) for every parameter and persistent buffer; checks all of them."""
    own = rt.model.state_dict(keep_vars=True)
    names: dict[int, list[str]] = {}
    for key, value in own.items():
        names.setdefault(id(value), []).append(key)
    steps, missing, wrong = [], [], []
    for ident, keys in names.items():
        rec = rt._by_id.get(ident)
        shape = tuple(rec.shape) if rec is not None else tuple(own[keys[0]].shape)
        key = next((k for k in keys if k in found), None)
        if key is None:
            missing.append(" / ".join(keys))
        elif found[key][1] != shape:
            wrong.append(f"'{key}' is {list(found[key][1])} in {os.path.basename(found[key][0])}, "
                         f"the model's {'parameter' if rec is not None else 'buffer'} is {list(shape)}")
        else:
            steps.append((found[key][0], key, rec, None if rec is not None else own[key]))
    if missing or wrong:
        raise ParamFSMError(
            f"cannot load '{where}' into the sharded {type(rt.model).__name__} (rank {rt.rank}); nothing was "
            f"loaded." + (f" No tensor for: {missing[:5]}." if missing else "")
            + (f" Wrong shape: {wrong[:5]}." if wrong else "")
            + " Check that the checkpoint was saved from this model class and config (keys are the model's own "
              "state-dict keys)")
    unused = sorted(set(found) - {key for keys in names.values() for key in keys})
    if unused:
        logger.info("load of %s: %d tensors the model does not have are ignored: %s", where, len(unused), unused[:5])
    return steps


def load_files(rt, files, where: str) -> None:
    """Load safetensors ``files`` into ``rt``'s model, this rank's slices only (see the module docstring)."""
    from safetensors import safe_open

    rt.flush()
    busy = [rec.name for rec in rt._by_id.values() if rec.state is not State.NOT_AVAILABLE]
    if busy:
        raise ParamFSMError(f"cannot load '{where}' while parameters are gathered: {busy[:5]}; "
                            "call it between iterations")
    steps = plan(rt, headers(files), where)
    by_file: dict[str, list] = {}
    for step in steps:
        by_file.setdefault(step[0], []).append(step)
    with meta.setting_values(rt, f"loading '{where}'"), torch.no_grad():
        for path, entries in by_file.items():
            with safe_open(path, framework="pt") as handle:  # one file mapped at a time
                for _, key, rec, buffer in entries:
                    if rec is None:
                        buffer.copy_(handle.get_tensor(key))
                        continue
                    lo = min(rt.rank * rec.shard_numel, rec.numel)
                    hi = min(lo + rec.shard_numel, rec.numel)
                    rec.shard[hi - lo:].zero_()
                    if hi > lo:
                        rec.shard[: hi - lo].copy_(read_flat(handle, key, tuple(rec.shape), lo, hi))


def read_flat(handle, key: str, shape: tuple[int, ...], lo: int, hi: int) -> torch.Tensor:
    """Elements ``[lo, hi)`` of the flattened tensor ``key``, reading only the rows that hold them."""
    if not shape:
        return handle.get_tensor(key).reshape(-1)[lo:hi]
    dim = next((d for d, size in enumerate(shape) if size > 1), len(shape) - 1)
    inner = math.prod(shape[dim + 1:])
    first, last = lo // inner, -(-hi // inner)
    index = (slice(0, 1),) * dim + (slice(first, last),)
    rows = handle.get_slice(key)[index].reshape(-1)
    start = lo - first * inner
    return rows[start: start + hi - lo]
