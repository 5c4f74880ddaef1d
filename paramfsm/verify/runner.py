"""Run one program on one rank, beside the plain-torch reference, checking after every op.

:func:`run_program` is the job a :class:`~paramfsm.verify.launch.RankPool` runs on
every rank. Each rank shards a fresh model from the factory, keeps an
unsharded deep copy as the reference (:class:`~paramfsm.verify.mirror.Mirror`)
and applies every op of the program to both, the reference first: an op
plain torch cannot run rejects the program as invalid for this model
(the outcome's kind is ``"invalid"``). The reference runs each rank's slice
of the batch separately and averages the slice losses, so its gradients are
exactly the rank-averaged gradients paramfsm produces, gradient penalties
included. The checks live in :class:`~paramfsm.verify.checker.Checker`, which
saved reproductions run too.

After every op (see :mod:`paramfsm.verify.checks`):

- every parameter satisfies the spec's invariants for its state;
- nothing is in flight or held between ops; a parameter is deferred only
  under ``retain="defer"`` while the program still references a graph; after
  ``rt.flush()``, and after a backward without ``retain_graph`` when no
  retained graph is alive, nothing is deferred;
- shards and shard gradients equal this rank's slice of the reference (the
  gradients kept under ``rt.no_sync`` left out until the program synchronises
  them, after which nothing may still be kept; a backward with sync off
  reduce-scatters nothing: :mod:`paramfsm.verify.sync_checks`);
- a forward that records a graph leaves the units ``reshard_after_forward``
  keeps held for its backward; one that records none leaves nothing held;
- gathered data is the current parameter (inside ``rt.gathered``, and for
  every parameter a forward ran since a step or a write last modified it);
- every loss, every output of a unit run again (``SubForward``) and of an
  eval segment equals plain torch's (``Checker.same``); a loss that reads
  another output on each rank (``RankLoss``) trains like plain torch, or
  every rank raises ``RankDesync``, naming a unit and the fix: then the
  program stops there, and its outcome's kind is ``"desync"``, not failed
  (:mod:`paramfsm.verify.rank_loss`);
- communication counts are sane: a backward that finds every parameter
  deferred issues no all-gather, reduce-scatters are bounded by the
  parameters that require grad;
- after a scaler's step, the loss scale is plain torch's (every rank made
  the reference's skip decision); a clip returns plain torch's total norm;
  ``rt.full_state_dict()`` is the reference's state dict; a DCP checkpoint's
  values hold exactly this rank's ``Shard(0)`` range of each parameter (model-shaped pieces by default).

At the end the trace must replay through the spec, every gradient must have
been reduced at most once per graph task, and ``rt.close()`` must restore the
reference parameters. The ranks agree after every op (one tiny all-reduce) on
whether to go on, so a failure on one rank never leaves another blocked in a
collective.

[Note: a compiled graph is freed by the collector]
A graph recorded through compiled blocks (``Config.compiled``) under
activation checkpointing sits in a reference cycle, so dropping the last
reference to its output does not free it: only the cyclic collector does.
paramfsm rightly keeps a retained graph's deferred parameters while the
graph lives, and the at-rest check after the drop would report them. So a
compiled program's ``Drop`` collects; the parameters are returned when the
graph is freed, as in eager mode, and a user's program returns them at its
next forward (a flush) or the next collection.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import shutil
import time
import traceback

import attrs
import torch
import torch.distributed as dist

import paramfsm
import paramfsm.amp
import paramfsm.checkpoint
from paramfsm.verify import faults, user_loops
from paramfsm.verify.checker import Checker, Failed, Rejected, agree
from paramfsm.verify.mirror import loss_of, penalised
from paramfsm.verify.rank_loss import Desynced
from paramfsm.verify.ops import (
    RANK_WRITE, WRITE_MODE, Attach, Backward, Checkpoint, Clip, ClosureStep, Drop, Evaluate, Flush, Forward, FullState,
    Gathered, GatheredWrite, GradSync, Interrupted, Loss, NoSync, Overflow, PartStep, PartZeroGrad, Penalty, Program,
    RankLoss, RequiresGrad, Restore, Save, Step, SubForward, SyncGradients, Unscale, ZeroGrad,
)
from paramfsm.verify.compiled_blocks import compile_blocks
from paramfsm.verify.state_ops import restore_state, save_state
from paramfsm.verify.subject import for_sharding, initialise, load_subject
from paramfsm.verify.loop_helpers import (
    SCALER, another_run, compute_dtype, refused_shard, force_overflow, offload_policy, perturbed, reentrant_blocks,
    forget_recoveries, quiet_recoveries, reshard_policy, unit_arguments,
)


@attrs.frozen(slots=True)
class Options:
    """How to run a program: the seed, the per-rank batch size, an injected fault, the collective timeout."""

    seed: int = 0
    per_rank: int = 2
    fault: str | None = None
    timeout_s: float = 60.0


@attrs.frozen(slots=True)
class Outcome:
    """One rank's result: whether the program failed, at which op (None: setting up or at the end), why.

    A program plain torch cannot run is not failed: its kind is ``"invalid"`` and the message says why. One
    that every rank stopped with ``RankDesync`` after a ``RankLoss`` is not failed either: its kind is
    ``"desync"``, ``op`` is where the ranks raised it and the message is this rank's error.
    """

    failed: bool
    op: int | None = None
    kind: str = ""
    message: str = ""
    detail: str = ""
    seconds: float = 0.0
    counters: dict = attrs.field(factory=dict)


class Run:
    """One program on one rank (see the module docstring)."""

    def __init__(self, rank: int, world: int, factory, program: Program, options: Options, group):
        self.rank, self.world, self.program, self.options, self.group = rank, world, program, options, group
        reference, subject = for_sharding(load_subject(factory, options.seed), factory, options.seed)
        self.subject = subject
        self.check = Checker(subject, program.config, seed=options.seed, per_rank=options.per_rank, group=group,
                             reference=reference)
        c = program.config
        self.model = subject.model
        self.offload, self.folder = offload_policy(subject, c, world)
        if c.refused_shard:
            refused_shard(self.model, group)
        dtype = compute_dtype(c)
        self.upcast = dtype is not None
        self.rt = paramfsm.shard(self.model, group=group, **unit_arguments(subject, c), retain=c.retain,
                                 prefetch=c.prefetch, bucket_bytes=c.bucket_bytes, max_deferred_bytes=c.max_deferred_bytes,
                                 trace=True, param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None,
                                 reshard_after_forward=reshard_policy(c), offload=self.offload,
                                 device=next(reference.parameters()).device if reference is not None else None)
        initialise(self.rt, subject, options.seed)
        if c.compiled:
            compile_blocks(self.model, self.check.blocks)
        self.neighbour = another_run(self.offload, rank, world)  # a second run sharing a disk tier's folder
        self.scaler = paramfsm.amp.GradScaler(self.rt, **SCALER) if c.scaled else None
        self.check.attach(self.rt, self.scaler)
        self.opts = user_loops.optimizers(subject, self.model, self.rt.shard_parameters(), c)
        self.outs: dict = {}
        self.losses: dict = {}
        self.sources = {op.source for op in program.ops if isinstance(op, SubForward)}
        self.acts: dict = {}  # train forward -> the inputs each module got in it (for SubForward ops)
        self.kept: dict = {}  # Save.kind -> (the full state dict, optimizer state dicts), or the DCP folder
        self.window = contextlib.ExitStack()  # an open rt.no_sync() window (NoSync ops)
        self.interruptions = False  # an Interrupted op ran: the recoveries' dumps are removed after each op

    def _inputs(self, batch: int):
        return self.check.batch(batch)[0][self.rank]

    def _apply(self, op) -> None:
        if isinstance(op, Forward):
            x = self._inputs(op.batch)
            if op.mode in ("no_grad", "eval_no_grad"):
                self.model.train(op.mode == "no_grad")
                with torch.no_grad():
                    self.model(x)
                self.model.train()
            elif op.mode == "checkpoint":
                self.outs[op.out] = torch.utils.checkpoint.checkpoint(self.model, x, use_reentrant=False)
            elif op.mode == "reentrant":
                with reentrant_blocks(self.model, self.check.blocks):
                    self.outs[op.out] = self.model(x)
            elif op.mode == WRITE_MODE:  # paramfsm refuses the write: WriteToGathered (accepted by the checker)
                with user_loops.write_in_forward(self.model), user_loops.record_inputs(self.model) as acts:
                    self.outs[op.out] = self.model(x)
                self.acts[op.out] = acts
            elif op.out in self.sources:
                with user_loops.record_inputs(self.model) as self.acts[op.out]:
                    self.outs[op.out] = self.model(x)
            else:
                self.model.train(op.mode == "train")
                self.outs[op.out] = self.model(x)
                self.model.train()
        elif isinstance(op, Loss):
            targets = self.check.batch(op.batch)[1][self.rank]
            self.losses[op.loss] = loss_of(op.variant, self.outs[op.out], targets, self.subject.loss_fn, self.upcast)
            self.check.same(self.losses[op.loss])
        elif isinstance(op, RankLoss):
            self.losses[op.loss] = user_loops.tree_loss(op.variant, self.outs[user_loops.chosen(op.outs, self.rank)])
            self.check.same(self.losses[op.loss])
        elif isinstance(op, Backward):
            kwargs = {"retain_graph": True} if op.retain else {}
            loss = self.losses[op.loss]
            if self.scaler is not None:
                loss = self.scaler.scale(loss)
            if op.via_runtime:
                self.rt.backward(loss, **kwargs)
            else:
                loss.backward(**kwargs)
        elif isinstance(op, Penalty):
            kwargs = {"retain_graph": True} if op.retain else {}
            trainable = [p for p in self.model.parameters() if p.requires_grad]
            penalised(self.losses[op.loss], trainable).backward(**kwargs)
        elif isinstance(op, Drop):
            del self.outs[op.out]
            self.acts.pop(op.out, None)
            for k in op.losses:
                del self.losses[k]
            if self.program.config.compiled:  # [Note: a compiled graph is freed by the collector]
                gc.collect()
        elif isinstance(op, ZeroGrad):
            for opt in self.opts:
                opt.zero_grad(set_to_none=self.program.config.zero_grad_to_none)
        elif isinstance(op, Interrupted):
            self._interrupted(op)
        elif isinstance(op, Step):
            for opt in self.opts:
                self.scaler.step(opt) if self.scaler is not None else opt.step()
            if self.scaler is not None:
                self.scaler.update()
        elif isinstance(op, Flush):
            self.rt.flush()
        elif isinstance(op, Gathered):
            modules = (self.model.get_submodule(op.module),) if op.module else ()
            with self.rt.gathered(*modules):
                if op.batch is not None:
                    with torch.no_grad():
                        self.model(self._inputs(op.batch))
                self.check.inside_gathered(*modules)
        else:
            self._apply_training_op(op)

    def _interrupted(self, op: Interrupted) -> None:
        """The broken-off backward, the recovery and ``zero_grad``; the recoveries' flight-recorder dumps (an
        expected interruption, not a failure) are removed, this one's now, the next forward's at the end."""
        user_loops.interrupt(self.model, op.module, self._inputs(op.batch))
        if op.reset:
            self.rt.reset()
        for opt in self.opts:
            opt.zero_grad(set_to_none=True)
        self.interruptions = True

    def _apply_training_op(self, op) -> None:
        rt = self.rt
        if isinstance(op, Unscale):
            for opt in self.opts:
                self.scaler.unscale_(opt)
        elif isinstance(op, Overflow):
            force_overflow(rt, op.param, op.index)
        elif isinstance(op, Clip):
            self.check.clipped(torch.nn.utils.clip_grad_norm_(rt.shard_parameters(), op.max_norm, op.norm_type)
                               if self.program.config.clip_plain else rt.clip_grad_norm_(op.max_norm, op.norm_type))
        elif isinstance(op, FullState):
            state_dict = rt.full_state_dict()
            self.check.full_state(state_dict)
            rt.load_full_state_dict(perturbed(state_dict) if op.perturb else state_dict)
        elif isinstance(op, Checkpoint):
            path = self.check.scratch_dir()
            paramfsm.checkpoint.save(rt, path)
            self.check.sharded(rt.sharded_state_dict())
            rt.load_full_state_dict(perturbed(rt.full_state_dict()))
            paramfsm.checkpoint.load(rt, path)
        elif isinstance(op, RequiresGrad):
            self.model.get_parameter(op.param).requires_grad_(op.flag)
        elif isinstance(op, NoSync):
            if op.enter:
                self.window.enter_context(rt.no_sync())
            else:
                self.window.close()
        elif isinstance(op, GradSync):
            rt.set_requires_gradient_sync(op.flag)
        elif isinstance(op, SyncGradients):
            rt.sync_gradients()
        else:
            self._apply_user_loop_op(op)

    def _apply_user_loop_op(self, op) -> None:
        rt, model = self.rt, self.model
        if isinstance(op, SubForward):
            out = user_loops.sub_forward(model.get_submodule(op.module), self.acts[op.source][op.module], op.detach,
                                         op.view)
            self.outs[op.out] = out
            self.check.same(out)
        elif isinstance(op, PartStep):
            self.opts[op.part].step()
        elif isinstance(op, PartZeroGrad):
            self.opts[op.part].zero_grad()
        elif isinstance(op, ClosureStep):
            def closure():
                for inner in op.inner:
                    self._apply(inner)
                return self.losses[op.loss]
            self.opts[0].step(closure)
        elif isinstance(op, GatheredWrite):
            modules = (model.get_submodule(op.module),) if op.module else ()
            with torch.no_grad(), rt.gathered(*modules):
                user_loops.write(model.get_parameter(op.param), op.variant, self.rank)
                if op.variant != RANK_WRITE:  # refused at the block's end on every rank, or not_refused
                    self.check.inside_gathered(*modules)
            if op.variant == RANK_WRITE:
                user_loops.not_refused(op)
        elif isinstance(op, Attach):  # ModelChanged on every rank (accepted), or not_refused
            user_loops.attach_and_run(model, op, self._inputs(op.batch))
        elif isinstance(op, Evaluate):
            model.eval()
            with torch.inference_mode() if op.inference else torch.no_grad():
                outs = [model(self._inputs(batch)) for batch in op.batches]
            model.train()
            self.check.same(outs)
        elif isinstance(op, Save):
            self.kept[op.kind] = save_state(rt, self.opts, op, self.check)
        elif isinstance(op, Restore):
            restore_state(rt, self.opts, op, self.kept[op.kind])

    def execute(self) -> Outcome:
        with quiet_recoveries():  # verify's own recoveries (an Interrupted op's, an accepted RankDesync's)
            return self._execute()

    def _execute(self) -> Outcome:
        start = time.perf_counter()
        try:
            for op in self.program.ops:
                with self.check(op):
                    self._apply(op)
                    if isinstance(op, Step):
                        self.neighbour.step()  # the other run in the offload folder trains too
                if self.interruptions:
                    forget_recoveries(self.rt)
            counters = self.rt.counters
            self.neighbour.close()
            self.check.finish()
        except Rejected as exc:
            return Outcome(False, exc.op, "invalid", exc.reason, exc.detail, time.perf_counter() - start)
        except Desynced as exc:
            return Outcome(False, exc.op, "desync", exc.message, "", time.perf_counter() - start, self.rt.counters)
        except Failed as exc:
            return Outcome(True, exc.op, exc.kind, str(exc), exc.detail, time.perf_counter() - start,
                           self.rt.counters)
        return Outcome(False, seconds=time.perf_counter() - start, counters=counters)


def run_program(rank: int, world: int, factory, program: Program, options: Options) -> Outcome:
    """The rank job: run ``program`` under ``options.fault`` (if any) in a fresh process group.

    [Note: a program leaves no process group behind]
    Each program runs on a group of its own, so whatever a fault, a desync or a timeout left posted on it can
    never pair with the next program's messages. The group is destroyed when the program ends, however it ends,
    and then the collector runs: a runtime's schedule, hooks and model refer to each other, and only the cyclic
    collector frees them and with them the last reference to the group. Until that reference goes, gloo keeps
    the group's threads (three) and sockets alive; a verify of a few hundred programs otherwise ended with
    thousands of threads in each rank. A full collection walks the whole heap of a rank that imported torch,
    the model's libraries and Hypothesis (50 ms a program, a tenth of a small program's time), so before the
    program starts what is alive is collected and frozen (``gc.freeze``), as a rank of a
    :class:`~paramfsm.verify.launch.RankPool` froze its start-up heap (see [Note: a rank's start-up heap is frozen]):
    the collection at the end walks only what this program made. Nothing frozen can hold this program's group,
    which does not exist yet. ``tests/test_verify_leaks.py`` holds every outcome to flat counts.
    """
    gc.collect()
    gc.freeze()
    group = dist.new_group(timeout=datetime.timedelta(seconds=options.timeout_s))
    try:
        return _run_on(group, rank, world, factory, program, options)
    finally:
        dist.destroy_process_group(group)
        del group
        gc.collect()


def _run_on(group, rank: int, world: int, factory, program: Program, options: Options) -> Outcome:
    start = time.perf_counter()
    with faults.activate(options.fault):
        run, outcome = None, None
        try:
            run = Run(rank, world, factory, program, options, group)
        except Exception as exc:  # noqa: BLE001 - reported as a finding
            outcome = Outcome(True, None, "setup", f"setting up failed: {type(exc).__name__}: {exc}",
                              traceback.format_exc(limit=-6), time.perf_counter() - start)
        if agree(group, int(outcome is not None)):
            if run is not None:
                run.rt.detach()
                run.neighbour.close(strict=False)
            return outcome or Outcome(True, None, "peer", "another rank failed")
        try:
            return run.execute()
        finally:
            run.neighbour.close(strict=False)
            if run.folder is not None:  # a disk tier's folder (its files went with rt.close())
                shutil.rmtree(run.folder, ignore_errors=True)
