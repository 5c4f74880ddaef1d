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

import torch

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


def measured_steps(rt, model, example_input, optimizer=torch.optim.AdamW, steps: int = 2) -> dict:
    """What a plan rehearses, run for real on ``rt`` (a model built on the meta device and sharded):
    ``rt.init_weights()`` (a Hugging Face model's own initialiser), then ``steps`` steps of a forward of
    ``example_input``, a backward of its floating-point outputs, ``optimizer``'s step and ``zero_grad``, each
    phase counted; returns ``{phase: total}``. The check the tests and ``benchmarks/plan_accuracy.py`` hold a
    plan to."""
    from paramfsm.planning.rehearsal import tensors_of

    with peaks(rt) as measured:
        measured.phase("init")
        rt.init_weights(getattr(model, "_init_weights", None))
        measured.sample("init end")
        opt = measured.optimizer = optimizer(model.parameters())
        for _ in range(steps):
            measured.phase("forward")
            out = model(**example_input) if isinstance(example_input, dict) else model(example_input)
            measured.sample("forward end")
            measured.phase("backward")
            torch.stack([t.float().mean() for t in tensors_of(out)]).sum().backward()
            measured.sample("backward end")
            measured.phase("step")
            opt.step()
            measured.sample("optimizer step")
            measured.phase("checkpoint")
            opt.zero_grad()
    return {phase: total for phase, (total, *_) in measured.result().items()}
