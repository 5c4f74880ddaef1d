"""The vocabulary of verify's programs: a sharding :class:`Config` and the op records a :class:`Program` runs.

Ops are frozen, slotted records, so a program pickles in a few hundred bytes
and prints (``repr``) as the constructor call a reproduction script uses.
:mod:`paramfsm.verify.programs` draws valid sequences of them;
:mod:`paramfsm.verify.mirror` gives each its plain-torch meaning,
:mod:`paramfsm.verify.runner` and :mod:`paramfsm.verify.reproduction` run it
on paramfsm.
"""

from __future__ import annotations

import attrs

from paramfsm.verify.config import BY_SIZE_BYTES, UNIT_CHOICES, Config  # noqa: F401 - re-exported with the ops

MODES = ("train", "no_grad", "eval", "checkpoint", "eval_no_grad", "reentrant")
AUTO_MODES = ("train", "checkpoint", "eval")  # forwards the normaliser adds before a loss
GRAD_MODES = frozenset({"train", "eval", "checkpoint", "reentrant", "write"})
#: A train forward during which the module owning the model's first parameter halves it in place inside its own
#: forward (:func:`paramfsm.verify.user_loops.write_in_forward`; a layer clamping its weight, a momentum encoder
#: updated in forward). Plain torch keeps the write; paramfsm refuses it: every rank raises ``WriteToGathered``
#: naming the parameter and ``rt.gathered(writeback=True)``, the accepted outcome, which stops the program.
#: Drawn by the ``write_in_forward`` intent, not among :data:`MODES`.
WRITE_MODE = "write"
#: The :class:`GatheredWrite` variant that writes a different value on each rank (refused on every rank).
RANK_WRITE = 2
LOSS_VARIANTS = 3  # 0: the subject's loss_fn, 1: mean square of the output, 2: mean tanh of the output
#: Loss variants of a submodule's output (:class:`SubForward`), whatever container holds its tensors: 3, the
#: sum of the mean squares of its floating-point tensors; 4, the sum of their mean tanh.
TREE_VARIANTS = (3, 4)
PENALTY_WEIGHT = 0.1
BATCHES = 4
#: ``max_norm`` values a Clip op draws from: below the usual total norm, around it, and far above it
#: (where torch's clamp at 1 must leave the gradients alone).
CLIP_NORMS = (0.05, 1.0, 100.0)
CLIP_NORM_TYPES = (2.0, float("inf"), 1.0)

@attrs.frozen(slots=True)
class Forward:
    """``out = model(x)`` in a mode: train, no_grad, eval, checkpoint (whole model), eval_no_grad or
    reentrant (each block of the subject under ``checkpoint(..., use_reentrant=True)``).

    ``out`` is -1 in the no_grad modes, whose output nothing keeps.
    """

    out: int
    batch: int
    mode: str


@attrs.frozen(slots=True)
class Interrupted:
    """A train forward of batch ``batch`` whose backward raises inside a user's ``autograd.Function`` applied to
    the output of ``module`` (so the gradients of what follows it were already accumulated), caught; then
    ``rt.reset()`` when ``reset`` (else the next forward recovers by itself) and
    ``opt.zero_grad(set_to_none=True)``. In plain torch every gradient is None after it."""

    batch: int
    module: str
    reset: bool


@attrs.frozen(slots=True)
class Loss:
    """A scalar loss from an output (several losses may share one output and its graph); its value is
    compared with plain torch's. ``variant``: see :data:`LOSS_VARIANTS` and :data:`TREE_VARIANTS`."""

    loss: int
    out: int
    batch: int
    variant: int


@attrs.frozen(slots=True)
class Backward:
    """``loss.backward(retain_graph=...)`` or ``rt.backward(loss, retain_graph=...)`` (of ``scaler.scale(loss)``
    when the program scales its losses)."""

    loss: int
    retain: bool
    via_runtime: bool


@attrs.frozen(slots=True)
class Penalty:
    """A gradient penalty: ``autograd.grad(create_graph=True)``, then ``(loss + w * penalty).backward()``."""

    loss: int
    retain: bool


@attrs.frozen(slots=True)
class Drop:
    """``del`` an output and its losses: the graph is freed without a final backward."""

    out: int
    losses: tuple[int, ...]


@attrs.frozen(slots=True)
class ZeroGrad:
    """``opt.zero_grad()``."""


@attrs.frozen(slots=True)
class Step:
    """``opt.step()``, or ``scaler.step(opt); scaler.update()`` when the program scales its losses."""


@attrs.frozen(slots=True)
class Flush:
    """``rt.flush()``."""


@attrs.frozen(slots=True)
class Gathered:
    """``with rt.gathered(module):`` (every unit when ``module`` is None), optionally with a no_grad forward inside."""

    module: str | None
    batch: int | None


@attrs.frozen(slots=True)
class Unscale:
    """``scaler.unscale_(opt)``: the shard gradients divided by the scale, ``found_inf`` agreed across ranks."""


@attrs.frozen(slots=True)
class Overflow:
    """A forced fp16 overflow: an inf in element ``index`` of parameter ``param``'s gradient.

    Only the rank whose shard holds that element sees it (the reference sees
    it in its full gradient), so the scaler must agree across ranks to skip
    the step.
    """

    param: str
    index: int


@attrs.frozen(slots=True)
class Clip:
    """``total = rt.clip_grad_norm_(max_norm, norm_type)`` (after ``scaler.unscale_`` when scaling)."""

    max_norm: float
    norm_type: float


@attrs.frozen(slots=True)
class FullState:
    """``sd = rt.full_state_dict()``, then ``rt.load_full_state_dict(sd)`` (of a perturbed copy if ``perturb``)."""

    perturb: bool


@attrs.frozen(slots=True)
class Checkpoint:
    """A sharded DCP checkpoint: ``paramfsm.checkpoint.save(rt, path)``, each value of
    ``rt.sharded_state_dict()`` checked against the reference's slice, the parameters perturbed, then
    ``paramfsm.checkpoint.load(rt, path)``: back where it was."""


@attrs.frozen(slots=True)
class RequiresGrad:
    """``model.get_parameter(param).requires_grad_(flag)`` between iterations (no graph alive)."""

    param: str
    flag: bool


@attrs.frozen(slots=True)
class NoSync:
    """Enter (``enter=True``) or leave a ``with rt.no_sync():`` window that spans the ops between the two.

    Backward passes inside keep their gradients on each rank; plain torch
    simply accumulates them (the reference does nothing for this op).
    """

    enter: bool


@attrs.frozen(slots=True)
class GradSync:
    """``rt.set_requires_gradient_sync(flag)`` (FSDP2's switch), anywhere in a program, even between a forward
    and its backward: the switch in force when a backward runs decides."""

    flag: bool


@attrs.frozen(slots=True)
class SyncGradients:
    """``rt.sync_gradients()``: the gradients kept under ``no_sync`` reduce-scattered now (a no-op with none)."""


@attrs.frozen(slots=True)
class SubForward:
    """``out = model.get_submodule(module)(*args, **kwargs)``: one unit run again on the inputs it got in the
    train forward ``source`` (saved activations, kept alive with that forward's output).

    ``detach``: the saved inputs detached first (a GAN's ``D(fake.detach())``), so the new graph holds only
    the unit; otherwise it reaches back into ``source``'s graph. ``view``: before any loss, an in-place op on a
    view of the unit's first floating-point output (``h = out[...]; h += 0.5``, as in
    ``h = unit(x).squeeze(0); h += y``). The output may be any container (a dataclass, a namedtuple, nested
    dicts and lists); it is compared with plain torch's.
    """

    out: int
    module: str
    source: int
    detach: bool
    view: bool


@attrs.frozen(slots=True)
class PartStep:
    """``opts[part].step()``: the optimizer of one part of the model only (``Subject(parts=...)``, a GAN's G or D)."""

    part: int


@attrs.frozen(slots=True)
class PartZeroGrad:
    """``opts[part].zero_grad()``: the gradients of one part of the model only."""

    part: int


@attrs.frozen(slots=True)
class GatheredWrite:
    """``with torch.no_grad(), rt.gathered(module): model.get_parameter(param).mul_(0.5)`` (``variant`` 1:
    ``.add_(0.01)``); every unit when ``module`` is None. The write must reach the shards, as the same write
    on a plain model changes its parameter.

    ``variant`` :data:`RANK_WRITE`: the parameter's first element plus ``0.01 * (rank + 1)``, a different
    value on each rank. paramfsm must refuse it on every rank, naming the parameter, with nothing written
    back (the accepted outcome, which stops the program); plain torch has no ranks to compare.
    """

    module: str | None
    param: str
    variant: int


@attrs.frozen(slots=True)
class Attach:
    """Between iterations, a module whose parameters sit in its child (``nn.Sequential(nn.Linear(2, 2))``) is
    attached to ``module`` ("" the root) after ``shard()``, then ``model(x)`` of ``batch`` under
    ``torch.no_grad()``. paramfsm must raise ``ModelChanged`` on every rank, naming the new parameter and the
    fix (the accepted outcome, which stops the program): trained on, each rank's copy would drift apart."""

    module: str
    batch: int


@attrs.frozen(slots=True)
class Evaluate:
    """An eval segment: ``model.eval()``, a forward of each batch under ``torch.no_grad()`` (or
    ``torch.inference_mode()`` when ``inference``), ``model.train()``; the outputs are compared with plain torch's."""

    batches: tuple[int, ...]
    inference: bool


@attrs.frozen(slots=True)
class Save:
    """Keep the model's state for a later :class:`Restore`: ``sd = rt.full_state_dict()`` (``full``), or a DCP
    checkpoint with the optimizer state, ``paramfsm.checkpoint.save(rt, path, optimizer=opt)``.

    ``optimizer`` (with ``full``): torch's own optimizer state dict too, ``copy.deepcopy(opt.state_dict())``
    of each optimizer over the shards, as a loop that rolls back a bad step keeps it."""

    full: bool
    optimizer: bool = False

    @property
    def kind(self) -> tuple[bool, bool]:
        """Which :class:`Restore` goes back to it: ``(full, optimizer)``."""
        return self.full, self.optimizer


@attrs.frozen(slots=True)
class Restore:
    """Go back to the last :class:`Save` of the same kind: ``rt.load_full_state_dict(sd)`` (``full``), or
    ``paramfsm.checkpoint.load(rt, path, optimizer=opt)`` (parameters and optimizer state), anywhere in a loop.

    ``plain``: the DCP checkpoint is loaded the way the README shows for plain DCP instead, in place into
    the runtime's own state dicts: ``sd = rt.sharded_state_dict()`` with the optimizer's
    ``paramfsm.checkpoint.sharded_optim_state_dict(rt, opt)``, ``dcp.load(sd, checkpoint_id=path)``, then
    ``rt.load_sharded_state_dict`` and ``paramfsm.checkpoint.load_sharded_optim_state_dict``. A value of
    those dicts that is a copy rather than a view of the shard would load nothing and raise nothing.

    ``optimizer`` (with ``full``): each optimizer's kept state dict loaded back too, by torch's own
    ``opt.load_state_dict``, which replaces the optimizer's state tensors (under offload, new values the
    tier must never be read into).
    """

    full: bool
    plain: bool = False
    optimizer: bool = False

    @property
    def kind(self) -> tuple[bool, bool]:
        """Which :class:`Save` it goes back to: ``(full, optimizer)``."""
        return self.full, self.optimizer


@attrs.frozen(slots=True)
class RankLoss:
    """A loss that reads a different output on each rank: rank ``r``'s loss is ``tree_loss(variant, out)`` of
    output ``outs[r % len(outs)]`` (every rank produced all of them), as when each rank's loss uses another head.

    Plain torch: each rank slice's loss from its own chosen output. paramfsm must either train exactly like
    that or raise ``paramfsm.RankDesync`` on every rank, naming a unit and the fix, when the ranks' backward
    passes reach different units (see :mod:`paramfsm.verify.rank_loss`). ``variant``: one of
    :data:`TREE_VARIANTS`.
    """

    loss: int
    outs: tuple[int, ...]
    variant: int


@attrs.frozen(slots=True)
class ClosureStep:
    """``opt.step(closure)`` with the one optimizer, unscaled: the closure runs ``inner`` (an optional
    ``zero_grad``, a forward, its loss and the backward) and returns the loss, as Lightning's steps and
    LBFGS do. The step's checks must see the gradients the closure made, not the ones before it."""

    inner: tuple
    loss: int

    @property
    def batches(self) -> tuple[int, ...]:
        """The batches the closure's forwards read."""
        return tuple(op.batch for op in self.inner if isinstance(op, Forward))


#: The ops of user training loops beyond driving the root module (see :mod:`paramfsm.verify.user_loop_intents`).
USER_LOOP_OPS = (SubForward, PartStep, PartZeroGrad, GatheredWrite, Evaluate, Save, Restore, RankLoss)

Op = (Forward | Interrupted | Loss | Backward | Penalty | Drop | ZeroGrad | Step | Flush | Gathered | Unscale | Overflow | Clip
      | FullState | Checkpoint | RequiresGrad | NoSync | GradSync | SyncGradients | SubForward | PartStep
      | PartZeroGrad | GatheredWrite | Attach | Evaluate | Save | Restore | RankLoss | ClosureStep)


@attrs.frozen(slots=True)
class Program:
    """A sharding configuration and the ops to run, in order, on every rank and on the reference."""

    config: Config
    ops: tuple


@attrs.frozen(slots=True)
class Shape:
    """What the generator must know about the subject: its unit modules and what its output allows.

    ``params``: ``(name, numel)`` of each distinct parameter (first name of a
    tied one), for ops that name a parameter. ``blocks``: the modules the
    reentrant mode checkpoints one by one (empty: no reentrant forwards).
    """

    modules: tuple[str, ...] = ()
    checkpoint: bool = True
    tensor_output: bool = True
    allow_create_graph: bool = True
    params: tuple[tuple[str, int], ...] = ()
    blocks: tuple[str, ...] = ()
    meta: bool = False  # Subject(meta=True): the sharded model is a meta build (reproductions build it so)
    offload: bool = False  # Subject(offload=...) is set: reproductions shard with it
    own_units: bool = False  # Subject(units=...) is set: programs draw only the "default" and "one" unit choices
    #: ``Subject(parts=...)``: module names, one optimizer each (empty: one optimizer over every parameter).
    parts: tuple[str, ...] = ()
    #: The part of each entry of ``params`` (all 0 without parts).
    param_parts: tuple[int, ...] = ()
    #: The units a :class:`SubForward` may run again: ``(name, parts of its parameters, parts its saved inputs
    #: depend on, whether plain torch can backward through an in-place op on a view of its output)``.
    callees: tuple[tuple[str, tuple[int, ...], tuple[int, ...], bool], ...] = ()

    @property
    def optimizers(self) -> int:
        """How many optimizers a program steps."""
        return max(1, len(self.parts))
