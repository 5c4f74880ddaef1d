"""The ``write_back`` effect: this rank's slice of a gathered full parameter copied into its shard.

The schedule decides when (the ``written_back`` rows, see
:mod:`paramfsm.engine.schedule.shard_writes`); this runs the copy.
"""

from __future__ import annotations

import torch


def copy_into_shards(rank: int, records) -> None:
    """The ``write_back`` effect: this rank's slice of each gathered full parameter becomes its shard.

    The shard is ``rank``'s slice of the flattened parameter, padded at the end;
    the padding stays zero. At world 1 the full parameter views the shard, so
    the write already landed there and the copy is skipped.
    """
    with torch.no_grad():
        for rec in records:
            full = rec.param.detach().reshape(-1)
            shard = rec.shard
            if full.data_ptr() == shard.data_ptr():
                continue
            lo = min(rank * rec.shard_numel, rec.numel)
            hi = min(lo + rec.shard_numel, rec.numel)
            shard[: hi - lo].copy_(full[lo:hi])
