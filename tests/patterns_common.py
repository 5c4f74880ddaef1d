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

import torch
from torch import nn

import paramfsm
from paramfsm import State
from paramfsm.core.fsm import default_table
from paramfsm.core.replay import replay
from paramfsm.testing import Reference, assert_close_dicts, rank_slice, sharded_grads, sharded_params


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


class Pair:
    """A sharded model, its optimizer, and the plain-torch reference with the same optimizer."""

    def __init__(self, model: nn.Module, rank: int, world: int, *, make_optimizer=sgd, retain: str = "defer",
                 **shard_kwargs):
        self.rank, self.world = rank, world
        self.ref = Reference(model, make_optimizer)
        self.model = model
        self.rt = paramfsm.shard(model, retain=retain, trace=True, strict=True, **shard_kwargs)
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
