"""The standard checkpoint layout: every tensor saved with its model shape, as the pieces this rank holds.

[Note: a flat slice as rectangular pieces]
A rank's shard is a contiguous range ``[start, stop)`` of the flattened
parameter (see [Note: the flat DTensor view of a shard] in
:mod:`paramfsm.checkpoint`). In the parameter's own row-major shape that range
is a union of at most ``2 * ndim - 1`` boxes: a partial first row, whole rows,
a partial last row, applied recursively to the trailing dimensions
(:func:`boxes`). Every box covers consecutive flat elements, so each is a
*view* of the shard, and DCP's chunk metadata (an offset and a size per box)
describes it exactly. A checkpoint written this way is an ordinary DCP
checkpoint of the model's shapes: ``dcp.load`` reads it into a plain model's
``state_dict()``, into an FSDP2 model, or through ``dcp_to_torch_save``; and
paramfsm reads any other layout of the same shapes (FSDP2's row chunks among
them) because DCP intersects the saved chunks with the boxes asked for. No
whole tensor is ever gathered.

:class:`ShardPieces` is how the boxes reach DCP: a tensor subclass with the
model's shape and no storage of its own, implementing DCP's checkpointable
protocol (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``) the way ``DTensor`` does. DCP writes from, and
reads straight into, the views; any other use of the object raises.
"""

from __future__ import annotations

import math

import torch

from paramfsm.errors import ParamFSMError

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes), both in the model's shape


def boxes(shape: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """The boxes covering flat elements ``[start, stop)`` of a row-major ``shape``, in flat order."""
    if start >= stop:
        return []
    if not shape:
        return [((), ())]
    inner = math.prod(shape[1:])
    first, head = divmod(start, inner)
    last, tail = divmod(stop, inner)
    rest = tuple(shape[1:])
    if first == last:
        return [((first, *o), (1, *s)) for o, s in boxes(rest, head, tail)]
    out: list[Box] = []
    if head:
        out += [((first, *o), (1, *s)) for o, s in boxes(rest, head, inner)]
        first += 1
    if last > first:
        out.append(((first, *(0,) * len(rest)), (last - first, *rest)))
    if tail:
        out += [((last, *o), (1, *s)) for o, s in boxes(rest, 0, tail)]
    return out


class ShardPieces(torch.Tensor):
    """A model-shaped tensor of which this rank holds some boxes, each a view of its shard (for DCP only).

    ``key`` is the parameter's qualified name (for messages); ``pieces`` is a
    list of ``(offsets, view)`` in flat order; ``flat`` is the valid part of
    the shard the views cover, ``numel`` long.
    """

    @staticmethod
    def __new__(cls, name: str, shape, flat: torch.Tensor, pieces: list):
        self = torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=flat.dtype, device=flat.device,
                                                   requires_grad=False)
        self.key, self.flat, self.pieces = name, flat, pieces
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        aten = torch.ops.aten
        if func in (aten.clone.default, aten.detach.default, aten.alias.default) and not kwargs:
            (self,) = args
            return self.with_flat(self.flat.clone() if func is aten.clone.default else self.flat)
        if func is aten.copy_.default and all(isinstance(a, ShardPieces) for a in args[:2]):
            dst, src = args[:2]
            if dst.shape == src.shape and [o for o, _ in dst.pieces] == [o for o, _ in src.pieces]:
                dst.flat.copy_(src.flat)
                return dst
        names = [a.key for a in args if isinstance(a, ShardPieces)]
        raise ParamFSMError(f"'{names[0] if names else '?'}': a sharded state dict's value holds only this rank's "
                            f"pieces and supports only clone, detach and copy_ between the same pieces (not {func}). "
                            "What to do: save or load it with "
                            "torch.distributed.checkpoint, or use rt.full_state_dict() for full tensors")

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"ShardPieces('{self.key}', shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"pieces={len(self.pieces)}, numel_here={self.flat.numel()})")

    # DCP calls these three (so it is imported by then; ``import paramfsm.checkpoint`` does not import it).
    def __create_write_items__(self, fqn: str, obj) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        size = self.size()
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=view.shape),
                              properties=TensorProperties.create_from_tensor(view), size=size))
                for offsets, view in self.pieces]

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=view.shape) for offsets, view in self.pieces]

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        for offsets, view in self.pieces:
            if tuple(offsets) == tuple(index.offset):
                return view
        raise ParamFSMError(f"'{self.key}': this rank holds no piece at offset {tuple(index.offset)}")

    def with_flat(self, flat: torch.Tensor) -> ShardPieces:
        """The same boxes over another tensor of the same flat length (a staging copy)."""
        return ShardPieces(self.key, self.shape, flat, _views(flat, [o for o, _ in self.pieces],
                                                                  [v.shape for _, v in self.pieces]))


def _views(flat: torch.Tensor, offsets: list, sizes: list) -> list:
    out, pos = [], 0
    for off, size in zip(offsets, sizes):
        n = math.prod(size)
        out.append((tuple(off), flat[pos:pos + n].view(size)))
        pos += n
    return out


def valid_range(rt, rec) -> tuple[int, int]:
    """The flat elements ``[start, stop)`` of ``rec``'s parameter that this rank's shard holds (unpadded)."""
    start = min(rt.rank * rec.shard_numel, rec.numel)
    return start, min(start + rec.shard_numel, rec.numel)


def model_shaped(rt, rec, tensor: torch.Tensor) -> torch.Tensor:
    """A shard-shaped ``tensor`` (the shard, or optimizer state like it) as its parameter's model-shaped pieces.

    A parameter of no elements is a plain empty tensor of its shape (every
    rank writes the same, and DCP keeps one).
    """
    shape = tuple(rec.shape)
    if rec.numel == 0:
        return torch.empty(shape, dtype=tensor.dtype, device=tensor.device)
    start, stop = valid_range(rt, rec)
    flat = tensor.detach().reshape(-1)[: stop - start]
    found = boxes(shape, start, stop)
    return ShardPieces(rec.name, shape, flat, _views(flat, [o for o, _ in found], [s for _, s in found]))


def write_shard(rt, rec, target: torch.Tensor, src, key: str) -> None:
    """Copy ``src`` into the valid part of the shard-shaped ``target``.

    ``src`` is :class:`ShardPieces` (this layout), a flat ``DTensor`` (the
    layout of checkpoints saved before model shapes), a full tensor of the
    model's shape (this rank's slice is taken), or a 1-D tensor of this
    rank's values (a flat DTensor's local tensor).
    """
    from torch.distributed.tensor import DTensor

    start, stop = valid_range(rt, rec)
    dst = target.detach().reshape(-1)[: stop - start]
    if isinstance(src, ShardPieces):
        values = src.flat
    elif isinstance(src, DTensor):
        values = src.to_local().reshape(-1)
    elif isinstance(src, torch.Tensor) and tuple(src.shape) == tuple(rec.shape):
        values = src.detach().reshape(-1)[start:stop]
    elif isinstance(src, torch.Tensor) and src.dim() == 1 and src.numel() == stop - start:
        values = src.detach()
    else:
        raise ParamFSMError(f"'{key}': expected this rank's pieces of shape {tuple(rec.shape)} (from "
                            f"rt.sharded_state_dict()) or a full tensor of that shape, got {type(src).__name__} "
                            f"{tuple(getattr(src, 'shape', ()))}")
    if values.numel() != dst.numel():
        raise ParamFSMError(f"'{key}': {values.numel()} values for this rank's {dst.numel()} elements of "
                            f"{tuple(rec.shape)}; the state dict was made for another rank or world size. What to "
                            "do: pass rt.sharded_state_dict() of this runtime, loaded by torch.distributed.checkpoint")
    if dst.data_ptr() != values.data_ptr():
        dst.copy_(values)
