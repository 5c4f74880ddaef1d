"""A checkpoint load under offload: read and written one unit at a time, never the whole rank at once.

[Note: a load under offload streams through the tier]
Without offload, :func:`paramfsm.checkpoint.load` reads the whole checkpoint
into a staging copy of this rank's shards and optimizer state, and writes
nothing until every read succeeded: all or nothing, at the cost of one more
copy of the rank's state in working memory. Under offload that copy is what
offload exists to avoid (the state is in a tier because it does not fit),
and writing the staged values would page every shard in at once.

So under offload the load is checked first, exactly as without: every key,
shape and the optimizer state's presence against the checkpoint's metadata,
agreed among the ranks, before anything is read. Then it goes unit by unit,
in unit order: DCP reads that unit's keys (its parameters under each of
their names, and their optimizer state; the first batch also carries the
buffers and the optimizer's hyperparameters) into a staging copy of that
unit alone, the ranks agree that the read succeeded, and the values are
written into the unit's shards and state while they are paged in for the
block, then written to the tier and paged out. Consecutive units are read
together while their staging stays within :data:`STAGING_BYTES` (see [Note:
units read together]), so working memory holds that much staging, and those
units' values, at a time.

The price is the all-or-nothing property. A read that fails before the
first unit is written leaves the model and optimizer unchanged, as without
offload. A read that fails part-way leaves the earlier units loaded and the
later ones with their old values: the values guard
(:func:`paramfsm.sharding.meta.setting_values`) then stays on, so the model's forward
refuses to run until a load (this one again, or any full load) completes, and
the error says how many parameters were loaded. Every DCP read is collective, and
every rank reads the same units in the same order, so the ranks' reads pair up.
"""

from __future__ import annotations

import contextlib

from paramfsm.checkpoint import state_dicts as ck
from paramfsm.sharding import meta


def batches(rt, keys, optimizer) -> list[tuple[tuple, list[str]]]:
    """The keys of ``keys`` grouped by unit, in unit order: ``[(records, keys), ...]``, units without a key
    left out. Keys of no parameter (buffers, the optimizer's hyperparameters) join the first unit's batch.
    Every parameter is in exactly one unit, and the root unit always exists
    (:func:`paramfsm.engine.storage.units.build_units`)."""
    by_key = ck._records_by_key(rt)
    by_name = {rec.name: rec for rec in rt._by_id.values()}
    owner: dict[str, object] = {}
    for key in keys:
        if key in by_key:
            owner[key] = by_key[key]
        elif key.startswith(ck.OPTIM_PREFIX):
            owner[key] = by_name.get(key[len(ck.OPTIM_PREFIX):].rpartition(".")[0]) if optimizer else None
        else:
            owner[key] = None
    out = []
    for unit in rt.units:
        records = set(unit.records)
        out.append((unit.records, [key for key, rec in owner.items() if rec in records]))
    out[0] = (out[0][0], [key for key, rec in owner.items() if rec is None] + out[0][1])
    return [(records, keys) for records, keys in out if keys]


#: Consecutive units are read by one DCP load while their staging stays within this many bytes (one unit at
#: least): each load pays a metadata read and two collectives (see [Note: units read together]).
STAGING_BYTES = 16 << 20


def _staged_bytes(value) -> int:
    """The bytes a staging copy of ``value`` (from :func:`paramfsm.checkpoint.load`'s checked dict) takes."""
    local = value.to_local() if hasattr(value, "to_local") else getattr(value, "flat", value)
    return local.numel() * local.element_size() if hasattr(local, "numel") else 0


def merged(plan: list, own: dict, budget: int) -> list:
    """``plan``'s consecutive batches joined while their staged bytes stay within ``budget``.

    [Note: units read together]
    A DCP load reads the checkpoint's metadata and agrees a plan among the ranks (two collectives) before it
    reads a byte: about 29 ms a call on two gloo ranks, against 2 ms to write a unit into a disk tier.
    ``python benchmarks/streamed_load.py`` loads a 48-unit stack of Linear(512, 512) with AdamW (72 MiB of
    shards and state a rank, on disk) in 2.19 s one unit a read, 0.71 s in reads of 8 MiB and 0.49 s in
    reads of 16 MiB, against 0.33 s for the staged load of the same model without offload (which holds
    53 MiB more while it loads). Units are therefore read together up to :data:`STAGING_BYTES` of staging,
    which is small beside the models offload is for and bounds the working memory a load holds all the same; a
    unit larger than that is read on its own. Every rank merges the same
    units (the plan and the sizes are the same on every rank), so the ranks' reads still pair.
    """
    out: list = []
    size = 0
    for records, keys in plan:
        nbytes = sum(_staged_bytes(own[key]) for key in keys)
        if out and size + nbytes <= budget:
            out[-1] = (out[-1][0] + tuple(records), out[-1][1] + keys)
            size += nbytes
        else:
            out.append((tuple(records), list(keys)))
            size = nbytes
    return out


def load(rt, own: dict, optimizer, read) -> None:
    """Load ``own`` (the checked state dict :func:`paramfsm.checkpoint.load` built, model and optimizer
    state) unit by unit (see the module's note). ``read(keys, what)`` reads those keys of the checkpoint
    into a new staging dict, agreeing among the ranks that it succeeded and raising on every rank when not,
    with ``what`` saying what the failure left."""
    plan = merged(batches(rt, own, optimizer), own, STAGING_BYTES)
    by_key = ck._records_by_key(rt)
    names = ck._optim_names(rt, optimizer) if optimizer is not None else None
    staged = read(plan[0][1], "nothing was loaded; the model and optimizer are unchanged")
    records = tuple(rt._by_id.values())
    rt.scheduler.shards_written(records, records, "paramfsm.checkpoint.load()", paging=False)
    with meta.setting_values(rt, "paramfsm.checkpoint.load"):
        loaded, total = 0, sum(len(records) for records, _ in plan)
        for index, (unit_records, keys) in enumerate(plan):
            if index:
                staged = read(keys, f"the values of {loaded} of {total} parameters were loaded and the rest hold "
                                    "their old values, so the model's forward is refused until a load completes")
            _write(rt, optimizer, names, unit_records, {key: by_key[key] for key in keys if key in by_key},
                   staged)
            loaded += len(unit_records)
            staged = None  # one batch's staging at a time


def _write(rt, optimizer, names, records, model: dict, staged) -> None:
    """Write one batch's staged values while its shards and optimizer state are resident (``model``: its
    model keys and their records, ``None`` for a buffer)."""
    with contextlib.ExitStack() as held:
        held.enter_context(rt.scheduler.shard_scope(records, write=True))
        if optimizer is not None:
            held.enter_context(rt.scheduler.state_scope(optimizer, records, write=True))
        ck.write_model_values(rt, model, staged)
        if optimizer is not None:
            ck.write_optim_values(rt, optimizer, staged, records=set(records), names=names)
            if f"{ck.OPTIM_PREFIX}param_groups" in staged:
                ck.write_param_groups(optimizer, staged)
