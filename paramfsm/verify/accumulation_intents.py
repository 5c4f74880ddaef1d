"""The normaliser's gradient-accumulation intents: micro-batch loops under ``rt.no_sync()`` and the sync switch.

:class:`AccumulationIntents` is mixed into the normaliser of
:mod:`paramfsm.verify.programs`. It tracks whether gradient sync is on (the
``rt.set_requires_gradient_sync`` switch, and whether a ``no_sync`` window is
open) and whether a backward kept gradients since they were last
synchronised or zeroed. What needs synchronised gradients (an optimizer step,
clipping, unscaling, a forced overflow, freezing a parameter) is preceded by
``rt.sync_gradients()`` when some are kept, as a training loop must do (paramfsm
raises ``UnsyncedGradients`` otherwise), and a program ends synchronised,
since ``rt.close()`` refuses kept gradients. So every drawn program stays
valid, and hypothesis can still delete any intent.

The plain-torch meaning of all of it is plain accumulation: the reference
ignores the three ops (:mod:`paramfsm.verify.mirror`).
"""

from __future__ import annotations

from paramfsm.verify.ops import AUTO_MODES, BATCHES, GradSync, NoSync, SyncGradients, ZeroGrad

#: Intent kinds this mixin handles (see :meth:`AccumulationIntents.accumulation_op`).
ACCUMULATION_KINDS = ("no_sync", "grad_sync", "sync_gradients")


class AccumulationIntents:
    """Sync tracking and the accumulation intents (see the module docstring); needs the normaliser's
    ``ops``, ``forward``, ``loss``, ``backward``, ``drop`` and ``apply``."""

    sync_on = True  # rt.set_requires_gradient_sync's switch
    window = False  # inside a no_sync window
    kept = False  # a backward kept gradients since they were last synchronised or zeroed

    def syncing(self) -> bool:
        """Whether a backward run now reduce-scatters its gradients (and everything kept before)."""
        return self.sync_on and not self.window

    def took_grads(self) -> None:
        """A backward ran: it kept its gradients, or it synchronised every kept one with its own."""
        self.kept = not self.syncing()

    def zero_grad(self) -> None:
        self.ops.append(ZeroGrad())
        self.kept = False

    def synced(self) -> None:
        """Before an op that needs synchronised gradients: ``rt.sync_gradients()`` when some are kept."""
        if self.kept:
            self.ops.append(SyncGradients())
            self.kept = False

    def finish_accumulation(self) -> None:
        """At the end of a program: close an open window and synchronise what is kept."""
        self.close_window()
        self.synced()

    def close_window(self) -> None:
        """Leave an open ``rt.no_sync()`` window; what it kept stays kept until synchronised or zeroed."""
        if self.window:
            self.ops.append(NoSync(False))
            self.window = False

    def accumulation_op(self, kind: str, a: int, b: int, flag: bool) -> None:
        if kind == "no_sync":
            self.no_sync_loop(a, b, flag)
        elif kind == "grad_sync":
            self.ops.append(GradSync(flag))
            self.sync_on = flag
        elif kind == "sync_gradients":
            self.ops.append(SyncGradients())
            self.kept = False

    def no_sync_loop(self, a: int, b: int, via_runtime: bool) -> None:
        """``zero_grad``, ``1 + b % 3`` micro-batches inside ``with rt.no_sync():``, then the synchronisation:
        the last micro-batch's backward outside the window (``a`` even) or ``rt.sync_gradients()`` (``a``
        odd), then the step.

        For ``b >= 4`` the first micro-batch is the two-loss loop: one forward, ``backward(retain_graph=True)``
        of the first loss, then the second loss's backward (retaining the graph too when ``a >= 4``, which
        is then dropped without a final backward).
        """
        mode = AUTO_MODES[(a // 2) % len(AUTO_MODES)]
        self.zero_grad()
        self.ops.append(NoSync(True))
        self.window = True
        for micro in range(1 + b % 3):
            out = self.forward((b + micro) % BATCHES, mode)
            if micro == 0 and b >= 4:
                first, second = self.loss(out, a), self.loss(out, a + 1)
                self.backward(out, first, True, via_runtime)
                self.backward(out, second, a >= 4, via_runtime)
            else:
                self.backward(out, self.loss(out, a), False, via_runtime)
            self.drop(out)
        self.ops.append(NoSync(False))
        self.window = False
        if a % 2 == 0:
            out = self.forward((b + 3) % BATCHES, mode)
            self.backward(out, self.loss(out, a), False, via_runtime)
            self.drop(out)
        else:
            self.ops.append(SyncGradients())
            self.kept = False
        self.apply("step", a, b, via_runtime)
