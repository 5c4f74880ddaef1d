"""Shard layout of one unit's parameters inside its coalesced collective buffers.

Parameter ``i`` with ``n_i`` elements is flattened and zero-padded to
``world * s_i`` elements, ``s_i = ceil(n_i / world)``; rank ``r`` holds elements
``[r * s_i, (r + 1) * s_i)`` of that padded value. One rank's send buffer for the
all-gather is the concatenation of its shards, ``S = sum(s_i)`` elements, with
parameter ``i`` starting at ``offsets[i]``. The gathered buffer (and the
reduce-scatter input) is ``world * S`` elements laid out ``[rank][param-shard]``.

Layouts are immutable and cached, so the packing functions can look them up on
every call and the CUDA path can key its per-layout device metadata on the
returned object's identity.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass
from itertools import accumulate
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["ShardLayout", "check_buffer", "shard_layout"]


@dataclass(frozen=True, slots=True)
class ShardLayout:
    """Where each parameter's shard sits inside one rank's ``total`` elements.

    ``numels[i]`` is the unpadded element count, ``shard_numels[i]`` the per-rank
    shard size ``ceil(numels[i] / world)``, ``offsets[i]`` the start of the
    parameter's shard within one rank's slice, and ``total`` the per-rank slice
    length ``S``. The full collective buffer holds ``world * total`` elements.
    """

    numels: tuple[int, ...]
    world: int
    shard_numels: tuple[int, ...]
    offsets: tuple[int, ...]
    total: int

    @property
    def gathered_numel(self) -> int:
        """Elements of the gathered / reduce-scatter input buffer, ``world * S``."""
        return self.world * self.total


def shard_layout(numels: Sequence[int], world: int) -> ShardLayout:
    """Return the cached :class:`ShardLayout` for ``numels`` split over ``world`` ranks."""
    key = numels if type(numels) is tuple else tuple(numels)
    return _shard_layout(key, world)


@functools.lru_cache(maxsize=None)
def _shard_layout(numels: tuple[int, ...], world: int) -> ShardLayout:
    # Unbounded on purpose: a process sees a handful of distinct layouts (one
    # per unit), and the CUDA path keys device metadata on layout identity, so
    # a layout must not be evicted and rebuilt while that metadata is cached.
    world = operator.index(world)
    if world < 1:
        raise ValueError(f"world must be positive, got {world}")
    numels = tuple(operator.index(n) for n in numels)
    if any(n < 0 for n in numels):
        raise ValueError(f"numels must be non-negative, got {numels}")
    shard_numels = tuple(-(-n // world) for n in numels)
    ends = tuple(accumulate(shard_numels))
    offsets = (0,) + ends[:-1] if ends else ()
    return ShardLayout(
        numels=numels,
        world=world,
        shard_numels=shard_numels,
        offsets=offsets,
        total=ends[-1] if ends else 0,
    )


def check_buffer(layout: ShardLayout, shard_numels: Sequence[int], buf: Tensor, what: str) -> None:
    """Raise ``ValueError`` unless ``shard_numels`` and the 1-D ``buf`` fit ``layout``."""
    if layout.shard_numels != tuple(shard_numels):
        raise ValueError(
            f"shard_numels {tuple(shard_numels)} do not match ceil(numel / {layout.world}) "
            f"of the given tensors {layout.shard_numels}"
        )
    if buf.dim() != 1 or buf.numel() != layout.gathered_numel:
        raise ValueError(
            f"{what} must be 1-D with world * S = {layout.gathered_numel} elements, "
            f"got shape {tuple(buf.shape)}"
        )
