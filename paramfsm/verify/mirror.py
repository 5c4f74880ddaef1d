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
"""

from __future__ import annotations

import copy

import torch
from torch.utils._pytree import tree_map

from paramfsm.verify.ops import (
    PENALTY_WEIGHT, Backward, Clip, Config, Drop, Forward, FullState, Gathered, Loss, Overflow, Penalty, RequiresGrad,
    Step, Unscale, ZeroGrad,
)
from paramfsm.verify.subject import first_tensor
from paramfsm.verify.loop_helpers import (
    SCALER, compute_dtype, default_blocks, overflow_reference, perturbed, reentrant_blocks,
)

NO_GRAD_MODES = ("no_grad", "eval_no_grad")
TRAINING_MODES = ("train", "checkpoint", "no_grad", "reentrant")  # model.train() during the forward


def loss_of(variant: int, out, targets, loss_fn, upcast: bool = False):
    """The program's loss ``variant``: the subject's loss, or the mean square or mean tanh of the output.

    ``upcast``: the output is in a low-precision compute dtype; the subject's loss sees it in fp32.
    """
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

    def __init__(self, subject, world: int, config: Config = Config(), reference=None):
        self.model = copy.deepcopy(subject.model if reference is None else reference)
        self.opt = subject.optimizer(self.model.parameters())
        self.loss_fn = subject.loss_fn
        self.world, self.config = world, config
        self.dtype = compute_dtype(config)
        self.scaler = torch.amp.GradScaler("cpu", **SCALER) if config.scaled else None
        self.blocks = blocks_of(subject)
        self.params = dict(self.model.named_parameters())
        self.outs: dict[int, list] = {}
        self.copies: dict[int, list] = {}  # output -> the low-precision copy each slice ran on
        self.losses: dict[int, list] = {}
        self.owner: dict[int, int] = {}  # loss -> output
        self.norm = None  # the total norm of the last Clip
        self.saved: dict = {}  # the state dict before the last FullState load

    def grads(self) -> dict:
        return {name: p.grad for name, p in self.params.items()}

    def trainable(self) -> list:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _low_copy(self):
        low = copy.deepcopy(self.model).to(self.dtype)
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
        outs = []
        for model, x in zip(models, inputs):
            model.train(mode in TRAINING_MODES)
            try:
                if mode in NO_GRAD_MODES:
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
        return models, outs

    def _backward(self, op, total_of) -> None:
        """Backward of each slice's loss (``total_of`` builds the loss to differentiate)."""
        losses = self.losses[op.loss]
        if self.dtype is None:
            (sum(total_of(loss) for loss in losses) / self.world).backward(retain_graph=op.retain)
            return
        scale = self.scaler.scale if self.scaler is not None else (lambda t: t)
        for loss in losses:
            scale(total_of(loss)).backward(retain_graph=op.retain)
        self._fold(self.copies[self.owner[op.loss]])

    def _fold(self, copies) -> None:
        """The copies' gradients into the master's: fp32, pre-divided by the world size, summed in rank order."""
        named = [dict(c.named_parameters()) for c in copies]
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
            copies, outs = self._forward(op.mode, slices[op.batch][0])
            if op.out >= 0:
                self.outs[op.out], self.copies[op.out] = outs, copies
        elif isinstance(op, Gathered) and op.batch is not None:
            self._forward("no_grad", slices[op.batch][0])
        elif isinstance(op, Loss):
            targets = slices[op.batch][1]
            self.owner[op.loss] = op.out
            self.losses[op.loss] = [loss_of(op.variant, o, t, self.loss_fn, self.dtype is not None)
                                    for o, t in zip(self.outs[op.out], targets)]
        elif isinstance(op, Backward):
            self._backward(op, lambda loss: loss)
        elif isinstance(op, Penalty):
            trainable = self.trainable()
            self._backward(op, lambda loss: penalised(loss, trainable))
        elif isinstance(op, Drop):
            del self.outs[op.out], self.copies[op.out]
            for k in op.losses:
                del self.losses[k]
        elif isinstance(op, ZeroGrad):
            self.opt.zero_grad()
        elif isinstance(op, Step):
            if self.scaler is not None:
                self.scaler.step(self.opt)
                self.scaler.update()
            else:
                self.opt.step()
        else:
            self._apply_training_op(op)

    def _apply_training_op(self, op) -> None:
        if isinstance(op, Unscale):
            self.scaler.unscale_(self.opt)
        elif isinstance(op, Overflow):
            overflow_reference(self.params[op.param], op.index)
        elif isinstance(op, Clip):
            self.norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), op.max_norm, op.norm_type)
        elif isinstance(op, FullState):
            self.saved = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
            self.model.load_state_dict(perturbed(self.saved) if op.perturb else self.saved)
        elif isinstance(op, RequiresGrad):
            self.params[op.param].requires_grad_(op.flag)
