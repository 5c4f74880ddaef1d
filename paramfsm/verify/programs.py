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
    Checkpoint, Clip, ClosureStep, Config, Drop, Evaluate, Flush, Forward, FullState, Gathered, GatheredWrite,
    GradSync, Interrupted, Loss, NoSync, Op, Overflow, PartStep, PartZeroGrad, Penalty, Program, RankLoss, RequiresGrad, Restore,
    Save, Shape, Step, SubForward, SyncGradients, UNIT_CHOICES, Unscale, ZeroGrad,
)
from paramfsm.verify.user_loop_intents import USER_LOOP_KINDS, UserLoopIntents


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
        elif kind in USER_LOOP_KINDS:
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


#: Training-loop patterns behind the bugs of :mod:`paramfsm.verify.faults`, as intents (kind, a, b, flag)
#: with a configuration. They run before the random programs (see :func:`canonical`).
CANONICAL: tuple[tuple[Config, tuple], ...] = (
    (Config(), (("multi_loss", 0, 0, False),)),  # forward, two losses, zero_grad/backward(retain)/backward
    (Config(), (("multi_loss", 1, 4, True),)),  # the same through rt.backward, checkpointed, three losses
    (Config(), (("multi_loss", 0, 2, False),)),  # both backward passes retain; the graph is dropped
    (Config(), (("multi_loss", 2, 3, False),)),  # eval mode, rt.flush() between the backward passes
    (Config(retain="regather"), (("multi_loss", 0, 0, True), ("iteration", 1, 0, False))),
    (Config(max_deferred_bytes=4096), (("multi_loss", 0, 4, False),)),
    (Config(), (("iteration", 0, 0, False), ("forward", 4, 1, False), ("forward", 1, 2, False),
                ("backward", 0, 3, True), ("step", 0, 0, False), ("gathered", 0, 1, True))),
    (Config(bucket_bytes=1, prefetch=2), (("accumulate", 0, 2, False), ("forward", 2, 0, False),
                                          ("iteration", 1, 1, True), ("penalty", 0, 0, True),
                                          ("penalty", 0, 0, False))),
    # fp16 and the scaler: two scaled backward passes over a retained graph, unscale, a clip whose max_norm is
    # above the total norm, a step; then a forced overflow in the last rank's slice of a gradient and a step
    # every rank must skip.
    (Config(param_dtype="float16"), (("multi_loss", 0, 0, False), ("clip", 2, 0, False), ("step", 0, 0, False),
                                     ("zero_grad", 0, 0, False), ("backward", 0, 6, False),
                                     ("overflow", 0, 7, False), ("step", 0, 0, False))),
    # bf16: a frozen parameter, per-block reentrant checkpointing with a retained second backward, a clip,
    # unfreezing, a DCP round trip and a perturbed full-state-dict round trip, then an iteration.
    (Config(param_dtype="bfloat16"), (("requires_grad", 1, 0, False), ("forward", 5, 0, False),
                                      ("backward", 0, 1, True), ("backward", 0, 1, False), ("clip", 1, 1, False),
                                      ("step", 0, 0, False), ("requires_grad", 1, 0, False),
                                      ("state_dict", 1, 0, True), ("state_dict", 1, 0, False),
                                      ("iteration", 0, 2, False))),
    # Accumulation, every unit kept from its forward to its backward: a no_grad forward (it keeps nothing); the
    # sync switch: a forward with sync off whose backward runs with it back on (it synchronises), an iteration
    # with sync off (kept, then rt.sync_gradients() before the step); two micro-batches under rt.no_sync()
    # and a synchronising backward outside the window, a step; three in eval mode through rt.backward, the
    # first a two-loss retained micro-batch whose graph is dropped, then rt.sync_gradients() and a step.
    (Config(reshard_after_forward=False), (("forward", 1, 3, False), ("grad_sync", 0, 0, False),
                                           ("forward", 0, 2, False), ("loss", 0, 2, False),
                                           ("grad_sync", 0, 0, True), ("backward", 0, 2, False),
                                           ("grad_sync", 0, 0, False), ("iteration", 0, 1, False),
                                           ("grad_sync", 0, 0, True), ("no_sync", 0, 1, False),
                                           ("no_sync", 5, 5, True))),
    # User loops (paramfsm.verify.user_loop_intents). A step between a retained backward and the next forward
    # of a unit that backward left deferred: the unit run again on its saved inputs must compute with the
    # stepped weights (its graph is stale: only its output and loss are compared), then again on detached
    # inputs, through a backward and a step.
    (Config(), (("forward", 0, 0, False), ("backward", 0, 0, True), ("step", 0, 0, False),
                ("sub_forward", 1, 0, False), ("sub_forward", 1, 0, True), ("backward", 1, 0, False),
                ("step", 0, 0, False))),
    # In-place writes inside rt.gathered: one unit's parameter while a retained graph keeps it deferred, then
    # every unit's, then an iteration on the written weights.
    (Config(), (("iteration", 0, 0, False), ("forward", 0, 1, False), ("backward", 0, 1, True),
                ("gathered_write", 1, 0, False), ("gathered_write", 0, 1, True), ("iteration", 0, 2, False))),
    # In-place ops on a view of a unit's output (h = unit(x)[...]; h += 0.5) through the saved inputs, then on
    # detached inputs with a retained backward through rt.backward, and a step.
    (Config(), (("forward", 0, 0, False), ("sub_forward", 2, 4, False), ("backward", 0, 4, False),
                ("sub_forward", 0, 4, True), ("backward", 1, 5, True), ("step", 0, 0, False))),
    # Two GAN iterations in one sharded root, the fake batch not detached (D's backward retains the graph,
    # D steps, D runs again on the fake batch, G's backward goes through it; one optimizer per part).
    (Config(), (("gan", 1, 0, False), ("gan", 0, 1, True))),
    # Eval segments: under inference_mode between a retained backward and the final one, under no_grad after
    # the step, then an iteration.
    (Config(), (("forward", 0, 0, False), ("backward", 0, 0, True), ("evaluate", 1, 1, True),
                ("backward", 0, 0, False), ("step", 0, 0, False), ("evaluate", 0, 2, False),
                ("iteration", 0, 3, False))),
    # A DCP checkpoint with the optimizer state saved after an iteration and restored while a retained graph is
    # alive; a full state dict saved, an iteration, the state dict loaded back, an iteration.
    (Config(), (("iteration", 0, 0, False), ("save_restore", 0, 0, False), ("iteration", 1, 1, False),
                ("forward", 0, 2, False), ("backward", 0, 2, True), ("save_restore", 0, 0, True),
                ("save_restore", 1, 0, False), ("iteration", 0, 3, False), ("save_restore", 1, 0, True),
                ("iteration", 2, 1, True))),
    # Offload to disk: shards, their gradients and optimizer state paged in for each gather, accumulation and
    # unit's step, out after it, beside another run sharing the folder. An iteration, two micro-batches adding
    # into the paged-out gradients, two losses over a retained graph and a step, an in-place write inside
    # rt.gathered, a DCP save with the optimizer state, an iteration, that checkpoint loaded back by plain DCP in
    # place into the runtime's state dicts, a GAN iteration (one optimizer per part), and an iteration.
    (Config(offload="disk"), (("iteration", 0, 0, False), ("accumulate", 0, 1, False),
                              ("multi_loss", 0, 0, False), ("step", 0, 0, False),
                              ("gathered_write", 0, 1, True), ("save_restore", 0, 0, False),
                              ("iteration", 1, 1, False), ("save_restore", 0, 1, True),
                              ("gan", 0, 1, True), ("iteration", 2, 2, False))),
    # A loss that reads another output on each rank (each rank's backward differentiates its own): rank 0's
    # from one batch's output, rank 1's from another's (the same units in the same order: it must train like
    # plain torch), a step; rank 0's from the root output, rank 1's from a unit run again on that forward's
    # saved inputs; then rank 0's from one unit and rank 1's from another, each run on detached inputs. Where
    # the ranks' backward passes reach different units, every rank must raise RankDesync (the program stops).
    (Config(), (("forward", 0, 0, False), ("forward", 0, 1, False), ("rank_loss", 0, 0, False),
                ("step", 0, 0, False), ("forward", 0, 2, False), ("rank_loss", 1, 0, False), ("step", 0, 0, False),
                ("rank_loss", 2, 1, True))),
    # opt.step(closure), as every Lightning step is: two micro-batches under rt.no_sync(), the closure's
    # backward the last micro-batch (it synchronises them); a retained backward, then a closure that zeroes
    # the gradients and runs a checkpointed forward and its backward through rt.backward; an iteration.
    (Config(), (("closure_step", 1, 1, False), ("forward", 0, 0, False), ("backward", 0, 0, True),
                ("closure_step", 2, 0, True), ("iteration", 0, 3, False))),
    # The whole model one unit (the default units merge a small model into its root): a backward broken off
    # inside a user's autograd.Function after some gradients were accumulated, then rt.reset() and an
    # iteration; again, the next forward recovering by itself; then a unit module called on its own (its
    # unit is the root) on a forward's saved inputs, and on detached ones, through backward passes and a step.
    (Config(units="one"), (("iteration", 0, 0, False), ("interrupt", 1, 1, True), ("iteration", 0, 2, False),
                           ("interrupt", 2, 3, False), ("iteration", 1, 1, False), ("forward", 0, 0, False),
                           ("sub_forward", 1, 0, False), ("sub_forward", 0, 0, True), ("backward", 0, 0, False),
                           ("step", 0, 0, False))),
    # Units kept from forward to backward under a deferral bound below a unit's size, two losses over a
    # retained graph: a unit whose parameter another unit's forward reads (a tied output layer through
    # F.linear) is released by the bound inside the retained backward, and the reader's next backward must
    # find it gathered again.
    (Config(reshard_after_forward=False, max_deferred_bytes=4096), (("multi_loss", 0, 0, False),
                                                                     ("step", 0, 0, False),
                                                                     ("multi_loss", 0, 1, True))),
)


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
        offload=st.sampled_from((None, None, None, "cpu", "disk")),
        retain=st.sampled_from(("defer", "regather", "defer")),
        prefetch=st.sampled_from((1, 0, 2)),
        bucket_bytes=st.sampled_from((8 << 20, 1)),
        max_deferred_bytes=st.sampled_from((None, 4096, None)),
        param_dtype=st.sampled_from((None, "float16", "bfloat16")),
        reshard_after_forward=st.sampled_from((True, True, True, False) + kept),
    )


def intents(max_ops: int) -> st.SearchStrategy[list]:
    intent = st.tuples(st.sampled_from(KINDS), st.integers(0, 7), st.integers(0, 7), st.booleans())
    return st.lists(intent, min_size=1, max_size=max_ops)


def programs(shape: Shape, max_ops: int = 16, config: Config | None = None) -> st.SearchStrategy[Program]:
    """Valid training-loop programs for a model of this shape (``config`` fixes the sharding)."""
    cfg = st.just(config) if config is not None else configs(shape)
    return st.builds(lambda c, i: normalise(i, shape, c), cfg, intents(max_ops))
