"""Catalogued bugs of gradient routing and on-demand reads: zeros sent out of a unit's order, a borrowed
parameter never released.

Each function returns a context manager that patches one method for the
duration of the block (see :mod:`paramfsm.verify.faults.catalogue`, which lists
them with their sources). ``paramfsm verify`` kills them on :data:`EXPERTS`.
"""

from __future__ import annotations

import types

from paramfsm.engine.effects.executor import Executor
from paramfsm.engine.schedule.on_demand import OnDemand
from paramfsm.verify.faults.patching import patched

#: The subject with a mixture of experts made one unit and a read outside a unit.
EXPERTS = "paramfsm.testing.subjects:experts_lm"


def _missing_grads_out_of_order():
    def make(original):
        def take_ordered(self, pairs):
            pairs = list(pairs)  # zeros after the real gradients, where autograd's order would put them
            original(self, [p for p in pairs if p[1] is not None] + [p for p in pairs if p[1] is None])
        return take_ordered
    return patched(Executor, "take_ordered", make)


def _on_demand_never_released():
    def make(original):
        def demanded(self, ev):
            reader = self.reading_unit(ev.graph_task)
            if reader is None:
                return
            self._step(ev.record, "demand")  # gathered for the reader, but never borrowed: never released
            self._prefetch.issue()
            self._prefetch.wait(types.SimpleNamespace(records=(ev.record,)))
        return demanded
    return patched(OnDemand, "demanded", make)


#: The entries, as the fields of :class:`~paramfsm.verify.faults.catalogue.Fault` (name, bug, source, kind,
#: inject, trace scenario, subject); the catalogue lists them after its own.
ROUTING = (
    ("missing_grads_out_of_order",
     "a parameter without a gradient on this rank is reduce-scattered as zeros after the unit's other "
     "gradients (autograd's order), not in the unit's order, so ranks pair different parameters",
     "pytorch/pytorch #158719 and PR #174862 (FSDP with parameters used differently across ranks), "
     "NVIDIA/Megatron-LM PR #2218 (inconsistent gradient reduce ordering across DP ranks)",
     "correctness", _missing_grads_out_of_order, None, EXPERTS),
    ("on_demand_never_released",
     "a parameter gathered for a read outside its module is never released with the module that read it",
     "DeepSpeed PR #1453 review (a parameter requested outside its module becomes an external parameter; "
     "registered external parameters are not partitioned after the module finishes), DeepSpeed #930",
     "memory", _on_demand_never_released, None, EXPERTS),
)
