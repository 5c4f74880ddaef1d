"""The plain-torch reference of one rank and the checks ``paramfsm verify`` runs around every op.

A :class:`Checker` wraps each op of a program, however the op is executed:
by :mod:`paramfsm.verify.runner` on the ranks of a pool, or by the lines of a
saved reproduction script (:mod:`paramfsm.verify.reproduction`)::

    check = Checker(subject, Config(), seed=0, per_rank=2)   # copies the model before sharding
    rt = paramfsm.shard(model, ...)
    check.attach(rt)
    with check(Forward(out=0, batch=0, mode="train")):
        out0 = model(x0)                                      # the op, on the sharded model
    ...
    check.finish()                                            # the trace, then rt.close()

Entering the block applies the op to the reference first (:class:`~paramfsm.verify.mirror.Mirror`),
so an op plain torch cannot run (a model without double backward, say)
raises :class:`Rejected` before paramfsm runs it: a limit of the model, not a
paramfsm bug. Leaving the block runs the checks of
:mod:`paramfsm.verify.checks` (see :mod:`paramfsm.verify.runner` for the
list) and raises :class:`Failed` on a problem, or on any exception the op
raised. Every rank calls one tiny all-reduce per op so that all ranks stop
at the same op, whichever rank saw the problem. From the first
:class:`~paramfsm.verify.ops.RankLoss` on, a ``RankDesync`` raised on every
rank stops the program without failing it (:mod:`paramfsm.verify.rank_loss`).
"""

from __future__ import annotations

import bisect
import shutil
import traceback

import torch
import torch.distributed as dist

from paramfsm.core.spec import State
from paramfsm.verify import checks, loop_helpers, rank_loss, sync_checks, user_loops
from paramfsm.verify.mirror import Mirror, loss_of, penalised  # noqa: F401 - re-exported for the runner
from paramfsm.verify.ops import (
    Backward, Checkpoint, Clip, ClosureStep, Config, Drop, Evaluate, Flush, Forward, FullState, Gathered,
    GatheredWrite, GradSync, Interrupted, Loss, NoSync, PartStep, Penalty, RankLoss, Restore, Save, Step, SubForward, SyncGradients, ZeroGrad,
)
from paramfsm.verify.subject import describe, global_batch, split
from paramfsm.verify.verdicts import Failed, Rejected, agree  # noqa: F401 - re-exported for the runner

_OK, _FAILED, _REJECTED, _DESYNC = 0, 1, 2, 3  # what a rank reports for an op; the ranks agree on the largest


#: Forward modes whose graph a retained backward keeps whole (no checkpointing recomputes its units).
PLAIN_MODES = ("train", "eval")


class Checker:
    """The reference and the checks of one rank, around ops run elsewhere (see the module docstring)."""

    def __init__(self, subject, config: Config = Config(), *, seed: int = 0, per_rank: int = 2, group=None,
                 reference=None):
        self.subject, self.config, self.seed, self.per_rank, self.group = subject, config, seed, per_rank, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.atol, self.rtol = loop_helpers.tolerances(subject, config)
        # reference: the plain model the mirror copies when it is not the subject's (Subject(meta=True))
        self.mirror = Mirror(subject, self.world, config, reference)
        # the same math in another valid order: how far plain torch differs from itself ([Note: plain torch's own
        # noise] in paramfsm.verify.mirror)
        self.noise_ref = Mirror(subject, self.world, config, reference, rank_order=True)
        self.blocks = self.mirror.blocks  # what a reentrant forward checkpoints
        self.rt = None
        self.scaler = None
        self.scratch: list[str] = []  # DCP folders to remove once every rank is past the op
        self.slices: dict = {}
        self.index = -1  # the op being run
        self.alive: set[int] = set()  # outputs the program still references (their graphs are alive)
        self.retained: set[int] = set()  # alive outputs whose graph a backward retained and none freed
        self.owner: dict[int, int] = {}  # loss -> output
        self.modes: dict[int, str] = {}  # output -> the mode of the forward that made it
        self.released = False  # the op must leave nothing deferred
        self.rank_loss = False  # a RankLoss ran: a RankDesync on every rank is accepted (paramfsm.verify.rank_loss)
        # Parameters modified (a step, a write) since a forward last ran them: their gathered data may be older.
        self.unfresh: set[str] = set()
        self.nan_padded: set[str] = set()  # gradients whose padding a NaN clip coefficient made NaN
        self.names = {id(p): name for name, p in self.mirror.model.named_parameters()}
        self.dirs: list[str] = []  # DCP folders of Save ops, removed at the end
        self.marks: list[int] = []  # trace length before each op
        # Gradient sync: the switch, an open no_sync window, whether a backward kept gradients since they
        # were last synchronised or zeroed, and whether sync was on when the op began.
        self.sync_on, self.window, self.accumulating, self.syncing = True, False, False, True
        self._graphs: dict = {}  # kept units' live graph counts before a forward
        self._op = None
        self._before: dict = {}
        self._all_deferred = False

    def attach(self, rt, scaler=None) -> None:
        """Check this runtime (``paramfsm.shard`` of the subject's model, with ``trace=True``) and its
        ``paramfsm.amp.GradScaler`` (fp16 programs)."""
        self.rt, self.scaler = rt, scaler

    def batch(self, batch: int):
        """Global batch ``batch`` split into the ranks' slices: ``(input slices, target slices)``."""
        if batch not in self.slices:
            inputs, targets = global_batch(self.subject, batch, self.seed, self.world, self.per_rank)
            self.slices[batch] = (split(inputs, self.world), split(targets, self.world))
        return self.slices[batch]

    # ------------------------------------------------------------------ around one op
    def __call__(self, op) -> "Checker":
        self._op = op
        return self

    def __enter__(self) -> "Checker":
        op, rt = self._op, self.rt
        self.index += 1
        self.marks.append(len(rt.trace))
        self._before = rt.counters
        self._all_deferred = self.config.retain == "defer" and all(
            rec.state is State.DEFERRED_RELEASE for rec in checks.records(rt))
        self.released = False
        self.syncing = self.sync_on and not self.window
        self._graphs = sync_checks.graphs_of(rt) if isinstance(op, Forward) else {}
        try:
            for batch in {getattr(op, "batch", None), *getattr(op, "batches", ())} - {None}:
                self.batch(batch)
            self.mirror.apply(op, self.slices)
            self.noise_ref.apply(op, self.slices)
        except Exception as exc:  # noqa: BLE001 - whatever plain torch raises rejects the op
            agree(self.group, _REJECTED)
            self._stop()
            raise Rejected(describe(exc), self.index, traceback.format_exc(limit=-4)) from None
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if isinstance(exc, (KeyboardInterrupt, SystemExit, GeneratorExit)):  # not a finding; DCP's
            return False  # CheckpointException derives from BaseException and is one
        failure = None
        desync = rank_loss.accepted(exc, self.rank_loss, self._op)
        if isinstance(exc, Failed):
            failure = exc
        elif exc is not None and not desync:
            detail = "".join(traceback.format_exception(exc, limit=-6))
            message = str(exc)
            for path in self.scratch:  # a temporary folder's name differs between runs: not in the finding
                message = message.replace(path, "<scratch folder>")
            failure = Failed("exception", [f"{type(exc).__name__}: {message}"], detail)
        elif not desync:
            try:
                self._track(self._op)
                self._check(self._op)
            except Failed as found:
                failure = found
        code = agree(self.group, _DESYNC if desync else _FAILED if failure is not None else _OK)
        self._clean_scratch()
        if code == _OK:
            return False
        if code == _DESYNC:
            failure = self._desync(exc if desync else None, failure)
        self._stop()
        if code == _REJECTED:
            raise Rejected("another rank's reference failed", self.index) from None
        failure = failure or Failed("peer", ["another rank failed"])
        failure.op = self.index
        raise failure from None

    def _desync(self, exc, failure: Failed | None) -> Failed:
        """Some rank raised an accepted RankDesync: stop the program if every rank did, else fail the check."""
        problems = rank_loss.judge(self.group, exc, failure is not None)
        if problems is None:
            self.rt.reset()  # every rank issued the collectives still in flight
            rank_loss.forget_dumps(exc, self.rt)
            self._stop()
            raise rank_loss.Desynced(str(exc), self.index, rank_loss.refusal(exc, self._op)) from None
        return failure or Failed("desync", problems)

    def _stop(self) -> None:
        """Detach the runtime without any collective: after a failure its state may be inconsistent."""
        self.rt.detach()
        self._remove_dirs()

    def _remove_dirs(self) -> None:
        if self.rank == 0:
            for path in self.dirs:
                shutil.rmtree(path, ignore_errors=True)
        self.dirs.clear()

    def _names(self, params) -> set[str]:
        return {self.names[id(p)] for p in params}

    def _track(self, op) -> None:
        if isinstance(op, ClosureStep):  # its inner ops, then the step
            for inner in (*op.inner, Step()):
                self._track(inner)
        if isinstance(op, (Forward, Evaluate)):
            self.unfresh.clear()
        if isinstance(op, (Forward, SubForward)) and op.out >= 0:
            self.alive.add(op.out)
            self.modes[op.out] = op.mode if isinstance(op, Forward) else "sub"
        if isinstance(op, SubForward):
            self.unfresh -= self._names(self.mirror.model.get_submodule(op.module).parameters())
        elif isinstance(op, PartStep):
            self.unfresh |= self._names(p for g in self.mirror.opts[op.part].param_groups for p in g["params"])
        elif isinstance(op, GatheredWrite):
            self.unfresh.add(op.param)
        elif isinstance(op, Loss):
            self.owner[op.loss] = op.out
        elif isinstance(op, RankLoss):  # this rank's backward of it reaches its own output's graph only
            self.owner[op.loss], self.rank_loss = user_loops.chosen(op.outs, self.rank), True
        elif isinstance(op, (Backward, Penalty)):
            self.accumulating = not self.syncing
            out = self.owner[op.loss]
            if op.retain:
                self.retained.add(out)
            else:
                self.retained.discard(out)
                self.released = not self.retained
        elif isinstance(op, Drop):
            self.alive.discard(op.out)
            self.retained.discard(op.out)
        elif isinstance(op, Step):
            self.unfresh = set(self.mirror.params)
        elif isinstance(op, (ZeroGrad, SyncGradients, Interrupted)):
            self.accumulating = False
        elif isinstance(op, NoSync):
            self.window = op.enter
        elif isinstance(op, GradSync):
            self.sync_on = op.flag
        elif isinstance(op, Clip) and torch.isnan(self.mirror.norm):
            self.nan_padded |= {name for name, p in self.mirror.params.items() if p.grad is not None}
        self.nan_padded = {name for name in self.nan_padded if self.mirror.params[name].grad is not None}

    def _clean_scratch(self) -> None:
        """Remove the op's DCP folders (every rank has passed the op's agreement, so none still reads them)."""
        if self.rank == 0:
            for path in self.scratch:
                shutil.rmtree(path, ignore_errors=True)
        self.scratch.clear()

    def _check(self, op) -> None:
        rt = self.rt
        problems = checks.state_invariants(rt)
        if problems:
            raise Failed("invariant", problems)
        released_by = ("rt.flush()" if isinstance(op, Flush) else
                       "a backward without retain_graph and no retained graph alive" if self.released else "")
        # Without rt.reset() an interrupted backward's units stay gathered until the next forward recovers them
        # (which the program runs next).
        unrecovered = isinstance(op, Interrupted) and not op.reset
        problems = [] if unrecovered else checks.at_rest(rt, bool(self.alive), self.config.retain, released_by)
        if isinstance(op, (Backward, Penalty)) and op.retain and self.modes.get(self.owner[op.loss]) in PLAIN_MODES:
            problems += checks.retained_window(rt, type(op).__name__, self.config)
        if problems:
            raise Failed("at rest", problems)
        kept = sync_checks.kept_names(rt)
        problems = sync_checks.synchronised(kept, self.accumulating, f"a {type(op).__name__} op")
        problems += sync_checks.kept_without_sync(type(op).__name__, self.syncing, self._before, rt.counters)
        if problems:
            raise Failed("sync", problems)
        unsynced = frozenset(self.mirror.params) if self.accumulating else frozenset()
        noise = checks.noise(self.mirror.params, self.noise_ref.params)
        problems = checks.matches_reference(rt, self.mirror.params, self.mirror.grads(), self.rank, self.world,
                                            self.atol, self.rtol, unsynced, frozenset(self.nan_padded), noise)
        if problems:
            raise Failed("reference", problems)
        problems = self._reshard_problems(op)
        if problems:
            raise Failed("reshard", problems)
        fresh = {k: v for k, v in self.mirror.params.items() if k not in self.unfresh}
        problems = checks.full_values(rt, fresh, self.atol, self.rtol, noise=noise)
        if problems:
            raise Failed("stale data", problems)
        state_op = isinstance(op, (FullState, Checkpoint, Save))  # one all-gather per parameter, by design
        # A whole-parameter optimizer's step gathers each parameter and its gradient (paramfsm.optim.whole_params);
        # a ClosureStep is refused under one, and a Restore primes the state with a step.
        state_op += 2 * (self.config.optimizer != "subject" and isinstance(op, (Step, PartStep, Restore)))
        forwards = len(op.batches) - 1 if isinstance(op, Evaluate) else 0  # an eval segment's later forwards
        problems = checks.communication(type(op).__name__, self._before, rt.counters,
                                        all_deferred=self._all_deferred,
                                        grad_params=sum(rec.requires_grad for rec in checks.records(rt)),
                                        units=len(rt.units), extra_gathers=len(checks.records(rt)) * state_op
                                        + 2 * len(rt.units) * forwards)
        if problems:
            raise Failed("communication", problems)
        if isinstance(op, Step) and self.scaler is not None:
            got, want = self.scaler.get_scale(), self.mirror.scaler.get_scale()
            if got != want:
                raise Failed("scaler", [f"the loss scale is {got} after scaler.update(), plain torch's is {want} "
                                        "(the ranks and the reference disagree on skipping the step)"])

    def _reshard_problems(self, op) -> list[str]:
        """A forward that recorded a graph holds its kept units; one that recorded none holds nothing."""
        if isinstance(op, Forward) and op.out >= 0:
            return sync_checks.kept_after_forward(self.rt, self._graphs)
        if isinstance(op, (Forward, Evaluate)) or isinstance(op, Gathered) and op.batch is not None:
            return sync_checks.nothing_kept(self.rt, f"a {type(op).__name__} op" +
                                            (f" in mode {op.mode}" if isinstance(op, Forward) else ""))
        return []

    # ------------------------------------------------------------------ results handed over by an op
    def _agreed(self, kind: str, problems: list[str]) -> None:
        """Raise on every rank if any rank found problems: the op's later collectives must not run on some only."""
        if agree(self.group, _FAILED if problems else _OK) != _OK:
            raise Failed(kind if problems else "peer", problems or ["another rank failed"])

    def clipped(self, total) -> None:
        """After ``total = rt.clip_grad_norm_(...)``: the total norm is plain torch's."""
        want = self.mirror.norm
        problems = [] if torch.allclose(total.float(), want.float(), atol=self.atol, rtol=self.rtol,
                                        equal_nan=True) else [
            f"rt.clip_grad_norm_ returned a total norm of {float(total):.6g}, plain torch's is {float(want):.6g}"]
        self._agreed("clip", problems)

    def full_state(self, state_dict) -> None:
        """After ``sd = rt.full_state_dict()``: the keys and values of the reference's ``state_dict()``."""
        want = self.mirror.saved
        problems = [f"rt.full_state_dict() lacks '{k}'" for k in want if k not in state_dict]
        problems += [f"rt.full_state_dict() has an extra key '{k}'" for k in state_dict if k not in want]
        problems += [f"rt.full_state_dict()['{k}'] differs from the reference's" for k in want
                     if k in state_dict and checks.close(state_dict[k], want[k], self.atol, self.rtol) is not None]
        self._agreed("state dict", problems)

    def sharded(self, state_dict) -> None:
        """After a DCP save: every parameter's value holds exactly this rank's ``Shard(0)`` chunk of the
        flattened reference parameter (the chunk ``torch.chunk`` gives it: a flat DTensor's local tensor, or
        the range a model-shaped value's pieces cover), and buffers are the reference's."""
        noise = checks.noise(self.mirror.params, self.noise_ref.params)  # plain torch's own, as for parameters
        self._agreed("checkpoint", checks.sharded_problems(state_dict, dict(self.mirror.model.state_dict()), noise,
                                                           self.rank, self.world, self.atol, self.rtol))

    def same(self, value) -> None:
        """After a loss, a unit's forward or an eval segment: ``value`` (this rank's) is plain torch's, tensor by
        tensor (any container)."""
        problems = checks.same_values(user_loops.tensors(value), user_loops.tensors(self.mirror.expected[self.rank]),
                                      user_loops.tensors(self.noise_ref.expected[self.rank]), self.atol, self.rtol,
                                      f"{type(self._op).__name__} op")
        if problems:
            raise Failed("output", problems)

    def checkpoint_dir(self) -> str:
        """A folder for a Save op's DCP checkpoint, the same on every rank, removed at the end (collective)."""
        path = loop_helpers.scratch_dir(self.group)
        self.dirs.append(path)
        return path

    def scratch_dir(self) -> str:
        """A temporary folder for a DCP checkpoint, the same on every rank, removed after the op (collective)."""
        path = loop_helpers.scratch_dir(self.group)
        self.scratch.append(path)
        return path

    def inside_gathered(self, *modules) -> None:
        """Inside ``with rt.gathered(*modules)``: every parameter there is AVAILABLE and current."""
        rt = self.rt
        wanted = modules[0].parameters() if modules else self.subject.model.parameters()
        problems = [f"'{rt.record(p).name}' is {rt.state(p).name} inside rt.gathered"
                    for p in wanted if rt.state(p) is not State.AVAILABLE]
        problems += checks.full_values(rt, self.mirror.params, self.atol, self.rtol, (State.AVAILABLE,))
        problems += checks.state_invariants(rt)
        if problems:
            raise Failed("gathered", problems)

    # ------------------------------------------------------------------ at the end
    def finish(self) -> None:
        """The trace replays through the spec, then ``rt.close()`` restores the reference parameters."""
        rt = self.rt
        agree(self.group, _OK)  # every rank is done with the Save ops' folders
        self._remove_dirs()
        index, problems = checks.trace_problems(rt.trace.records, rt.table)
        at = bisect.bisect_right(self.marks, index) - 1 if index is not None else None
        self._settle(Failed("trace", problems, op=at) if problems else None, at)
        rt.close()
        model = self.subject.model
        noise = checks.noise(self.mirror.params, self.noise_ref.params)  # plain torch's own, as for parameters
        problems = [f"after rt.close(), '{name}' differs from the reference"
                    for name, p in model.named_parameters()
                    if not torch.allclose(p.detach(), self.mirror.params[name].detach(),
                                          atol=self.atol + checks.NOISE_FACTOR * noise[name][0], rtol=self.rtol)]
        self._settle(Failed("close", problems) if problems else None, None, closed=True)

    def _settle(self, failure: Failed | None, op: int | None, closed: bool = False) -> None:
        if not agree(self.group, _FAILED if failure is not None else _OK):
            return
        if not closed:
            self._stop()
        raise failure or Failed("peer", ["another rank failed"], op=op)
