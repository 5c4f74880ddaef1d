"""Loading safetensors files into a sharded model, each rank reading only its slice of each tensor.

:func:`load_files` is what :func:`paramfsm.integrations.hf.load_pretrained`
runs. It never holds a whole checkpoint, nor a whole parameter:

1. **Headers first.** Every file's header (names, dtypes, shapes, byte
   ranges) is read and checked against itself and the file's size, and every
   parameter and persistent buffer of the model is matched to one tensor of
   the right shape (the same number of elements in another shape, a
   transposed weight, is a wrong shape). A missing key, a wrong shape or a
   truncated file raises :class:`~paramfsm.errors.ParamFSMError` naming the
   tensor before any value is written, so the model keeps the values it had
   (and a model built on the meta device stays guarded, :mod:`paramfsm.sharding.meta`).
   Every rank reads the same headers, so every rank raises the same error:
   none goes on alone to a collective the others never reach.
2. **Then slices, one tensor at a time, one file at a time.** A parameter's
   shard is its slice ``[rank * s, (rank + 1) * s)`` of the flattened tensor,
   and a safetensors tensor is stored flat, row-major and little-endian, so
   that slice is one contiguous byte range of the file, counted in elements
   of the file's dtype: it is read with plain reads, straight into the shard
   when dtypes agree on the CPU, else into one buffer of the file's dtype the
   size of the slice, which is then converted into the shard. A checkpoint of
   another dtype (bf16 weights into an fp32 model, or the reverse) therefore
   loads as transformers' ``from_pretrained`` loads it, each stored tensor
   converted as ``tensor.to(dtype)`` converts it. Buffers (not sharded) are
   read whole and converted alike.

[Note: reads, not a memory map]
``safetensors.safe_open(...).get_slice`` reads through a memory map of the
file, whose pages stay resident (and count in the process's memory) while
the file is open: loading a one-file checkpoint so held this rank's slices
twice, once in the map and once in the shards. Positioned reads go through
the page cache, which the process does not own, so a rank holds its shards
and nothing else. The header is the format's own: 8 bytes of little-endian
length, then a JSON table of name -> dtype, shape and data offsets.

A tied parameter is loaded from the first of its keys the files hold (a
``save_pretrained`` file keeps one). Tensors of the files that the model does
not have are ignored, as ``load_state_dict(strict=False)`` would ignore them,
and logged.
"""

from __future__ import annotations

import json
import logging
import math
import os
import struct
from typing import NamedTuple

import torch

from paramfsm.sharding import meta
from paramfsm.core.spec import State
from paramfsm.errors import ParamFSMError

logger = logging.getLogger(__name__)


#: safetensors dtype names -> torch dtypes.
DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
          "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


class Entry(NamedTuple):
    """Where one tensor of a safetensors file is: file, shape, dtype, the file offset of its first byte, its name."""

    path: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    key: str = ""


def headers(files, rank: int = 0) -> dict[str, Entry]:
    """Tensor name -> :class:`Entry`, from the files' headers only (and their sizes).

    A tensor whose byte range does not match its dtype and shape, or lies
    past the end of the file, raises here: the header and the size are the
    same on every rank, where a short read would fail only on the rank whose
    slice lies in the missing bytes. ``rank`` is named in the errors.
    """
    found: dict[str, Entry] = {}
    for path in files:
        with open(path, "rb") as handle:
            size = struct.unpack("<Q", handle.read(8))[0]
            try:
                table = json.loads(handle.read(size))
            except ValueError as exc:
                raise ParamFSMError(f"'{path}' is not a safetensors file (its header does not parse: {exc})") from None
            length = os.fstat(handle.fileno()).st_size
        for key, info in table.items():
            if key == "__metadata__":
                continue
            if info["dtype"] not in DTYPES:
                raise ParamFSMError(f"'{path}': tensor '{key}' has dtype {info['dtype']}, which paramfsm cannot read")
            dtype, shape = DTYPES[info["dtype"]], tuple(info["shape"])
            start, end = info["data_offsets"]
            if end - start != math.prod(shape) * dtype.itemsize:
                raise ParamFSMError(
                    f"'{path}' is damaged: its header gives tensor '{key}' ({info['dtype']}, {list(shape)}) "
                    f"{end - start} bytes, where that dtype and shape take {math.prod(shape) * dtype.itemsize} "
                    f"(rank {rank}); nothing was loaded. Save the checkpoint again")
            if 8 + size + end > length:
                raise ParamFSMError(
                    f"'{path}' is truncated: tensor '{key}' ends at byte {8 + size + end} but the file has "
                    f"{length} bytes (rank {rank}); nothing was loaded. Copy or save the checkpoint again")
            found[key] = Entry(path, shape, dtype, 8 + size + start, key)
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
        elif found[key].shape != shape:
            wrong.append(f"'{key}' is {list(found[key].shape)} in {os.path.basename(found[key].path)}, "
                         f"the model's {'parameter' if rec is not None else 'buffer'} is {list(shape)}")
        else:
            steps.append((found[key], key, rec, None if rec is not None else own[key]))
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
    rt.flush()
    busy = [rec.name for rec in rt._by_id.values() if rec.state is not State.NOT_AVAILABLE]
    if busy:
        raise ParamFSMError(f"cannot load '{where}' while parameters are gathered: {busy[:5]}; "
                            "call it between iterations")
    steps = plan(rt, headers(files, rt.rank), where)
    by_file: dict[str, list] = {}
    for step in steps:
        by_file.setdefault(step[0].path, []).append(step)
    with meta.setting_values(rt, f"loading '{where}'"), torch.no_grad():
        for path, entries in by_file.items():
            with open(path, "rb", buffering=0) as handle:
                for entry, _, rec, buffer in entries:
                    if rec is None:
                        buffer.copy_(read(handle, entry, 0, math.prod(entry.shape)).view(entry.shape))
                        continue
                    lo = min(rt.rank * rec.shard_numel, rec.numel)
                    hi = min(lo + rec.shard_numel, rec.numel)
                    with rt.scheduler.shard_scope((rec,), write=True):  # offloaded: straight into the tier
                        shard = rec.shard.detach()
                        shard[hi - lo:].zero_()
                        read(handle, entry, lo, hi, into=shard[: hi - lo])


def read(handle, entry: Entry, lo: int, hi: int, into: torch.Tensor | None = None) -> torch.Tensor:
    """Elements ``[lo, hi)`` of the flattened tensor ``entry``: one contiguous byte range of the file.

    Read straight into ``into`` when it is a CPU tensor of the file's dtype, else
    into a buffer of the file's dtype (copied into ``into`` when given).
    """
    direct = into is not None and into.device.type == "cpu" and into.dtype == entry.dtype and into.is_contiguous()
    out = into if direct else torch.empty(hi - lo, dtype=entry.dtype)
    if hi > lo:
        view = memoryview(out.view(torch.uint8).numpy())
        handle.seek(entry.offset + lo * out.element_size())
        done = 0
        while done < len(view):
            got = handle.readinto(view[done:])
            if not got:
                raise ParamFSMError(f"'{entry.path}' ended inside tensor '{entry.key}' while it was read, though "
                                    "its header fit the file's size: the file changed during the load; load it "
                                    "again once it is complete")
            done += got
    if into is not None and not direct:
        into.copy_(out)
    return out
