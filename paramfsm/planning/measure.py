"""The peaks a live runtime reaches, counted as a plan counts them: the check that a plan holds.

``with paramfsm.planning.measure.peaks(rt, optimizer) as measured:`` puts the rehearsal's
:class:`~paramfsm.planning.sampler.Sampler` where the runtime's trace sits, so every transition of the
real run is counted the same way the plan counted the rehearsed one; ``measured.phase("forward")`` names
the phase that follows. ``measured.result()`` gives ``{phase: (total, by kind, unit, event)}`` like a
rehearsal's. It costs one pass over the records per transition: for tests and benchmarks, not training.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch

from paramfsm.engine.events import graph_task as gt
from paramfsm.engine.events.events import FORWARD_BEGIN, PRE_BACKWARD, SHARDS_WRITTEN
from paramfsm.planning.sampler import KINDS, Sampler


class Measured:
    """The peaks of a live runtime, by phase (see the module docstring)."""

    def __init__(self, rt, optimizer):
        self.sampler = Sampler(rt, rt.ctx.trace, optimizer=optimizer)

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
    ctx = rt.ctx
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


class Tracker:
    """Each phase's peak of a live runtime since the last :meth:`reset`: ``rt.reset_peak_memory()``,
    ``rt.memory()``'s ``peak_<phase>`` and ``rt.peak_memory()``.

    [Note: the runtime counts its peaks as its plan does]
    The count is the plan's own :class:`~paramfsm.planning.sampler.Sampler`, standing where the runtime's
    trace sits, so a measured peak and a planned one are the same sum of the same kinds. The phase is
    read from events the scheduler applies anyway, each watched only while the count is on: a root
    forward (``forward``), a backward's first unit (``backward``), a shard write by an optimizer step
    (``step``) or by an initialisation or load (``init``), and a checkpoint save (``checkpoint``, marked
    by :func:`paramfsm.checkpoint.save`). The count costs a sample per transition, so it runs only once
    a reset asked for it (``benchmarks/memory_peaks_cost.py`` measures the cost).
    """

    def __init__(self, rt):
        scheduler = rt.scheduler
        self.optimizers = _Optimizers()
        self.sampler = Sampler(rt, scheduler.ctx.trace, extra=lambda: _staging(rt), optimizer=self.optimizers)
        scheduler.ctx.trace = self.sampler
        self._stops = [scheduler.watch(FORWARD_BEGIN, self._forward), scheduler.watch(PRE_BACKWARD, self._backward),
                       scheduler.watch(SHARDS_WRITTEN, self._written)]

    def stop(self, rt) -> None:
        """Stop counting: the runtime's own trace back in place, no event watched, no step hook left."""
        ctx = rt.ctx
        if ctx.trace is self.sampler:
            ctx.trace = self.sampler.trace
        for stop in self._stops:
            stop()
        self._stops = []

    def reset(self) -> None:
        """Forget the peaks: what is held now starts the current phase's count."""
        self.sampler.peaks = {}
        self.sampler.sample("", "reset")

    def phase(self, name: str) -> None:
        """The transitions from now on belong to ``name`` (what is held now counts in it too)."""
        if self.sampler.phase != name:
            self.sampler.phase = name
            self.sampler.sample("", f"{name} begins")

    def stepping(self, optimizer) -> None:
        """``optimizer`` steps this runtime's shards now: its state counts from here on, and what the step
        leaves (the state its first step makes) is counted when it returns."""
        if optimizer not in self.optimizers.stepped:
            self.optimizers.stepped.add(optimizer)
            sampler = weakref.ref(self.sampler)
            self._stops.append(optimizer.register_step_post_hook(
                lambda *_: sampler() is not None and sampler().sample("", "optimizer step")).remove)
        self.phase("step")

    def peaks(self) -> dict:
        """``{phase: {"total", "unit", "event", "kinds"}}``, in phase order as first reached."""
        return {phase: {"total": total, "unit": unit, "event": event,
                        "kinds": {kind: held[kind] for kind in KINDS}}
                for phase, (total, held, unit, event) in self.sampler.peaks.items()}

    def _forward(self, event) -> None:
        if event.graph_task == gt.NO_TASK:  # not a recomputation inside a backward
            self.phase("forward")

    def _backward(self, event) -> None:
        self.phase("backward")

    def _written(self, event) -> None:
        if not event.why.endswith(".step()"):
            self.phase("init")


class _Optimizers:
    """The optimizers that stepped a runtime's shards, seen by the sampler as one (their states merged)."""

    def __init__(self):
        self.stepped = weakref.WeakSet()

    @property
    def state(self) -> dict:
        merged: dict = {}
        for optimizer in self.stepped:
            merged.update(optimizer.state)
        return merged


def _staging(rt) -> dict:
    """A background save's staged copy, as ``rt.memory()`` counts it."""
    import sys

    saves = sys.modules.get("paramfsm.checkpoint.background")
    if saves is not None and saves.pending(rt) is not None:
        return {"checkpoint_staging": saves.staging_bytes(rt)}
    return {}
