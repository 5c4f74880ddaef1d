"""Which units stay gathered from their forward to their backward: ``shard(..., reshard_after_forward=...)``.

[Note: a forward's hold kept for its backward]
By default a unit is released after its forward and gathered again by its
pre-backward: two all-gathers per unit per step, one unit's full parameters
alive at a time. A unit that is not resharded after forward keeps its
forward's hold instead, for as long as that forward call can still be
backpropagated: one all-gather per unit per step (none in backward), at the
price of its full parameters staying alive from its forward to its backward.
The hold is the forward call's, so the spec needs nothing new (a holder keeps
the parameter AVAILABLE). It is released:

* at the call's pre-backward, right after the backward's own fetch found the
  unit gathered, so the backward (retained or not) then owns the unit as
  usual: a keep-graph backward defers it, a final one frees it;
* when the call's graph is freed without a backward (the output dropped,
  an evaluation forward with grad enabled whose result was only read);
* at the next root forward, like deferred copies ([Note: flushing deferred
  parameters at a new forward]): an optimizer step may have changed the shards
  since, and a backward over the older graph gathers again (correct; keeping
  is only an optimisation);
* by ``rt.gathered``, a state-dict load and a sharded checkpoint's save or
  load, which read or write the shards directly (a later backward over the
  graph gathers again);
* by ``rt.reset()`` and the recovery after an interrupted forward or backward.

[Note: the root is resharded too]
The root unit's backward is the first of every backward, so its re-gather
cannot be prefetched behind other work; FSDP2 keeps the root unsharded after
forward for that reason. ``benchmarks/accumulation.py --root`` measured that
exception on this project's machine (world 2, 2 shared cores): where the root
owns parameters (the tiny model under ``units=by_size(1 MiB)``, whose root
unit is the whole model) one all-gather fewer per step and 0.89x the step
time, within the machine's +-20% swings; where it owns none (a unit per
layer, tiny and big models, and the big model under ``by_size``) nothing
changes (1.04x-1.08x, noise). It did not measurably pay off, and it keeps the
root's full parameters (often the embeddings) alive through the whole step,
so the default reshards the root like any unit;
``reshard_after_forward=lambda name, module: name != ""`` keeps it.

A forward that records no graph (``torch.no_grad()``, ``inference_mode``)
keeps nothing: no backward can come, so the unit is released at its forward's
end, as always. Only root forwards keep holds; a forward recomputed inside
backward (activation checkpointing) already keeps its hold until the unit's
backward.
"""

from __future__ import annotations

from paramfsm.engine.storage.units import ROOT  # the root unit's name, given to a predicate as ""
from paramfsm.errors import ParamFSMError


def kept_units(units, policy) -> frozenset:
    """The units not resharded after forward under ``policy``: True, False or ``predicate(name, module)``.

    ``True`` (the default) reshards every unit after its forward, the root
    included (see [Note: the root is resharded too]); ``False`` keeps every
    unit; a predicate receives each unit's qualified module name (``""`` for
    the root) and module and returns whether to reshard it.
    """
    if policy is True:
        return frozenset()
    if policy is False:
        return frozenset(units)
    if callable(policy):
        kept = set()
        for unit in units:
            name = "" if unit.name == ROOT else unit.name
            answer = policy(name, unit.module)
            if not isinstance(answer, bool):
                raise ParamFSMError(f"reshard_after_forward predicate returned {answer!r} for unit '{unit.name}'; "
                                    "expected True (reshard after forward) or False (keep until backward)")
            if not answer:
                kept.add(unit)
        return frozenset(kept)
    raise ParamFSMError(f"reshard_after_forward={policy!r}: expected True, False or a predicate (name, module) -> bool")
