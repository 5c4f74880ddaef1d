"""A gathered parameter changed in place by anything but paramfsm is never dropped in silence.

[Note: a write to a gathered parameter]
Between its gather and its release a parameter's full tensor is a copy: the shard
is the truth, and the release frees the copy. A module that writes its own
weight in place inside ``forward`` (``with torch.no_grad(): self.weight.clamp_(-c, c)``,
a momentum encoder updated in its forward) wrote the copy only, and the release
dropped the write: plain torch keeps it, so every later step trained other
numbers, with no error. The write inside ``rt.gathered(writeback=True)`` reaches
the shards (checked to agree across ranks), which is the supported way.

So the unpack effect notes the parameter's autograd version counter, which every
in-place op on the parameter bumps (``no_grad`` or not), the write-back of
``rt.gathered`` notes it again after copying into the shard (a read-only block, or
one that raised, acknowledges what it wrote as dropped, as documented), and the free effect
compares: a parameter whose version moved was written and not written back. The
free still happens (the state machine has already moved on), then
:class:`WriteToGathered` names the parameter and the fix. A recovery
(``rt.reset()``, a forward after an interrupted one) frees without asking: what
an interrupted iteration wrote is dropped like the rest of it. Writes through
``param.data`` (an alias autograd does not version) are not seen: the version
counter is the one cheap witness there is (reading the values back would cost
a pass over every gathered byte at every release). Cost: one attribute read per
parameter at each gather and at each release.
"""

from __future__ import annotations

from paramfsm.errors import ParamFSMError


class WriteToGathered(ParamFSMError):
    """A gathered full parameter was changed in place outside ``rt.gathered(writeback=True)``."""

    def __init__(self, rec, rank: int):
        self.param, self.unit, self.rank = rec.name, rec.unit, rank
        module = rec.name.rpartition(".")[0] or "<root>"
        super().__init__(
            f"parameter '{rec.name}' (module '{module}', unit '{rec.unit}') was changed in place on rank {rank} "
            "while gathered (in a forward or backward), and paramfsm released it: the change reached only the "
            "full copy, not the shard, so it is lost (event 'release', state NOT_AVAILABLE now). What to do: make "
            "the write between iterations inside `with rt.gathered(module, writeback=True):` (collective: every "
            "rank writes the same values), or write the shard (dict(rt.named_shard_parameters())[name]) under "
            "torch.no_grad().")


def noting(effect):
    """``effect`` (the unpack, or ``rt.gathered``'s write-back), then each parameter's version noted: what the
    full parameter holds now came from its shard or has reached it."""
    def run(records):
        effect(records)
        for rec in records:
            rec.version = rec.param._version
    return run


def acknowledge(records) -> None:
    """The writes made so far to these gathered parameters are meant to be dropped (``rt.gathered(writeback=False)``,
    or a block that raised before its write-back): their release raises nothing for them."""
    for rec in records:
        if rec.version is not None:
            rec.version = rec.param._version


def checked(free, recovering, rank: int):
    """The free effect, raising :class:`WriteToGathered` after it for a parameter written since its gather
    (unless ``recovering()``)."""
    def run(records):
        changed = None
        for rec in records:
            version = rec.version
            if version is not None:
                if changed is None and rec.param._version != version:
                    changed = rec
                rec.version = None
        free(records)
        if changed is not None and not recovering():
            raise WriteToGathered(changed, rank)
    return run
