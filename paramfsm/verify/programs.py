"""Training-loop programs: small op records and a hypothesis strategy that draws valid ones.

A :class:`Program` is a :class:`Config` (how the model is sharded, and in
which precision) and a tuple of ops (:mod:`paramfsm.verify.ops`, re-exported
here). Ops are frozen, slotted records, so a program pickles in a few hundred
bytes: the test process draws it once and sends the same program to every
rank and to the plain-torch reference (:mod:`paramfsm.verify.runner`).

[Note: intents, then a normaliser]
The strategy does not draw ops directly. It draws a list of *intents*
(``(kind, a, b, flag)`` tuples of small integers) and :func:`normalise` turns
them into ops while tracking which autograd graphs are alive, retained, freed
by a backward, or stale after an optimizer step, a write or a state-dict load (see
[Note: which graphs an op makes stale] in :mod:`paramfsm.verify.user_loop_intents`), and
what the loop allows (a scaler steps only with gradients and unscales once
per step; one parameter always stays trainable). An intent that cannot apply
is completed (a backward with no loss first runs a forward and takes a loss)
or skipped. So every drawn program is valid plain PyTorch (no backward through
a freed graph, none through parameters an optimizer step modified in place),
and hypothesis shrinks a failure by deleting intents and lowering integers
with no risk of producing an invalid program. The program ends by dropping
every live output, so retained-graph cleanup is always exercised.

:func:`paramfsm.verify.reproduction.render` prints a program as a runnable
script that calls only the public API.
"""

from __future__ import annotations

from typing import Sequence

import attrs
from hypothesis import strategies as st

from paramfsm.verify.accumulation_intents import ACCUMULATION_KINDS, AccumulationIntents
from paramfsm.verify.ops import (  # noqa: F401 - the vocabulary, re-exported for existing imports
    AUTO_MODES, BATCHES, CLIP_NORM_TYPES, CLIP_NORMS, GRAD_MODES, LOSS_VARIANTS, MODES, PENALTY_WEIGHT, Backward,
    Attach, Checkpoint, Clip, ClosureStep, Config, Drop, Evaluate, Flush, Forward, FullState, Gathered, GatheredWrite,
    GradSync, Interrupted, Loss, NoSync, Op, Overflow, PartStep, PartZeroGrad, Penalty, Program, RankLoss, RequiresGrad, Restore,
    Save, Shape, Step, SubForward, SyncGradients, UNIT_CHOICES, Unscale, ZeroGrad,
)
from paramfsm.verify.canonical import CANONICAL  # noqa: F401 - re-exported: the patterns canonical() normalises
from paramfsm.verify.user_loop_intents import CANONICAL_KINDS, USER_LOOP_KINDS, UserLoopIntents


# ------------------------------------------------------------------ normaliser

@attrs.define(slots=True)
class _Output:
    """An output the program holds, with its losses and whether its graph can still run a backward."""

    id: int
    batch: int
    losses: list = attrs.Factory(list)
    freed: bool = False  # a backward without retain_graph freed its graph
    saved: dict = attrs.Factory(dict)  # part -> its version when the graph saved its parameters
    reentrant: bool = False  # its blocks ran under reentrant checkpointing (no autograd.grad through it)
    graph: int = -1  # outputs of one graph (a unit run on saved inputs that were not detached) share its fate
    sub: bool = False  # a unit's output (SubForward), not the root's
    train: bool = False  # a train-mode root forward: its inputs are saved for SubForward ops


KINDS = ("backward", "forward", "loss", "zero_grad", "step", "iteration", "drop", "flush",
         "gathered", "penalty", "multi_loss", "accumulate", "backward", "forward", "multi_loss",
         "clip", "state_dict", "requires_grad", "overflow", "unscale", "interrupt") + ACCUMULATION_KINDS + USER_LOOP_KINDS


class _Normaliser(AccumulationIntents, UserLoopIntents):
    """Turns intents into ops, tracking the outputs (graphs) a valid program may still use.

    It also tracks what the loop's state allows: whether any gradient exists
    since the last ``zero_grad`` (a scaler cannot step without one), whether
    the scaler has unscaled since its last step (once per step, as torch
    requires), which parameters are frozen (one always stays trainable), and
    whether gradients are kept unsynchronised (see
    :mod:`paramfsm.verify.accumulation_intents`).
    """

    def __init__(self, shape: Shape, config: Config = Config()):
        self.shape, self.config = shape, config
        self.ops: list = []
        self.outputs: list[_Output] = []
        self.next_out = 0
        self.next_loss = 0
        self.has_grads = False
        self.unscaled = False
        self.frozen: set[str] = set()
        self.start_user_loops()

    def usable(self) -> list[_Output]:
        return [o for o in self.outputs if not o.freed and not self.stale(o)]

    def new_output(self, batch: int, **kwargs) -> _Output:
        out = _Output(self.next_out, batch, saved=self.current(range(self.shape.optimizers)), graph=self.next_out,
                      **kwargs)
        self.next_out += 1
        self.outputs.append(out)
        return out

    def forward(self, batch: int, mode: str) -> _Output | None:
        if mode == "checkpoint" and not self.shape.checkpoint or mode == "reentrant" and not self.shape.blocks:
            mode = "train"
        if mode not in GRAD_MODES:
            self.ops.append(Forward(-1, batch, mode))
            return None
        out = self.new_output(batch, reentrant=mode == "reentrant", train=mode == "train")
        self.ops.append(Forward(out.id, batch, mode))
        return out

    def loss(self, out: _Output, variant: int) -> int:
        if not self.shape.tensor_output and not out.sub:
            variant = 0
        loss = self.next_loss
        self.next_loss += 1
        out.losses.append(loss)
        variant = self.tree_variant(variant) if out.sub else variant % LOSS_VARIANTS
        self.ops.append(Loss(loss, out.id, out.batch, variant))
        return loss

    def some_loss(self, a: int, b: int) -> tuple[_Output, int]:
        """A loss on a usable output, taking one (and running a forward) when there is none."""
        usable = [o for o in self.usable() if o.losses]
        if usable:
            out = usable[a % len(usable)]
            return out, out.losses[b % len(out.losses)]
        outs = self.usable()
        out = outs[a % len(outs)] if outs else self.forward(b % BATCHES, AUTO_MODES[a % len(AUTO_MODES)])
        return out, self.loss(out, b)

    def backward(self, out: _Output, loss: int, retain: bool, via_runtime: bool) -> None:
        self.ops.append(Backward(loss, retain, via_runtime))
        self.has_grads = True
        self.took_grads()
        if not retain:
            self.free(out)

    def trainable(self) -> list[tuple[str, int]]:
        return [(name, numel) for name, numel in self.shape.params if name not in self.frozen]

    def apply(self, kind: str, a: int, b: int, flag: bool) -> None:
        if kind == "forward":
            self.forward(b % BATCHES, MODES[a % len(MODES)])
        elif kind == "loss":
            outs = self.usable()
            out = outs[a % len(outs)] if outs else self.forward(b % BATCHES, "train")
            self.loss(out, b)
        elif kind == "penalty" and self.shape.allow_create_graph and self.config.param_dtype is None:
            out, loss = self.some_loss(a, b)
            if out.reentrant:  # reentrant checkpointing refuses autograd.grad: a plain backward instead
                self.backward(out, loss, flag, False)
                return
            self.ops.append(Penalty(loss, flag))
            self.has_grads = True
            self.took_grads()
            if not flag:
                self.free(out)
        elif kind in ("backward", "penalty"):
            out, loss = self.some_loss(a, b)
            self.backward(out, loss, flag, bool(b % 2))
        elif kind in ("iteration", "accumulate"):
            self.zero_grad()
            for micro in range(1 + (b % 3 if kind == "accumulate" else 0)):
                out = self.forward((b + micro) % BATCHES, AUTO_MODES[a % len(AUTO_MODES)])
                self.backward(out, self.loss(out, a), False, flag)
                self.drop(out)
            self.apply("step", a, b, flag)
        elif kind == "multi_loss":
            self.multi_loss(a, b, flag)
        elif kind == "drop" and self.outputs:
            self.drop(self.outputs[a % len(self.outputs)])
        elif kind == "zero_grad":
            self.zero_grad()
            self.has_grads = False
        elif kind == "step" and (self.has_grads or not self.config.scaled):
            self.synced()
            self.ops.append(Step())
            self.unscaled = False
            self.stepped_parts(range(self.shape.optimizers))
        elif kind == "flush":
            self.ops.append(Flush())
        elif kind == "gathered":
            names = (None,) + self.shape.modules
            self.ops.append(Gathered(names[a % len(names)], b % BATCHES if flag else None))
        elif kind in ACCUMULATION_KINDS:
            self.accumulation_op(kind, a, b, flag)
        elif kind in USER_LOOP_KINDS or kind in CANONICAL_KINDS:
            self.user_loop_op(kind, a, b, flag)
        else:
            self.training_op(kind, a, b, flag)

    def training_op(self, kind: str, a: int, b: int, flag: bool) -> None:
        """Clipping, loss-scaler ops, state-dict round trips and freezing (see :mod:`paramfsm.verify.ops`)."""
        scaled = self.config.scaled
        if kind == "clip":
            self.synced()
            if scaled and self.has_grads and not self.unscaled:
                self.unscale()
            self.ops.append(Clip(CLIP_NORMS[a % len(CLIP_NORMS)], CLIP_NORM_TYPES[b % len(CLIP_NORM_TYPES)]))
        elif kind == "unscale" and scaled and self.has_grads and not self.unscaled:
            self.unscale()
        elif kind == "overflow" and scaled and self.has_grads and not self.unscaled and self.trainable():
            name, numel = self.trainable()[a % len(self.trainable())]
            self.synced()
            self.ops.append(Overflow(name, b * numel // 8))
        elif kind == "state_dict":
            self.ops.append(Checkpoint() if flag else FullState(bool(a % 2)))
            self.modified()
        elif kind == "interrupt" and self.shape.modules:
            for out in list(self.outputs):  # between iterations: no graph alive
                self.drop(out)
            self.close_window()
            self.ops.append(Interrupted(b % BATCHES, self.shape.modules[a % len(self.shape.modules)], flag))
            self.has_grads = self.kept = False  # zero_grad(set_to_none=True) after it
            if not flag:  # no rt.reset(): the next forward recovers (the documented way), and comes at once
                self.forward(a % BATCHES, "no_grad")
        elif kind == "requires_grad" and self.shape.params:
            name = self.shape.params[a % len(self.shape.params)][0]
            unfreeze = name in self.frozen
            if not unfreeze and len(self.trainable()) <= 1:
                return
            for out in list(self.outputs):  # between iterations: no graph alive
                self.drop(out)
            self.frozen.symmetric_difference_update({name})
            self.synced()
            self.ops.append(RequiresGrad(name, unfreeze))

    def unscale(self) -> None:
        self.synced()
        self.ops.append(Unscale())
        self.unscaled = True

    def multi_loss(self, a: int, b: int, via_runtime: bool) -> None:
        """One forward, two or three losses, a backward each (all but the last retaining the graph).

        ``b % 4``: 2 retains the last backward too and then drops the graph;
        3 calls ``rt.flush()`` between the backward passes.
        """
        out = self.forward(b % BATCHES, AUTO_MODES[a % len(AUTO_MODES)])
        variant = b % 4
        losses = [self.loss(out, a + i) for i in range(2 + (b // 4) % 2)]
        for i, loss in enumerate(losses):
            last = i == len(losses) - 1
            self.zero_grad()
            self.backward(out, loss, not last or variant == 2, via_runtime)
            if variant == 3 and not last:
                self.ops.append(Flush())
        if variant == 2:
            self.drop(out)

    def drop(self, out: _Output) -> None:
        self.outputs.remove(out)
        self.ops.append(Drop(out.id, tuple(out.losses)))


def normalise(intents: Sequence[tuple], shape: Shape, config: Config = Config()) -> Program:
    """Turn drawn intents into a valid program (see [Note: intents, then a normaliser])."""
    norm = _Normaliser(shape, config)
    for kind, a, b, flag in intents:
        norm.apply(kind, a, b, flag)
    for out in list(norm.outputs):
        norm.drop(out)
    norm.finish_accumulation()
    return Program(config, tuple(norm.ops))


def canonical(shape: Shape) -> list[Program]:
    """The :data:`CANONICAL` patterns as programs for a model of this shape."""
    return [normalise(intents, shape, config) for config, intents in CANONICAL]


def kept_alternate(shape: Shape) -> tuple[str, ...]:
    """Units a drawn ``reshard_after_forward`` predicate keeps: the root and every second unit module."""
    return ("",) + shape.modules[1::2]


def configs(shape: Shape | None = None) -> st.SearchStrategy[Config]:
    """Sharding configurations, weighted towards the defaults of ``paramfsm.shard`` (and shrinking to them)."""
    kept = (kept_alternate(shape),) if shape is not None else ()
    units = ("default", "one") if shape is not None and shape.own_units else UNIT_CHOICES
    return st.builds(
        Config,
        units=st.sampled_from(units),
        offload=st.sampled_from((None, None, None, "cpu", "disk", "cpu-bounded")),
        optimizer=st.sampled_from(("subject", "subject", "adafactor")),
        step_hooks=st.booleans(),
        zero_grad_to_none=st.sampled_from((True, False)),
        clip_plain=st.booleans(),
        refused_shard=st.sampled_from((False, False, False, True)),
        compiled=st.sampled_from((False,) * 7 + (True,)),
        retain=st.sampled_from(("defer", "regather", "defer")),
        prefetch=st.sampled_from((1, 0, 2)),
        bucket_bytes=st.sampled_from((8 << 20, 1)),
        max_deferred_bytes=st.sampled_from((None, 4096, None)),
        param_dtype=st.sampled_from((None, "float16", "bfloat16")),
        reshard_after_forward=st.sampled_from((True, True, True, False) + kept),
    ).map(lambda c: _whole_steppable(c, shape))


def _whole_steppable(config: Config, shape: Shape | None) -> Config:
    """A whole-parameter optimizer is refused under offload (paramfsm.optim.whole_params): the subject's then."""
    offloaded = config.offload is not None or (shape is not None and shape.offload)
    return attrs.evolve(config, optimizer="subject") if offloaded else config


def intents(max_ops: int) -> st.SearchStrategy[list]:
    intent = st.tuples(st.sampled_from(KINDS), st.integers(0, 7), st.integers(0, 7), st.booleans())
    return st.lists(intent, min_size=1, max_size=max_ops)


def programs(shape: Shape, max_ops: int = 16, config: Config | None = None) -> st.SearchStrategy[Program]:
    """Valid training-loop programs for a model of this shape (``config`` fixes the sharding)."""
    cfg = st.just(config) if config is not None else configs(shape)
    return st.builds(lambda c, i: normalise(i, shape, c), cfg, intents(max_ops))
