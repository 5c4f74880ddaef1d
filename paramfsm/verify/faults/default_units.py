"""Catalogued bugs that only the configuration users run shows: merged units, kept units read by others.

Each function returns a context manager that patches paramfsm for the duration of the block (see
:mod:`paramfsm.verify.faults.catalogue`, which lists the entries with their sources). Each one is a bug
that ``shard()``'s defaults exposed while the suite and ``verify`` kept a unit per module (``paramfsm
#52``): with the whole model one unit, an interrupted backward's gradients stay queued on the parameters;
a merged module called on its own is nobody's call; a unit kept from its forward to its backward is read by
another unit's forward unnoticed. ``paramfsm verify`` kills them through the programs that draw those unit
choices (``Config(units=...)``, :data:`paramfsm.verify.ops.UNIT_CHOICES`) and the subject whose root reads
another unit's weight (``sized_lm``).
"""

from __future__ import annotations

import contextlib

from paramfsm.engine.events import members
from paramfsm.engine.schedule import holds
from paramfsm.engine.schedule.grad_order import GradRouting
from paramfsm.engine.schedule.scheduler import Scheduler
from paramfsm.verify.faults.patching import patched


@contextlib.contextmanager
def interrupted_grads_kept():
    """Recovery after a backward that raised forgets the gradients queued on the full parameters without
    taking them off, and the next root forward steps them first: the next backward adds to them, or they are
    reduce-scattered after the user's ``zero_grad``."""
    with patched(GradRouting, "drop", lambda original: lambda self, records: None), \
            patched(Scheduler, "_interrupted", lambda original: lambda self, event: False):
        yield


def member_call_unhooked():
    """A module merged into its parent's unit carries none of the unit's hooks: called on its own (a value
    head, an encoder run apart), it reads empty parameters."""
    return patched(members, "install", lambda original: lambda found, running, hooks_of: [])


def kept_read_unnoticed():
    """A unit kept from its forward to its backward does not report reads by other units: the reader's graph
    saves the full parameter without borrowing it, and its next backward may read it empty or half-gathered."""
    return patched(holds, "watch", lambda original: lambda param: None)


SIZED = "paramfsm.testing.subjects:sized_lm"

#: The entries, as the fields of :class:`~paramfsm.verify.faults.catalogue.Fault` (name, bug, source, kind,
#: inject, then trace_scenario and subject).
DEFAULT_UNITS = (
    ("interrupted_grads_kept",
     "after a backward that raised, the gradients queued on the full parameters stay there (the whole model "
     "one unit: no later event stepped them), so the next backward adds to them",
     "paramfsm #52, loop 1 (an autograd.Function or a checkpoint's recomputation raising in backward, then "
     "rt.reset() and zero_grad: head.weight 0.13 off plain torch under the default units)",
     "correctness", interrupted_grads_kept),
    ("member_call_unhooked",
     "a module merged into its parent's unit, called on its own, finds its parameters empty",
     "paramfsm #52, loop 2 (model.a(x).sum().backward() outside the root forward raised NotGathered once "
     "'a' merged into the root)",
     "correctness", member_call_unhooked),
    ("kept_read_unnoticed",
     "a unit kept from its forward to its backward, read by another unit's forward, is not borrowed: after a "
     "retained backward whose deferral bound released it, the reader's next backward computes on garbage",
     "paramfsm #52, loop 3 (a tied output layer through F.linear, reshard_after_forward=False and "
     "max_deferred_bytes below the embedding: gradients 0.2 to 5e18 off, then NaN)",
     "correctness", kept_read_unnoticed, None, SIZED),
)
