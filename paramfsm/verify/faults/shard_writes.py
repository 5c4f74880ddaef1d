"""Catalogued bugs of shard writes: a stale full copy read after a step, a write-back dropped or unchecked.

Each function returns a context manager that patches one function for the
duration of the block (see :mod:`paramfsm.verify.faults.catalogue`, which lists
them with their sources). ``paramfsm verify`` kills them through its
reference check: the programs step an optimizer between a retained backward
and a new forward of a submodule, and write in place inside ``rt.gathered()``;
the last two through a refusal every rank must raise (a write inside
``rt.gathered()`` that differs by rank, a module attached after ``shard()``).
"""

from __future__ import annotations

from paramfsm.sharding import gathered, model_changes
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


def writeback_agreement_skips_first_element():
    """``rt.gathered()``'s write-back agreement digests each parameter's values but its first element."""
    def make(original):
        def fingerprint(tensor):
            return original(tensor.detach().reshape(-1)[1:])  # the bug: an off-by-one in the digest's range
        return fingerprint
    return patched(gathered, "fingerprint", make)


def nested_attach_unnoticed():
    """A module attached after ``shard()`` is checked for new parameters of its own, not of its children."""
    def make(original):
        def _on_module(module, name, submodule):
            found = model_changes._WATCHED.get(module)
            if found is None or found.closed or submodule is None:
                return
            for local, param in submodule.named_parameters(recurse=False):  # the bug: children not searched
                if param not in found.partitioned:
                    found.note(module, f"{name}.{local}", "attached after paramfsm.shard() with a new module")
                    return
        return _on_module
    return patched(model_changes, "_on_module", make)


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
    ("writeback_agreement_skips_first_element",
     "rt.gathered(writeback=True) compares the ranks' writes by a digest that skips each parameter's first "
     "element, so ranks that wrote different values there raise nothing and rank 1's write is dropped",
     "paramfsm #57, case 8 (a write-back agreement that can skip the first element of each tensor)",
     "correctness", writeback_agreement_skips_first_element),
    ("nested_attach_unnoticed",
     "a module attached after shard() whose parameters sit in its children (nn.Sequential(nn.Linear(...))) "
     "raises no ModelChanged, and each rank trains its own copy of them",
     "paramfsm #57, case 9 (a module attached after shard() with nested parameters, unnoticed)",
     "correctness", nested_attach_unnoticed),
)
