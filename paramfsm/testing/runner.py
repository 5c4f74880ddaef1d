"""Run one program on one rank, beside the plain-torch reference, checking after every op.

:func:`run_program` is the job a :class:`~paramfsm.launch.RankPool` runs on
every rank. Each rank shards a fresh model from the factory, keeps an
unsharded deep copy as the reference (:class:`Mirror`) and applies every op
of the program to both. The reference runs each rank's slice of the batch
separately and averages the slice losses, so its gradients are exactly the
rank-averaged gradients paramfsm produces, gradient penalties included.

After every op (see :mod:`paramfsm.testing.checks`):

- every parameter satisfies the spec's invariants for its state;
- nothing is in flight or held between ops; a parameter is deferred only
  under ``retain="defer"`` while the program still references a graph; after
  ``rt.flush()``, and after a backward without ``retain_graph`` when no
  retained graph is alive, nothing is deferred;
- shards and shard gradients equal this rank's slice of the reference;
- gathered data is the current parameter (inside ``rt.gathered`` and while no
  optimizer step happened since the last forward);
- communication counts are sane: a backward that finds every parameter
  deferred issues no all-gather, reduce-scatters are bounded by the
  parameters that require grad.

At the end the trace must replay through the spec, every gradient must have
been reduced at most once per graph task, and ``rt.close()`` must restore the
reference parameters. The ranks agree after every op (one tiny all-reduce) on
whether to go on, so a failure on one rank never leaves another blocked in a
collective.
"""

from __future__ import annotations

import bisect
import copy
import datetime
import time
import traceback

import attrs
import torch
import torch.distributed as dist

import paramfsm
from paramfsm.core.spec import State
from paramfsm.testing import checks, faults
from paramfsm.testing.programs import (
    PENALTY_WEIGHT, Backward, Drop, Flush, Forward, Gathered, Loss, Penalty, Program, Step, ZeroGrad,
)
from paramfsm.testing.subject import first_tensor, global_batch, load_subject, split


@attrs.frozen(slots=True)
class Options:
    """How to run a program: the seed, the per-rank batch size, an injected fault, the collective timeout."""

    seed: int = 0
    per_rank: int = 2
    fault: str | None = None
    timeout_s: float = 60.0


@attrs.frozen(slots=True)
class Outcome:
    """One rank's result: whether the program failed, at which op (None: setting up or at the end), why."""

    failed: bool
    op: int | None = None
    kind: str = ""
    message: str = ""
    detail: str = ""
    seconds: float = 0.0
    counters: dict = attrs.field(factory=dict)


class Failed(Exception):
    """Raised inside a run to stop it; carries the check kind and the problems."""

    def __init__(self, kind: str, problems, detail: str = ""):
        self.kind, self.problems, self.detail = kind, list(problems), detail
        super().__init__("; ".join(self.problems))


def _loss(variant: int, out, targets, loss_fn):
    if variant == 0:
        return loss_fn(out, targets)
    tensor = first_tensor(out).float()
    return tensor.pow(2).mean() if variant == 1 else tensor.tanh().mean()


def _penalised(loss, params):
    grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
    return loss + PENALTY_WEIGHT * sum(g.pow(2).sum() for g in grads if g is not None)


class Mirror:
    """The plain-torch reference: an unsharded copy that runs every rank's slice separately."""

    def __init__(self, subject, world: int):
        self.model = copy.deepcopy(subject.model)
        self.opt = subject.optimizer(self.model.parameters())
        self.loss_fn = subject.loss_fn
        self.world = world
        self.params = dict(self.model.named_parameters())
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.outs: dict[int, list] = {}
        self.losses: dict[int, list] = {}

    def grads(self) -> dict:
        return {name: p.grad for name, p in self.params.items()}

    def apply(self, op, slices) -> None:
        if isinstance(op, Forward) and op.out >= 0:
            inputs = slices[op.batch][0]
            self.model.train(op.mode != "eval")
            self.outs[op.out] = [self.model(x) for x in inputs]
            self.model.train()
        elif isinstance(op, Loss):
            targets = slices[op.batch][1]
            self.losses[op.loss] = [_loss(op.variant, o, t, self.loss_fn)
                                    for o, t in zip(self.outs[op.out], targets)]
        elif isinstance(op, Backward):
            (sum(self.losses[op.loss]) / self.world).backward(retain_graph=op.retain)
        elif isinstance(op, Penalty):
            total = sum(_penalised(loss, self.trainable) for loss in self.losses[op.loss])
            (total / self.world).backward(retain_graph=op.retain)
        elif isinstance(op, Drop):
            del self.outs[op.out]
            for k in op.losses:
                del self.losses[k]
        elif isinstance(op, ZeroGrad):
            self.opt.zero_grad()
        elif isinstance(op, Step):
            self.opt.step()


class Run:
    """One program on one rank (see the module docstring)."""

    def __init__(self, rank: int, world: int, factory, program: Program, options: Options, group):
        self.rank, self.world, self.program, self.options, self.group = rank, world, program, options, group
        subject = load_subject(factory, options.seed)
        self.subject = subject
        self.atol, self.rtol = subject.tolerances()
        self.mirror = Mirror(subject, world)
        c = program.config
        self.model = subject.model
        self.rt = paramfsm.shard(self.model, group=group, units=subject.units, retain=c.retain, prefetch=c.prefetch,
                                 bucket_bytes=c.bucket_bytes, max_deferred_bytes=c.max_deferred_bytes,
                                 trace=True)
        self.opt = subject.optimizer(self.rt.shard_parameters())
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.grad_params = sum(1 for rec in checks.records(self.rt) if rec.requires_grad)
        self.outs: dict = {}
        self.losses: dict = {}
        self.slices: dict = {}
        self.alive: set[int] = set()  # outputs the program still references (their graphs are alive)
        self.retained: set[int] = set()  # alive outputs whose graph a backward retained and none freed
        self.released = False  # the op must leave nothing deferred
        self.fresh = True  # no optimizer step since the last forward: gathered data must be current
        self.marks: list[int] = []  # trace length before each op
        self.owner = {op.loss: op.out for op in program.ops if isinstance(op, Loss)}

    # ------------------------------------------------------------------ ops
    def _batch(self, batch: int):
        if batch not in self.slices:
            inputs, targets = global_batch(self.subject, batch, self.options.seed, self.world, self.options.per_rank)
            self.slices[batch] = (split(inputs, self.world), split(targets, self.world))
        return self.slices[batch]

    def _apply(self, op) -> None:
        rank = self.rank
        if isinstance(op, Forward):
            x = self._batch(op.batch)[0][rank]
            self.fresh = True
            if op.mode in ("no_grad", "eval_no_grad"):
                self.model.train(op.mode == "no_grad")
                with torch.no_grad():
                    self.model(x)
                self.model.train()
            elif op.mode == "checkpoint":
                self.outs[op.out] = torch.utils.checkpoint.checkpoint(self.model, x, use_reentrant=False)
            else:
                self.model.train(op.mode == "train")
                self.outs[op.out] = self.model(x)
                self.model.train()
            if op.out >= 0:
                self.alive.add(op.out)
        elif isinstance(op, Loss):
            targets = self._batch(op.batch)[1][rank]
            self.losses[op.loss] = _loss(op.variant, self.outs[op.out], targets, self.subject.loss_fn)
        elif isinstance(op, Backward):
            kwargs = {"retain_graph": True} if op.retain else {}
            loss = self.losses[op.loss]
            if op.via_runtime:
                self.rt.backward(loss, **kwargs)
            else:
                loss.backward(**kwargs)
            self._after_backward(op.loss, op.retain)
        elif isinstance(op, Penalty):
            kwargs = {"retain_graph": True} if op.retain else {}
            _penalised(self.losses[op.loss], self.trainable).backward(**kwargs)
            self._after_backward(op.loss, op.retain)
        elif isinstance(op, Drop):
            del self.outs[op.out]
            for k in op.losses:
                del self.losses[k]
            self.alive.discard(op.out)
            self.retained.discard(op.out)
        elif isinstance(op, ZeroGrad):
            self.opt.zero_grad()
        elif isinstance(op, Step):
            self.opt.step()
            self.fresh = False
        elif isinstance(op, Flush):
            self.rt.flush()
        elif isinstance(op, Gathered):
            self._gathered(op)

    def _after_backward(self, loss: int, retain: bool) -> None:
        out = self.owner[loss]
        if retain:
            self.retained.add(out)
        else:
            self.retained.discard(out)
            self.released = not self.retained

    def _gathered(self, op: Gathered) -> None:
        modules = (self.model.get_submodule(op.module),) if op.module else ()
        with self.rt.gathered(*modules):
            if op.batch is not None:
                with torch.no_grad():
                    self.model(self._batch(op.batch)[0][self.rank])
            wanted = modules[0].parameters() if modules else self.model.parameters()
            problems = [f"'{self.rt.record(p).name}' is {self.rt.state(p).name} inside rt.gathered"
                        for p in wanted if self.rt.state(p) is not State.AVAILABLE]
            problems += checks.full_values(self.rt, self.mirror.params, self.atol, self.rtol, (State.AVAILABLE,))
            problems += checks.state_invariants(self.rt)
        if problems:
            raise Failed("gathered", problems)

    # ------------------------------------------------------------------ checks
    def _check(self, op, before: dict, all_deferred: bool) -> None:
        rt = self.rt
        problems = checks.state_invariants(rt)
        if problems:
            raise Failed("invariant", problems)
        released_by = ("rt.flush()" if isinstance(op, Flush) else
                       "a backward without retain_graph and no retained graph alive" if self.released else "")
        problems = checks.at_rest(rt, bool(self.alive), self.program.config.retain, released_by)
        if problems:
            raise Failed("at rest", problems)
        problems = checks.matches_reference(rt, self.mirror.params, self.mirror.grads(), self.rank, self.world,
                                            self.atol, self.rtol)
        if problems:
            raise Failed("reference", problems)
        if self.fresh:
            problems = checks.full_values(rt, self.mirror.params, self.atol, self.rtol)
            if problems:
                raise Failed("stale data", problems)
        problems = checks.communication(type(op).__name__, before, rt.counters, all_deferred=all_deferred,
                                        grad_params=self.grad_params, units=len(rt.units))
        if problems:
            raise Failed("communication", problems)

    def _agree(self, failed: bool) -> bool:
        return _agree(self.group, failed)

    def execute(self) -> Outcome:
        start = time.perf_counter()
        rt = self.rt
        for index, op in enumerate(self.program.ops):
            self.marks.append(len(rt.trace))
            failure = None
            try:
                before = rt.counters
                all_deferred = self.program.config.retain == "defer" and all(
                    rec.state is State.DEFERRED_RELEASE for rec in checks.records(rt))
                self.released = False
                self._apply(op)
                self.mirror.apply(op, self.slices)
                self._check(op, before, all_deferred)
            except Failed as exc:
                failure = exc
            except Exception as exc:  # noqa: BLE001 - any error of the runtime is a finding
                failure = Failed("exception", [f"{type(exc).__name__}: {exc}"], traceback.format_exc(limit=-6))
            if self._agree(failure is not None):
                return self._failure(index, failure, start)
        index, problems = checks.trace_problems(rt.trace.records, rt.table)
        failure = Failed("trace", problems) if problems else None
        if self._agree(failure is not None):
            at = bisect.bisect_right(self.marks, index) - 1 if index is not None else None
            return self._failure(at, failure, start)
        counters = rt.counters
        rt.close()
        problems = [f"after rt.close(), '{name}' differs from the reference"
                    for name, p in self.model.named_parameters()
                    if not torch.allclose(p.detach(), self.mirror.params[name].detach(),
                                          atol=self.atol, rtol=self.rtol)]
        failure = Failed("close", problems) if problems else None
        if self._agree(failure is not None):
            return self._failure(None, failure, start)
        return Outcome(False, seconds=time.perf_counter() - start, counters=counters)

    def _failure(self, index, failure: Failed | None, start: float) -> Outcome:
        _abandon(self.rt)
        if failure is None:
            return Outcome(True, index, "peer", "another rank failed", seconds=time.perf_counter() - start)
        return Outcome(True, index, failure.kind, str(failure), failure.detail, time.perf_counter() - start,
                       self.rt.counters)


def _abandon(rt) -> None:
    """Detach a runtime left mid-failure without any collective (its state may be inconsistent)."""
    rt.detach()


def _agree(group, failed: bool) -> bool:
    """Whether any rank failed (every rank calls this at the same point)."""
    flag = torch.tensor([1 if failed else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def run_program(rank: int, world: int, factory, program: Program, options: Options) -> Outcome:
    """The rank job: run ``program`` under ``options.fault`` (if any) in a fresh process group."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=options.timeout_s))
    start = time.perf_counter()
    try:
        with faults.activate(options.fault):
            run, outcome = None, None
            try:
                run = Run(rank, world, factory, program, options, group)
            except Exception as exc:  # noqa: BLE001 - reported as a finding
                outcome = Outcome(True, None, "setup", f"setting up failed: {type(exc).__name__}: {exc}",
                                  traceback.format_exc(limit=-6), time.perf_counter() - start)
            if _agree(group, outcome is not None):
                if run is not None:
                    _abandon(run.rt)
                return outcome or Outcome(True, None, "peer", "another rank failed")
            return run.execute()
    finally:
        dist.destroy_process_group(group)
