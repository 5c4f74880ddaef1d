"""Catalogued bugs planted in paramfsm's own code that its test suite missed (``paramfsm #40``).

Each function returns a context manager that patches one function or method
for the duration of the block (see :mod:`paramfsm.verify.faults.catalogue`,
which lists the entries with their sources). The tests that catch each bug
where it lives are ``tests/test_missing_grads.py`` (reentrant checkpointing
inside a unit) and ``tests/test_user_visible_regressions.py`` (leaving
``rt.no_sync()``). ``paramfsm verify`` kills the :data:`REGRESSIONS` on the
mixture-of-experts subject, whose experts it runs one by one under reentrant
checkpointing inside their unit: through its comparison with plain torch, and
through the exception the runtime raises.
"""

from __future__ import annotations

import contextlib

from paramfsm.sharding import accumulation
from paramfsm.engine.schedule.grad_order import GradRouting
from paramfsm.verify.faults.patching import patched


def no_sync_exit_enables_sync():
    """Leaving ``rt.no_sync()`` turns gradient sync on, whatever the switch was before the block: after
    ``rt.set_requires_gradient_sync(False)`` the next backward reduce-scatters."""
    def make(original):
        @contextlib.contextmanager
        def no_sync(rt):
            with original(rt):
                yield
            rt.scheduler.grads.sync = True
        return no_sync
    return patched(accumulation, "no_sync", make)


def late_grads_dropped():
    """Gradients accumulated by a nested backward (reentrant checkpointing inside a unit) for a unit whose
    backward runs in an outer one are taken off the parameter and dropped: the unit sends zeros for them."""
    def make(original):
        def take_grads(self, records):
            ts = self._graph.tasks.get(self._graph._ctx.graph_task)
            if ts is None or ts.depth == 0:
                original(self, records)
                return
            late = [rec for rec in records if len(rec.units) == 1 and not ts.open.get(rec.units[0])]
            for rec in late:
                self._executor.detach_grad(rec)
            original(self, [rec for rec in records if rec not in late])
        return take_grads
    return patched(GradRouting, "take_grads", make)


def nested_task_sends_staged():
    """The end of a nested graph task (the backward reentrant checkpointing runs inside the outer one) sends
    the gradients staged so far, before their unit closes: each rank sends them in its own autograd order."""
    def make(original):
        def close_task(self, task):
            original(self, task)
            if self._graph.running() and self.staged_grads:
                self._executor.take_ordered(list(self.staged_grads.items()))
                self.staged_grads.clear()
        return close_task
    return patched(GradRouting, "close_task", make)


#: The subject whose mixture of experts (one unit) verify runs expert by expert under reentrant
#: checkpointing (its blocks are the experts), so their gradients come from nested backward passes.
EXPERTS = "paramfsm.testing.subjects:experts_lm"

#: The entries, as the fields of :class:`~paramfsm.verify.faults.catalogue.Fault` (name, bug, source, kind,
#: inject, then trace_scenario and subject).
REGRESSIONS = (
    ("late_grads_dropped",
     "gradients accumulated by the nested backward of reentrant checkpointing inside a unit are dropped: "
     "the unit sends zeros for its checkpointed parameters",
     "deepspeedai/DeepSpeed PR #7780 (ZeRO-3 with use_reentrant=True checkpointing: gradients of the "
     "checkpoint's nested backward left behind in the reduce buckets), DeepSpeed #988; paramfsm #40",
     "correctness", late_grads_dropped, None, EXPERTS),
    ("nested_task_sends_staged",
     "the end of reentrant checkpointing's nested backward sends the gradients staged so far, before their "
     "unit closes, so ranks whose experts got different tokens pair different parameters",
     "NVIDIA/Megatron-LM PR #2218 (inconsistent gradient reduce ordering across DP ranks), deepspeedai/DeepSpeed "
     "PR #7780 (the checkpoint's nested backward leaves parameters in the reduce buckets); paramfsm #40",
     "correctness", nested_task_sends_staged, None, EXPERTS),
)

#: Entries that ``paramfsm verify`` kills only once its programs draw their pattern, kept out of the catalogue
#: until then: ``no_sync_exit_enables_sync`` needs ``rt.set_requires_gradient_sync(False)``, then a ``no_sync``
#: micro-batch loop, then a backward before sync is switched on again, which no drawn program holds.
UNDRAWN = (
    ("no_sync_exit_enables_sync",
     "leaving rt.no_sync() turns gradient sync on instead of restoring the switch it found, so after "
     "rt.set_requires_gradient_sync(False) the next backward reduce-scatters",
     "pytorch/pytorch #72589 (DDP's and FSDP's no_sync() save the old require_backward_grad_sync and restore "
     "it in finally); paramfsm #40",
     "performance", no_sync_exit_enables_sync),
)
