"""Catalogued bugs of offload: a page-in skipped, a write-back lost, a tier copy read after a step, an
accumulated gradient dropped unwritten, a disk file shared with another run, a state dict of copies.

Each function returns a context manager that patches one function of the
residency schedule or the pager for the duration of the block (see
:mod:`paramfsm.verify.faults.catalogue`). ``paramfsm verify`` kills them
through its canonical offload program (``Config(offload="disk")``): the first
two as the named errors the residency machine and the pager raise (an illegal
``read`` of a PAGED_OUT shard, :class:`~paramfsm.errors.StaleOffloadCopy`), the
third, which no check inside the runtime can see, through the reference
comparison of the parameters after the next step. The fourth and fifth also
pass every check inside the runtime: the program's micro-batches added into
paged-out gradients, and a second run sharing the disk tier's folder
(:func:`paramfsm.verify.loop_helpers.another_run`), make the next step or
gather differ from plain torch. The sixth loads nothing and raises nothing: the
program's plain DCP restore leaves the parameters where the iteration before it
took them, and the reference comparison after it finds them. The seventh also
raises nothing: after the program's ``opt.load_state_dict`` of a kept state, the
backward's page-in ahead of the step reads the old tier copy into the loaded
state, and the reference comparison after the step finds it.
"""

from __future__ import annotations

import fcntl
import os

import paramfsm.checkpoint as ck
from paramfsm.checkpoint import state_dicts
from paramfsm.sharding import offload
from paramfsm.engine.effects.paging import Pager
from paramfsm.engine.schedule.grad_paging import GradPaging
from paramfsm.engine.schedule.residency import Residency
from paramfsm.engine.storage import tiers
from paramfsm.verify.faults.patching import patched


def page_in_skipped():
    """A unit's gather reads its shards without needing them first: nothing pages them in."""
    def make(original):
        def gathering(self, start_gather):
            shards = self.shards

            def start(records):
                self.read([shards.get(rec) for rec in records])  # the bug: no need() before the read
                start_gather(records)
            return start
        return gathering
    return patched(Residency, "gathering", make)


def writeback_lost():
    """The write of a changed value to its tier is skipped when it is paged out after the step."""
    def make(original):
        def write_tier(self, placements):
            # the bug: only values new to the tier are written; the others keep the copy from before the step
            original(self, [p for p in placements if any(key not in self.tier.slots for key, _ in p.values())])
        return write_tier
    return patched(Pager, "write_tier", make)


def tier_read_after_step():
    """An optimizer step's writes are not recorded, so the value is dropped as if its tier copy were current."""
    def make(original):
        def written(self, placements):
            return None  # the bug: no write event and no new version
        return written
    return patched(Residency, "written", make)


def grad_accumulation_unwritten():
    """A gradient added into a paged-in shard gradient is released without being marked written."""
    def make(original):
        def closing(self, records):
            stale = self.residency.written
            self.residency.written = lambda placements: None  # the bug: the accumulation is not a write
            try:
                original(self, records)
            finally:
                self.residency.written = stale
        return closing
    return patched(GradPaging, "closing", make)


def tier_file_shared():
    """The disk tier names its file by rank alone and opens it without O_EXCL: two runs share one file."""
    def make(original):
        def __init__(self, folder, rank, first_owner="<none>"):
            original(self, folder, rank, first_owner)
            os.close(self.fd)
            self.path.unlink()
            self.path = self.folder / f"paramfsm-offload-rank{rank}.bin"  # the bug: no run of its own
            self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(self.fd, fcntl.LOCK_SH)  # owned, as every tier file is (tier_files), by both runs at once
        return __init__
    return patched(tiers.DiskTier, "__init__", make)


def state_dict_copies():
    """``rt.sharded_state_dict()`` hands out the pieces of a streaming save, which read the tier into copies."""
    def make(original):
        def sharded_state_dict(rt, layout="model"):
            return state_dicts._model_state(rt, layout, streaming=True)  # the bug: a save's copies, not views to load into
        return sharded_state_dict
    return patched(ck, "sharded_state_dict", make)


def placement_follows_the_optimizer():
    """An optimizer-state placement reads the optimizer's state as it is now, not the tensors it was made for."""
    def make(original):
        def _state_values(optimizer, rec, index):
            def values():
                current = optimizer.state.get(rec.shard, {})
                return tuple(((id(optimizer), index, name), t) for name, t in current.items()
                             if hasattr(t, "dim") and t.dim() > 0)
            return values
        return _state_values
    return patched(offload, "_state_values", make)


#: The entries, as the fields of :class:`~paramfsm.verify.faults.catalogue.Fault` (name, bug, source, kind,
#: inject); the catalogue lists them after its own.
OFFLOAD = (
    ("page_in_skipped",
     "a unit's all-gather starts from offloaded shards that were never paged in, reading whatever the "
     "working buffer holds",
     "paramfsm #36 (planted in the offload schedule); the closest elsewhere is ZeRO-Infinity's parameter "
     "swapping (microsoft/DeepSpeed offload_param to nvme), where a gather waits on a swap-in it started",
     "correctness", page_in_skipped),
    ("writeback_lost",
     "after the optimizer step, updated shards and optimizer state are dropped from memory without being "
     "written to the offload tier, so the next step pages in the values from before the step",
     "paramfsm #36 (planted in the offload schedule); the closest elsewhere is ZeRO-Infinity's optimizer "
     "state swap-out to NVMe (microsoft/DeepSpeed offload_optimizer to nvme)",
     "correctness", writeback_lost),
    ("tier_read_after_step",
     "the optimizer step's writes are not recorded, so a changed value is dropped as if its host copy were "
     "current, and the next use reads the host copy from before the step",
     "paramfsm #36 (planted in the offload schedule); the closest elsewhere is FSDP2's CPUOffloadPolicy, "
     "where the host copy is the one the optimizer steps",
     "correctness", tier_read_after_step),
    ("grad_accumulation_unwritten",
     "a micro-batch's gradient added into an offloaded shard gradient is not recorded as a write, so the "
     "gradient is dropped as if its tier copy were current and the step reads the earlier micro-batches only",
     "paramfsm #36 (planted in the gradient offload); the closest elsewhere is ZeRO-Offload's gradient "
     "accumulation into host buffers across micro-batches (microsoft/DeepSpeed offload_optimizer with "
     "gradient_accumulation_steps)",
     "correctness", grad_accumulation_unwritten),
    ("tier_file_shared",
     "the disk tier's file is named by rank alone and opened without O_EXCL, so a second run pointed at the "
     "same folder writes its values over this run's tier copies",
     "paramfsm #36 (planted in the disk tier); the closest elsewhere is ZeRO-Infinity's swap folder, whose "
     "files are named by rank and parameter, so two jobs given one nvme_path overwrite each other's swap "
     "files (microsoft/DeepSpeed offload_param to nvme)",
     "correctness", tier_file_shared),
    ("state_dict_copies",
     "under offload, rt.sharded_state_dict() holds copies read from the tier instead of views of the shards, "
     "so a plain DCP load into it (the documented way) fills the copies and the model keeps its old values",
     "paramfsm #36 (introduced while streaming checkpoint saves through the tier, found in review); the closest "
     "elsewhere is torch.distributed.checkpoint's in-place load contract (pytorch/pytorch, "
     "torch.distributed.checkpoint.load: state_dict values are loaded in place)",
     "correctness", state_dict_copies),
    ("placement_follows_the_optimizer",
     "an offloaded optimizer state's placement stands for whatever the optimizer holds now, so after "
     "opt.load_state_dict the page-in ahead of the next step reads the old tier copy into the loaded state "
     "and the step runs on the state the load replaced",
     "paramfsm #55 (found by verify's canonical offload program once it rolled the optimizer back with "
     "torch's own load_state_dict); the closest elsewhere is ZeRO-Offload's optimizer swapper, keyed by "
     "parameter rather than by the state tensors a load replaces (microsoft/DeepSpeed offload_optimizer)",
     "correctness", placement_follows_the_optimizer),
)
