"""Model-shaped pieces of an offloaded tensor, read from the tier one piece at a time as DCP writes them.

[Note: a save streams through the tier]
:class:`~paramfsm.checkpoint.layout.ShardPieces` holds views of a shard, so a
sharded state dict of an offloaded model would page in every shard and every
optimizer state tensor at once, and keep them until the next step. DCP asks
for each piece's values only when it writes that piece (``resolve_data``, then
``__get_tensor_shard__``, piece after piece on the saving thread), and for
nothing but its offsets, sizes and dtype before. So for a tensor placed in an
offload tier :func:`pieces` gives :class:`PagedPieces`: the same boxes, no
views. Its ``__get_tensor_shard__`` holds the tensor resident
(``Residency.holding``: paged in if it was out, released after, and so paged
out again), copies the one piece DCP asked for and returns the copy: a save
holds one piece of one tensor at a time beyond the resident set. Anything else
that needs the values reads ``flat``, which pages the tensor in on demand as
any reader outside the schedule does.

Only :func:`paramfsm.checkpoint.save` asks for them, and only for a synchronous
save. A load must never get them: DCP loads in place into the tensors
``__get_tensor_shard__`` returns, and these are copies, so the load would be
dropped without a word. ``rt.sharded_state_dict()``, which users load into, keeps
views of the shards (``tests/test_offload_streaming.py`` checks such a load).
"""

from __future__ import annotations

import math

import torch

from paramfsm.checkpoint.layout import ShardPieces, _views, boxes, valid_range
from paramfsm.errors import ParamFSMError


class PagedPieces(ShardPieces):
    """:class:`ShardPieces` over an offloaded tensor whose pieces are read when DCP writes them (module doc)."""

    @staticmethod
    def __new__(cls, name: str, shape, tensor: torch.Tensor, numel: int, found: list, hold):
        self = torch.Tensor._make_wrapper_subclass(cls, torch.Size(shape), dtype=tensor.dtype, device=tensor.device,
                                                   requires_grad=False)
        self.key, self.tensor, self.numel_here, self.boxes, self.hold = name, tensor, numel, found, hold
        return self

    @property
    def flat(self) -> torch.Tensor:
        """The valid part of the tensor (paged in on demand and kept until the next step)."""
        return self.tensor.detach().reshape(-1)[: self.numel_here]

    @property
    def pieces(self) -> list:
        return _views(self.flat, [o for o, _ in self.boxes], [s for _, s in self.boxes])

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"PagedPieces('{self.key}', shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"pieces={len(self.boxes)}, numel_here={self.numel_here})")

    def __create_write_items__(self, fqn: str, obj) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        properties = TensorProperties.create_from_tensor(torch.empty(0, dtype=self.dtype))
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                              properties=properties, size=self.size()))
                for offsets, sizes in self.boxes]

    def __create_chunk_list__(self) -> list:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                for offsets, sizes in self.boxes]

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        position = 0
        for offsets, sizes in self.boxes:
            count = math.prod(sizes)
            if tuple(offsets) == tuple(index.offset):
                with self.hold():
                    flat = self.tensor.detach().reshape(-1)
                    return flat[position:position + count].view(sizes).clone()
            position += count
        raise ParamFSMError(f"'{self.key}': this rank holds no piece at offset {tuple(index.offset)}")


def pieces(rt, rec, tensor: torch.Tensor) -> PagedPieces | None:
    """:class:`PagedPieces` for ``tensor`` (a shard, or optimizer state like it) when ``rt`` offloads it (see
    [Note: a save streams through the tier]), else None."""
    plan = getattr(rt, "offload", None)
    if plan is None or rec.numel == 0 or plan.residency.placement_of(tensor) is None:
        return None
    residency = plan.residency
    start, stop = valid_range(rt, rec)
    return PagedPieces(rec.name, tuple(rec.shape), tensor, stop - start, boxes(tuple(rec.shape), start, stop),
                       lambda: residency.holding(tensor, write=False))
