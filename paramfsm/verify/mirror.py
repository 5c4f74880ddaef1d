"""The plain-torch reference of ``paramfsm verify``: every op of a program on an unsharded copy of the model.

:class:`Mirror` runs each rank's slice of a batch separately and averages the
slice losses, so its gradients are the rank-averaged gradients paramfsm's
reduce-scatter produces. What each op means in plain torch:

* fp32 (no ``param_dtype``): one copy of the model; a backward is of the sum
  of the slice losses divided by the world size.
* ``param_dtype`` (bf16, fp16): an fp32 master copy keeps the parameters,
  gradients and optimizer, and every forward runs each slice on its own
  low-precision copy of the master (inputs cast as ``paramfsm.shard`` casts
  them). A backward runs on each copy, and its gradients are cast to fp32,
  divided by the world size and summed into the master's ``.grad``, which is
  paramfsm's arithmetic (pack in the reduce dtype, pre-divide, reduce-scatter,
  accumulate) up to the order ranks are summed in; see
  :data:`paramfsm.verify.loop_helpers.MIXED_TOLERANCES`.
* fp16: losses are scaled by a ``torch.amp.GradScaler`` before backward;
  ``Unscale`` and ``Step`` are the scaler's ``unscale_`` and ``step``/``update``
  on the master's optimizer; ``Overflow`` writes the inf into the master's
  gradient.
* ``Clip``: ``torch.nn.utils.clip_grad_norm_`` on the master's gradients;
  ``FullState``: ``model.state_dict()`` and ``model.load_state_dict`` of the
  same (or perturbed) values; ``Checkpoint``: nothing (a round trip);
  ``RequiresGrad``: ``requires_grad_`` on the master's parameter.
* ``NoSync``, ``GradSync``, ``SyncGradients``: nothing. Gradients kept under
  ``rt.no_sync()`` and reduce-scattered once are plain accumulation.
* The user-loop ops (:mod:`paramfsm.verify.user_loops` does each for both
  sides): a train forward records every module's inputs; ``SubForward`` runs
  the unit on them (under ``param_dtype``, on a fresh low-precision copy of
  the master, whose gradients are folded in with those of the source's
  copies); ``PartStep`` and ``PartZeroGrad`` use one part's optimizer;
  ``GatheredWrite`` is the same write on the plain parameter; ``Evaluate``
  runs the eval forwards; ``Save`` and ``Restore`` copy and load
  ``state_dict()`` (with the optimizers' for a DCP checkpoint);
  ``RankLoss`` builds each rank slice's loss from the output that rank
  chooses, so a backward differentiates each slice's own output (under
  ``param_dtype``, the gradients of every copy the chosen outputs ran on are
  folded in); ``ClosureStep`` is ``opt.step(closure)`` whose closure runs
  the inner ops here.

[Note: plain torch's own noise]
paramfsm's values differ from the reference's by rounding alone when nothing is
wrong: each rank differentiates its own slice and the ranks' gradients are
summed by the reduce-scatter, where the reference differentiates the mean of
the slice losses in one backward. A few steps amplify those last bits, by how
much depends on the user's model and program (a residual model with a tied
output layer was 4.7e-5 off after a few steps, against a fixed atol of 1e-5).
So the checker runs a second reference, ``Mirror(rank_order=True)``, that
computes the same math in another valid order (fp32: each slice's gradient on
its own, divided by the world size and summed in rank order, which is
paramfsm's arithmetic; low precision: the ranks' gradients summed the other
way round), and allows, per tensor, a multiple of the spread between the two
references on top of the fixed tolerances (:data:`paramfsm.verify.checks.NOISE_FACTOR`).

:attr:`Mirror.expected` is what paramfsm's value of the last op must equal
(a loss, a unit's output, an eval segment's outputs), one entry per rank slice.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from torch import nn
from torch.utils._pytree import tree_map

from paramfsm.verify import user_loops
from paramfsm.verify.ops import (
    PENALTY_WEIGHT, RANK_WRITE, TREE_VARIANTS, WRITE_MODE, Backward, Clip, ClosureStep, Config, Drop, Evaluate, Forward, FullState, Gathered,
    GatheredWrite, Interrupted, Loss, Overflow, PartStep, PartZeroGrad, Penalty, RankLoss, RequiresGrad, Restore, Save, Step,
    SubForward, Unscale, ZeroGrad,
)
from paramfsm.verify.subject import first_tensor
from paramfsm.verify.loop_helpers import (
    SCALER, compute_dtype, default_blocks, overflow_reference, perturbed, reentrant_blocks,
)

NO_GRAD_MODES = ("no_grad", "eval_no_grad")
TRAINING_MODES = ("train", "checkpoint", "no_grad", "reentrant")  # model.train() during the forward
INFERENCE = "inference"  # the mirror's mode of an eval forward under torch.inference_mode()


def loss_of(variant: int, out, targets, loss_fn, upcast: bool = False):
    """The program's loss ``variant``: the subject's loss, or the mean square or mean tanh of the output.

    ``upcast``: the output is in a low-precision compute dtype; the subject's loss sees it in fp32.
    Variants 3 and 4 (:data:`~paramfsm.verify.ops.TREE_VARIANTS`) take every floating-point tensor of any
    container (a unit's output).
    """
    if variant in TREE_VARIANTS:
        return user_loops.tree_loss(variant, out)
    if variant == 0:
        if upcast and isinstance(out, torch.Tensor) and out.is_floating_point():
            out = out.float()
        return loss_fn(out, targets)
    tensor = first_tensor(out).float()
    return tensor.pow(2).mean() if variant == 1 else tensor.tanh().mean()


def penalised(loss, params):
    """``loss`` plus the weighted squared norm of its gradient (taken with ``create_graph=True``)."""
    grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
    return loss + PENALTY_WEIGHT * sum(g.pow(2).sum() for g in grads if g is not None)


def blocks_of(subject) -> tuple[str, ...]:
    """The modules a reentrant forward checkpoints one by one (the subject's, else the default ones)."""
    return tuple(subject.blocks) if subject.blocks is not None else default_blocks(subject.model)


class Mirror:
    """The plain-torch reference (see the module docstring)."""

    def __init__(self, subject, world: int, config: Config = Config(), reference=None, rank_order: bool = False):
        self.rank_order = rank_order  # the noise reference: see [Note: plain torch's own noise]
        self.model = copy.deepcopy(subject.model if reference is None else reference)
        self.opts = user_loops.optimizers(subject, self.model, self.model.parameters(), config)
        self.opt = self.opts[0]
        self.loss_fn = subject.loss_fn
        self.world, self.config = world, config
        self.dtype = compute_dtype(config)
        self.scaler = torch.amp.GradScaler("cpu", **SCALER) if config.scaled else None
        self.blocks = blocks_of(subject)
        self.params = dict(self.model.named_parameters())
        self.outs: dict[int, list] = {}
        self.copies: dict[int, list] = {}  # output -> the low-precision copy each slice ran on
        self.losses: dict[int, list] = {}
        self.owner: dict[int, tuple] = {}  # loss -> the outputs it reads
        self.norm = None  # the total norm of the last Clip
        self.saved: dict = {}  # the state dict before the last FullState load
        self.acts: dict[int, list] = {}  # train forward -> each slice's recorded module inputs
        self.kept: dict[tuple, tuple] = {}  # Save.kind -> (model state, optimizer states)
        self.expected: list = []  # per slice: what paramfsm's value of the last op must equal
        self.recorded: list = []  # each slice's module inputs in the last forward

    def grads(self) -> dict:
        return {name: p.grad for name, p in self.params.items()}

    def trainable(self) -> list:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _low_copy(self):
        """The model with its parameters in the compute dtype, as paramfsm gathers them: buffers keep theirs
        (``param_dtype`` casts no buffer), and batch norms keep full-precision parameters (FSDP's
        mixed-precision default: [Note: batch norms compute in their parameters' precision])."""
        low = copy.deepcopy(self.model)
        kept = {id(p) for m in low.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
                for p in m.parameters(recurse=False)}
        for p in low.parameters():
            if id(p) not in kept:
                p.data = p.data.to(self.dtype)
        for p in low.parameters():
            p.grad = None
        return low

    def _forward(self, mode: str, inputs) -> tuple[list, list]:
        if self.dtype is None:
            models = [self.model] * len(inputs)
        else:
            models = [self._low_copy() for _ in inputs]
            cast = lambda t: t.to(self.dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t
            inputs = [tree_map(cast, x) for x in inputs]
        outs, acts = [], []
        for model, x in zip(models, inputs):
            model.train(mode in TRAINING_MODES)
            try:
                if mode == "train":
                    with user_loops.record_inputs(model) as saved:
                        outs.append(model(x))
                    acts.append(saved)

                elif mode == INFERENCE:
                    with torch.inference_mode():
                        outs.append(model(x))
                elif mode in NO_GRAD_MODES:
                    with torch.no_grad():
                        outs.append(model(x))
                elif mode == "checkpoint":
                    outs.append(torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False))
                elif mode == "reentrant":
                    with reentrant_blocks(model, self.blocks):
                        outs.append(model(x))
                else:
                    outs.append(model(x))
            finally:
                model.train()
        self.recorded = acts
        return models, outs

    def _backward(self, op, total_of) -> None:
        """Backward of each slice's loss (``total_of`` builds the loss to differentiate)."""
        losses = self.losses[op.loss]
        if self.dtype is None and self.rank_order:
            self._rank_ordered(losses, total_of, op.retain)
            return
        if self.dtype is None:
            (sum(total_of(loss) for loss in losses) / self.world).backward(retain_graph=op.retain)
            return
        scale = self.scaler.scale if self.scaler is not None else (lambda t: t)
        for loss in losses:
            scale(total_of(loss)).backward(retain_graph=op.retain)
        copies = {id(c): c for out in self.owner[op.loss] for c in self.copies[out]}  # each copy once
        self._fold(list(copies.values()))

    def _rank_ordered(self, losses, total_of, retain: bool) -> None:
        """The noise reference's fp32 backward: each slice's gradient on its own, divided by the world size,
        summed in rank order and added to what was there (paramfsm's arithmetic, in plain torch)."""
        before = {name: p.grad for name, p in self.params.items()}
        parts = []
        for i, loss in enumerate(losses):
            for p in self.params.values():
                p.grad = None
            total_of(loss).backward(retain_graph=retain or i < len(losses) - 1)
            parts.append({name: p.grad for name, p in self.params.items()})
        for name, p in self.params.items():
            total = None
            for part in parts:
                if part[name] is not None:
                    share = part[name] / self.world
                    total = share if total is None else total + share
            old = before[name]
            p.grad = old if total is None else total if old is None else old + total

    def _fold(self, copies) -> None:
        """The copies' gradients into the master's: fp32, pre-divided by the world size, summed in rank order."""
        named = [dict(c.named_parameters()) for c in copies]
        if self.rank_order:
            named.reverse()  # the noise reference sums the ranks the other way round
        for name, p in self.params.items():
            grads = [n[name].grad for n in named]
            if all(g is None for g in grads):
                continue
            total = sum(g.to(torch.float32) / self.world for g in grads if g is not None).to(p.dtype)
            p.grad = total if p.grad is None else p.grad.add_(total)
            for n in named:
                n[name].grad = None

    def apply(self, op, slices) -> None:
        if isinstance(op, Forward):
            with user_loops.write_in_forward(self.model) if op.mode == WRITE_MODE else contextlib.nullcontext():
                # the global batch's forward: the write happens once, before the first slice
                copies, outs = self._forward("train" if op.mode == WRITE_MODE else op.mode, slices[op.batch][0])
            if op.out >= 0:
                self.outs[op.out], self.copies[op.out] = outs, copies
                if op.mode in ("train", WRITE_MODE):
                    self.acts[op.out] = self.recorded
        elif isinstance(op, Gathered) and op.batch is not None:
            self._forward("no_grad", slices[op.batch][0])
        elif isinstance(op, Loss):
            targets = slices[op.batch][1]
            self.owner[op.loss] = (op.out,)
            self.losses[op.loss] = [loss_of(op.variant, o, t, self.loss_fn, self.dtype is not None)
                                    for o, t in zip(self.outs[op.out], targets)]
            self.expected = self.losses[op.loss]
        elif isinstance(op, RankLoss):
            self.owner[op.loss] = op.outs
            self.losses[op.loss] = self.expected = [
                user_loops.tree_loss(op.variant, self.outs[user_loops.chosen(op.outs, r)][r]) for r in range(self.world)]
        elif isinstance(op, Backward):
            self._backward(op, lambda loss: loss)
        elif isinstance(op, Penalty):
            trainable = self.trainable()
            self._backward(op, lambda loss: penalised(loss, trainable))
        elif isinstance(op, Drop):
            del self.outs[op.out], self.copies[op.out]
            self.acts.pop(op.out, None)
            for k in op.losses:
                del self.losses[k]
        elif isinstance(op, ZeroGrad):
            for opt in self.opts:
                opt.zero_grad(set_to_none=self.config.zero_grad_to_none)
        elif isinstance(op, Interrupted):  # an interrupted backward's gradients are zeroed after it
            for opt in self.opts:
                opt.zero_grad()
        elif isinstance(op, Step):
            for opt in self.opts:
                self.scaler.step(opt) if self.scaler is not None else opt.step()
            if self.scaler is not None:
                self.scaler.update()
        else:
            self._apply_training_op(op, slices)

    def _apply_training_op(self, op, slices) -> None:
        if isinstance(op, Unscale):
            for opt in self.opts:
                self.scaler.unscale_(opt)
        elif isinstance(op, Overflow):
            overflow_reference(self.params[op.param], op.index)
        elif isinstance(op, Clip):
            self.norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), op.max_norm, op.norm_type)
        elif isinstance(op, FullState):
            self.saved = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            self.model.load_state_dict(perturbed(self.saved) if op.perturb else self.saved)
        elif isinstance(op, RequiresGrad):
            self.params[op.param].requires_grad_(op.flag)
        else:
            self._apply_user_loop_op(op, slices)

    def _apply_user_loop_op(self, op, slices) -> None:
        if isinstance(op, SubForward):
            copies = [self.model] * self.world if self.dtype is None else [self._low_copy() for _ in range(self.world)]
            outs = [user_loops.sub_forward(c.get_submodule(op.module), acts[op.module], op.detach, op.view)
                    for c, acts in zip(copies, self.acts[op.source])]
            self.outs[op.out], self.expected = outs, outs
            self.copies[op.out] = copies + ([] if op.detach or self.dtype is None else self.copies[op.source])
        elif isinstance(op, PartStep):
            self.opts[op.part].step()
        elif isinstance(op, PartZeroGrad):
            self.opts[op.part].zero_grad()
        elif isinstance(op, ClosureStep):
            def closure():
                for inner in op.inner:
                    self.apply(inner, slices)
            self.opts[0].step(closure)
        elif isinstance(op, GatheredWrite) and op.variant != RANK_WRITE:  # that one has no plain-torch meaning
            with torch.no_grad():
                user_loops.write(self.model.get_parameter(op.param), op.variant)
        elif isinstance(op, Evaluate):
            mode = INFERENCE if op.inference else "eval_no_grad"
            outs = [self._forward(mode, slices[batch][0])[1] for batch in op.batches]
            self.expected = [list(per_slice) for per_slice in zip(*outs)]
        elif isinstance(op, Save):
            state = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            keep = op.optimizer or not op.full
            self.kept[op.kind] = (state, [copy.deepcopy(o.state_dict()) for o in self.opts] if keep else [])
            self.saved = state
        elif isinstance(op, Restore):
            state, optimizer_states = self.kept[op.kind]
            self.model.load_state_dict(state)
            for opt, saved in zip(self.opts, optimizer_states):
                opt.load_state_dict(saved)
