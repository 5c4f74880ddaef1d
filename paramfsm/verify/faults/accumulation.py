"""Catalogued bugs of gradient accumulation (``rt.no_sync``), ``opt.step(closure)`` and ``reshard_after_forward``.

Each function returns a context manager that patches one method of the
scheduler or of the unsynchronised-gradient store for the duration of the
block (see :mod:`paramfsm.verify.faults.catalogue`, which lists them with
their sources). ``paramfsm verify`` kills them through its sync-aware and
reshard checks (:mod:`paramfsm.verify.sync_checks`).
"""

from __future__ import annotations

import contextlib

from paramfsm import optim
from paramfsm.engine.effects.grad_sync import UnsyncedGrads
from paramfsm.engine.events import graph_task
from paramfsm.engine.schedule.backward import GraphTasks
from paramfsm.engine.schedule.grad_order import GradRouting
from paramfsm.engine.schedule.scheduler import Scheduler
from paramfsm.verify.faults.patching import patched


def kept_grad_not_folded():
    """The synchronising backward reduce-scatters only its own micro-batch: the kept sum is dropped."""
    def make(original):
        def fold(self, rec, grad):
            original(self, rec, grad)  # takes the kept entry out of the store ...
            return grad  # ... but sends the new gradient alone
        return fold
    return patched(UnsyncedGrads, "fold", make)


@contextlib.contextmanager
def sync_read_at_forward():
    """Whether a backward synchronises is decided by the switch in force at the forward (as DDP reads it),
    not at the backward: toggling ``rt.set_requires_gradient_sync`` between the two is ignored."""
    at_forward: dict = {}  # the gradient routing -> its switch at the last root forward

    def forward_begin(original):
        def _on_forward_begin(self, ev):
            original(self, ev)
            if ev.graph_task == graph_task.NO_TASK:
                at_forward[self.grads] = self.grads.sync
        return _on_forward_begin

    def as_at_forward(routing_of):
        def make(original):
            def method(self, *args, **kwargs):
                grads = routing_of(self)
                now = grads.sync
                grads.sync = at_forward.get(grads, now)
                try:
                    return original(self, *args, **kwargs)
                finally:
                    grads.sync = now
            return method
        return make

    with patched(Scheduler, "_on_forward_begin", forward_begin), \
            patched(GraphTasks, "drain_ready", as_at_forward(lambda tasks: tasks._grads)), \
            patched(GradRouting, "sync_kept", as_at_forward(lambda routing: routing)):
        yield


def step_checked_before_closure():
    """``opt.step(closure)`` checks for unsynchronised gradients and announces its shard writes before the
    closure runs, on the gradients from before its forward and backward."""
    def make(original):
        def _after_closure(optimizer, writers, closure):
            optim._check_and_announce(optimizer, writers)
            return closure
        return _after_closure
    return patched(optim, "_after_closure", make)


def kept_unit_resharded_after_forward():
    """A unit ``reshard_after_forward`` keeps is released after its forward anyway (and gathered again in
    its backward)."""
    def make(original):
        def _on_post_forward(self, ev):
            original(self, ev)
            if ev.graph_task == graph_task.NO_TASK:
                self.holds.hand_over(id(ev.call))
        return _on_post_forward
    return patched(Scheduler, "_on_post_forward", make)


def no_grad_forward_kept_gathered():
    """A kept unit's forward under ``torch.no_grad()`` (or an evaluation) keeps its hold as if a backward
    could come: its parameters stay gathered until the next forward."""
    def make(original):
        def _on_post_forward(self, ev):
            if ev.graph_task == graph_task.NO_TASK and ev.call is None and ev.unit in self.holds.keep_after_forward:
                self.holds.kept[id(ev.unit)] = ev.unit
                return
            original(self, ev)
        return _on_post_forward
    return patched(Scheduler, "_on_post_forward", make)


#: The entries, as the fields of :class:`~paramfsm.verify.faults.catalogue.Fault` (name, bug, source, kind,
#: inject); the catalogue lists them after its own.
ACCUMULATION = (
    ("kept_grad_not_folded",
     "the first backward with gradient sync back on reduce-scatters only its own micro-batch: the gradients "
     "kept under no_sync are dropped",
     "NVIDIA/Megatron-LM PR #7186 ('drops accumulated gradients: with multiple microbatches, only the last "
     "microbatch's gradient reaches the optimizer')",
     "correctness", kept_grad_not_folded),
    ("sync_read_at_forward",
     "whether a backward synchronises is decided by the sync switch at the forward, so "
     "rt.set_requires_gradient_sync toggled between a forward and its backward is ignored",
     "baidu-baige/LoongForge PR #163 ('DDP decides whether to all-reduce during the forward; no_sync() "
     "around backward() alone was a no-op')",
     "correctness", sync_read_at_forward),
    ("step_checked_before_closure",
     "opt.step(closure) checks the gradients before the closure runs its forward and backward: a last "
     "micro-batch inside the closure, whose backward synchronises what no_sync kept, is refused as unsynced",
     "paramfsm #39 (planted: every Lightning step is opt.step(closure)); the closest elsewhere is "
     "huggingface/peft PR #3382 (a step wrapper acted before AdamW.step ran the closure, whose backward then "
     "overwrote the gradients it had preconditioned)",
     "correctness", step_checked_before_closure),
    ("kept_unit_resharded_after_forward",
     "a unit reshard_after_forward keeps is released after its forward anyway and all-gathered again in "
     "its backward",
     "pytorch/pytorch PR #118017 (reshard_after_forward=False: no all-gather in backward), fairscale PR #470 "
     "(the root's parameters freed and re-gathered on every micro-batch)",
     "performance", kept_unit_resharded_after_forward),
    ("no_grad_forward_kept_gathered",
     "a forward under torch.no_grad() of a unit reshard_after_forward keeps holds it for a backward that "
     "cannot come, so its parameters stay gathered",
     "pytorch/pytorch #149029 ('parameters appear to remain unsharded even after the forward pass "
     "completes ... memory usage grows after forward passes in no_grad mode')",
     "memory", no_grad_forward_kept_gathered),
)
