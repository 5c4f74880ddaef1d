"""Catalogued bugs of offload: a page-in skipped, a write-back lost, a tier copy read after a step.

Each function returns a context manager that patches one function of the
residency schedule or the pager for the duration of the block (see
:mod:`paramfsm.verify.faults.catalogue`). ``paramfsm verify`` kills them
through its canonical offload program (``Config(offload="disk")``): the first
two as the named errors the residency machine and the pager raise (an illegal
``read`` of a PAGED_OUT shard, :class:`~paramfsm.errors.StaleOffloadCopy`), the
third, which no check inside the runtime can see, through the reference
comparison of the parameters after the next step.
"""

from __future__ import annotations

from paramfsm.engine.effects.paging import Pager
from paramfsm.engine.schedule.residency import Residency
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
)
