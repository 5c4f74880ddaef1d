"""The peaks a live runtime reaches, counted as a plan counts them: the check that a plan holds.

``with paramfsm.planning.measure.peaks(rt, optimizer) as measured:`` puts the rehearsal's
:class:`~paramfsm.planning.sampler.Sampler` where the runtime's trace sits, so every transition of the
real run is counted the same way the plan counted the rehearsed one; ``measured.phase("forward")`` names
the phase that follows. ``measured.result()`` gives ``{phase: (total, by kind, unit, event)}`` like a
rehearsal's. It costs one pass over the records per transition: for tests and benchmarks, not training.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

from paramfsm.planning.sampler import Sampler


class Measured:
    """The peaks of a live runtime, by phase (see the module docstring)."""

    def __init__(self, rt, optimizer):
        self.sampler = Sampler(rt, rt.scheduler.ctx.trace, optimizer=optimizer)

    @property
    def optimizer(self):
        """Whose state counts (it may be set once the optimizer is built)."""
        return self.sampler.optimizer

    @optimizer.setter
    def optimizer(self, optimizer) -> None:
        self.sampler.optimizer = optimizer

    def phase(self, name: str) -> None:
        """The phase the next transitions belong to; what is held now counts in it too."""
        self.sampler.phase = name
        self.sampler.sample("", f"{name} begins")

    def sample(self, event: str) -> None:
        """Count what is held now (at the end of a phase, say) under ``event``."""
        self.sampler.sample("", event)

    def result(self) -> dict:
        return dict(self.sampler.peaks)


@contextlib.contextmanager
def peaks(rt, optimizer=None) -> Iterator[Measured]:
    """Count ``rt``'s peaks by phase for the block (``optimizer``: whose state counts, if any)."""
    measured = Measured(rt, optimizer)
    ctx = rt.scheduler.ctx
    ctx.trace = measured.sampler
    try:
        yield measured
    finally:
        ctx.trace = measured.sampler.trace
