"""Catalogued bugs of shard writes: a stale full copy read after an optimizer step, a write-back dropped.

Each function returns a context manager that patches one function for the
duration of the block (see :mod:`paramfsm.verify.faults.catalogue`, which lists
them with their sources). ``paramfsm verify`` kills them through its
reference check: the programs step an optimizer between a retained backward
and a new forward of a submodule, and write in place inside ``rt.gathered()``.
"""

from __future__ import annotations

from paramfsm import gathered
from paramfsm.engine.schedule.shard_writes import ShardWrites
from paramfsm.verify.faults.patching import patched


def stale_copy_after_step():
    """A shard write leaves the full copies gathered before it in place (deferred copies included)."""
    def make(original):
        def written(self, ev):
            return None  # the bug: the copies are never dropped, nor versions bumped
        return written
    return patched(ShardWrites, "written", make)


def writeback_dropped():
    """``rt.gathered()`` ends without writing in-place changes back into the shards."""
    def make(original):
        def _write_back(rt, before):
            return None  # the bug: the changes are released with the full copies
        return _write_back
    return patched(gathered, "_write_back", make)


#: The entries, as the fields of :class:`~paramfsm.verify.faults.catalogue.Fault` (name, bug, source, kind,
#: inject); the catalogue lists them after its own.
SHARD_WRITES = (
    ("stale_copy_after_step",
     "a full copy kept DEFERRED_RELEASE for a retained graph survives an optimizer step, so a new forward "
     "of that unit (a GAN's discriminator on the retained fake batch) computes with the pre-step weights",
     "microsoft/DeepSpeed #7352 (parameters kept across a retained-graph window under ZeRO-3); paramfsm #34 "
     "(a GAN loop in one sharded root trained on stale weights)",
     "correctness", stale_copy_after_step),
    ("writeback_dropped",
     "in-place writes to the full parameters inside rt.gathered() are dropped when the block ends",
     "pytorch/pytorch #107081 ('summon_full_params won't change parameters', even with writeback=True)",
     "correctness", writeback_dropped),
)
