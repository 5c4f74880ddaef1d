"""Shared pieces of the training-pattern tests: a sharded model next to its plain-torch reference.

Every pattern test runs a job ``fn(rank, world, ...)`` on a pool of gloo
ranks. The job builds a model, hands a deep copy to :class:`Pair`, which
shards the original (``trace=True, strict=True``) and keeps the copy as the
single-process reference fed the combined batch of all ranks. After every
backward the job compares the full gradients, after every optimizer step the
full parameters, and at the end :meth:`Pair.finish` replays the trace through
the spec and checks that the leak audit of the last final backward was empty.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

import paramfsm
from paramfsm import State
from paramfsm.core.fsm import default_table
from paramfsm.core.replay import replay
from paramfsm.engine.storage.units import select_unit_modules
from paramfsm.testing import Reference, assert_close_dicts, rank_slice, sharded_grads, sharded_params


#: The unit choices every pattern test runs under: a unit per module owning parameters (the suite's
#: ``PARAMFSM_MIN_UNIT_BYTES=0``: lifetimes between units) and ``shard()``'s default merge (what users run; the
#: pattern models are small, so it makes each one unit, or a few).
UNIT_CHOICES = ("per_module", "default_units")
#: This rank's unit choice while a job runs under :func:`under_units`, and whether each runtime built has fewer
#: units than a unit per module would make.
_CHOICE: dict = {"min_unit_bytes": None, "merged": []}


def under_units(choice: str, fn, *args):
    """Run the job ``fn`` in a rank with every :class:`Pair` sharded under ``choice``; under the default units
    at least one of its runtimes must really merge a module into its parent's unit."""
    from paramfsm.engine.storage.default_units import MIN_UNIT_BYTES

    _CHOICE["min_unit_bytes"], _CHOICE["merged"] = (MIN_UNIT_BYTES if choice == "default_units" else None), []
    try:
        result = fn(*args)
        merged = _CHOICE["merged"]
    finally:
        _CHOICE["min_unit_bytes"] = None
    chosen = [m for m in merged if m is not None]  # None: a runtime with units of its own (nothing to merge)
    if choice == "default_units" and (chosen or not merged):
        assert any(chosen), f"the default units merged nothing in {fn.__name__} ({len(merged)} runtimes)"
    return result


def unit_kwargs(model) -> dict:
    """``shard()``'s unit arguments of the current choice, for a job that shards without :class:`Pair`."""
    if _CHOICE["min_unit_bytes"] is None:
        return {}
    _CHOICE["merged"].append(len(select_unit_modules(model, None, _CHOICE["min_unit_bytes"]))
                             < len(select_unit_modules(model, None, 0)))
    return {"min_unit_bytes": _CHOICE["min_unit_bytes"]}


class UnitChoicePool:
    """A rank pool whose jobs run under one unit choice (:func:`under_units`); ``choice`` says which."""

    def __init__(self, pool, choice: str):
        self.pool, self.choice = pool, choice

    def run(self, fn, *args):
        return self.pool.run(functools.partial(under_units, self.choice, fn), *args)


@pytest.fixture(params=UNIT_CHOICES)
def ranks2(request, suite_ranks2):
    """The suite's two ranks, each pattern test once per unit choice (import it into the test module)."""
    return UnitChoicePool(suite_ranks2, request.param)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


class Pair:
    """A sharded model, its optimizer, and the plain-torch reference with the same optimizer."""

    def __init__(self, model: nn.Module, rank: int, world: int, *, make_optimizer=sgd, retain: str = "defer",
                 **shard_kwargs):
        self.rank, self.world = rank, world
        self.ref = Reference(model, make_optimizer)
        self.model = model
        per_module = None
        if _CHOICE["min_unit_bytes"] is not None and shard_kwargs.get("units") is None:
            shard_kwargs.setdefault("min_unit_bytes", _CHOICE["min_unit_bytes"])
            per_module = len(select_unit_modules(model, None, 0))
        self.rt = paramfsm.shard(model, retain=retain, trace=True, strict=True, **shard_kwargs)
        _CHOICE["merged"].append(None if per_module is None else len(self.rt.units) < per_module)
        self.opt = make_optimizer(self.rt.shard_parameters())
        self.worst_grad = self.worst_param = 0.0
        self.checks = 0

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's share of a global batch."""
        return rank_slice(tensor, self.rank, self.world)

    def zero_grad(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.ref.zero_grad()

    def check_grads(self, what: str, atol: float = 1e-6, rtol: float = 1e-5) -> None:
        """Full sharded gradients must equal the reference's (collective)."""
        err = assert_close_dicts(sharded_grads(self.rt, self.model), self.ref.grads(), atol=atol, rtol=rtol,
                                 what=what)
        self.worst_grad = max(self.worst_grad, err)
        self.checks += 1

    def step(self, what: str, atol: float = 1e-5, rtol: float = 1e-5) -> None:
        """One optimizer step on both sides, then compare the full parameters (collective)."""
        self.opt.step()
        self.ref.optimizer.step()
        err = assert_close_dicts(sharded_params(self.rt, self.model), self.ref.params(), atol=atol, rtol=rtol,
                                 what=what)
        self.worst_param = max(self.worst_param, err)
        self.checks += 1

    def assert_states(self, *allowed: State, what: str = "") -> None:
        states = self.rt.states()
        bad = {n: s for n, s in states.items() if s not in allowed}
        assert not bad, f"{what}: expected only {allowed}, got {bad}"

    def finish(self, close: bool = True) -> dict:
        """Trace replays cleanly, the last leak audit is empty; returns a small report."""
        problem = replay(self.rt.trace.records, default_table())
        assert problem is None, str(problem)
        assert self.rt.scheduler.audit.last == [], self.rt.scheduler.audit.last
        report = {"grad_err": self.worst_grad, "param_err": self.worst_param, "checks": self.checks,
                  "records": len(self.rt.trace), "counters": self.rt.counters}
        if close:
            self.rt.close()
        return report


def batch(step: int, world: int, per_rank: int, *shapes, seed: int = 0) -> list[torch.Tensor]:
    """Global float batches for one step, identical on every rank."""
    gen = torch.Generator().manual_seed(1000 * seed + step)
    return [torch.randn(world * per_rank, *shape, generator=gen) for shape in shapes]


def tokens(step: int, world: int, per_rank: int, seq: int, vocab: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * seed + step)
    return torch.randint(0, vocab, (world * per_rank, seq), generator=gen)


def gathers_by_task(records, param: str) -> dict[int, int]:
    """How many gathers each backward graph task issued for ``param`` (from trace records)."""
    out: dict[int, int] = {}
    for r in records:
        if r.param == param and r.graph_task >= 0 and "start_gather" in r.effects:
            out[r.graph_task] = out.get(r.graph_task, 0) + 1
    return out


def reduces_by_task(records, param: str) -> dict[int, int]:
    """How many reduce_grad effects each graph task ran for ``param`` (from trace records)."""
    out: dict[int, int] = {}
    for r in records:
        if r.param == param and "reduce_grad" in r.effects:
            out[r.graph_task] = out.get(r.graph_task, 0) + 1
    return out
