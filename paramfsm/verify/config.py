"""How a verify program shards the model: :class:`Config`, the arguments of ``paramfsm.shard`` and the loop's
settings a program draws (:func:`paramfsm.verify.programs.configs`). :mod:`paramfsm.verify.ops` re-exports it
beside the op records."""

from __future__ import annotations

import attrs


#: The unit choices a program draws (:func:`paramfsm.verify.loop_helpers.unit_arguments` turns one into the
#: ``units=`` and ``min_unit_bytes=`` of ``shard()``):
#:
#: ``"default"``: the subject's own ``units`` and ``min_unit_bytes`` (by default ``shard()``'s: small modules
#: merged into their parent's unit); ``"per_module"``: ``min_unit_bytes=0``, a unit per module owning
#: parameters; ``"merged"``: ``min_unit_bytes`` of 64 KiB, whatever ``$PARAMFSM_MIN_UNIT_BYTES`` says (a small
#: model is then one unit); ``"one"``: ``units=lambda name, module: False``, a root owning every module, each
#: of which may still be called on its own; ``"by_size"``: ``units=paramfsm.by_size(min_bytes=2048)``. A
#: subject with its own ``units`` draws ``"default"`` and ``"one"`` only (the others would replace a choice
#: its model depends on, such as a unit enclosing a branch that differs between ranks).
UNIT_CHOICES = ("default", "per_module", "merged", "one", "by_size")
#: ``by_size``'s bound: a few of a verify subject's modules reach it, most merge.
BY_SIZE_BYTES = 2048


@attrs.frozen(slots=True)
class Config:
    """How the program shards the model (the arguments of ``paramfsm.shard``).

    ``param_dtype``: None, ``"bfloat16"`` or ``"float16"``: gather and compute
    in that dtype, reduce-scatter in float32 (``reduce_dtype=torch.float32``).
    Under ``"float16"`` every backward is of ``scaler.scale(loss)`` and every
    step is ``scaler.step(opt); scaler.update()`` with a
    ``paramfsm.amp.GradScaler`` (see :data:`paramfsm.verify.mirror.SCALER`).
    """

    retain: str = "defer"
    prefetch: int = 1
    bucket_bytes: int = 8 << 20  # shard()'s default (paramfsm.engine.effects.executor.DEFAULT_BUCKET_BYTES)
    max_deferred_bytes: int | None = None
    param_dtype: str | None = None
    #: ``reshard_after_forward``: True (every unit resharded after its forward), False (every unit kept for
    #: its backward), or the names of the units kept (``""``: the root), as the predicate
    #: ``lambda name, module: name not in KEPT`` (see :func:`paramfsm.verify.loop_helpers.reshard_policy`).
    reshard_after_forward: bool | tuple[str, ...] = True
    #: ``offload``: None, ``"cpu"`` or ``"disk"``: the shards (on two or more ranks), their gradients and the
    #: optimizer state in that tier, nothing else resident (``paramfsm.Offload(max_resident_bytes=None)``);
    #: ``"cpu-bounded"``: in the CPU tier with a resident set of one model's shard bytes, so some values stay
    #: resident between uses and others are paged out (see :func:`paramfsm.verify.loop_helpers.offload_policy`).
    offload: str | None = None
    #: ``units``: how the model is cut into units (see :data:`UNIT_CHOICES`); ``"default"`` is what the user's
    #: own ``shard()`` call does with the subject's ``units`` and ``min_unit_bytes``.
    units: str = "default"
    #: ``optimizer``: ``"subject"`` (the subject's own), ``"adafactor"`` (``torch.optim.Adafactor``, whose update
    #: reads each parameter's shape: paramfsm steps it on whole parameters), or ``"subclass"`` (the subject's,
    #: through a subclass whose ``step`` calls ``super().step()``, with both classes' steps wrapped by torch's
    #: hooks; canonical only); see :func:`paramfsm.verify.user_loops.make_optimizer`.
    optimizer: str = "subject"
    #: ``step_hooks``: each optimizer carries a step pre-hook that decays its learning rate (a schedule kept in
    #: a hook), which must run once per ``step()`` (:func:`paramfsm.verify.user_loops.decay_lr`).
    step_hooks: bool = False
    #: ``zero_grad_to_none``: the ``set_to_none`` of every ``ZeroGrad``'s ``opt.zero_grad(...)``.
    zero_grad_to_none: bool = True
    #: ``clip_plain``: a ``Clip`` is ``torch.nn.utils.clip_grad_norm_(rt.shard_parameters(), ...)``, torch's own
    #: call over the shards, instead of ``rt.clip_grad_norm_``.
    clip_plain: bool = False
    #: ``refused_shard``: the program's ``shard()`` follows one that refused an offload setting (a bound below
    #: one unit), on the same model (:func:`paramfsm.verify.loop_helpers.refused_shard`).
    refused_shard: bool = False
    #: ``compiled``: after ``shard()``, each block's forward is ``torch.compile(..., backend="aot_eager")``d, the
    #: README's recipe (:func:`paramfsm.verify.compiled_blocks.compile_blocks`); an eval segment between a backward
    #: and its step then recompiles them while the parameters hold gradients.
    compiled: bool = False

    @property
    def scaled(self) -> bool:
        """Whether the program scales its losses (fp16 compute)."""
        return self.param_dtype == "float16"
