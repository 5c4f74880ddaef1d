"""Optimizers built over a sharded model's own parameters step its shards.

``torch.optim.AdamW(model.parameters())`` is how most training code builds an
optimizer, Hugging Face's Trainer included (param groups from
``model.named_parameters()``, weight decay chosen by name). After
``paramfsm.shard`` those parameters are empty between iterations and their
gradients live on the shards, so stepping them would silently change nothing.

One global optimizer step pre-hook (registered by the first ``paramfsm.shard``)
maps them instead: the first time an optimizer steps, every partitioned
parameter in its param groups is replaced by that parameter's shard, in place,
keeping each group's options (lr, weight decay, betas, ...). After that the
optimizer *is* an optimizer over shards: ``zero_grad``, LR schedulers and
``state_dict()`` / ``load_state_dict()`` work as usual. Until it first steps,
``zero_grad()`` already reaches the shard gradients through the parameters'
``.grad`` (see :mod:`paramfsm.engine.storage.partitioned`).

State the optimizer holds for a parameter it is about to map:

* shard-shaped (``load_state_dict`` of a checkpoint saved from a mapped
  optimizer, before the first step) moves to the shard;
* anything else (the optimizer stepped the full parameters before ``shard``)
  cannot be mapped without guessing, so the step raises
  :class:`OptimizerStateMismatch` naming the parameter.

[Note: mapping cost]
The hook runs on every ``step()`` of every optimizer in the process. An
optimizer that has been scanned is remembered with its number of param groups
and the sharding generation (bumped by every ``paramfsm.shard``), so a later
step costs one weak-dictionary lookup; a group added with ``add_param_group``,
or a model sharded after the optimizer first stepped, is mapped at the next step.

The folder holds the rest of what a step over shards needs: :mod:`.offload_step` (an offloaded step,
unit by unit), :mod:`.step_space` (the disk space its first step needs), :mod:`.whole_params`
(optimizers whose update reads a whole parameter) and :mod:`.grad_norm` (``rt.clip_grad_norm_``) and :mod:`.scaler_guard` (a plain ``GradScaler`` refused).
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from paramfsm.optim import offload_step, scaler_guard
from paramfsm.sharding.accumulation import refuse_step
from paramfsm.engine.effects.grad_sync import UNSYNCED
from paramfsm.engine.storage.partitioned import OWNERS, owner, record_of
from paramfsm.errors import ParamFSMError

# optimizer -> (sharding generation, param groups scanned, whether it steps shards, the shards' writers as
# (a weak reference to the scheduler, its records)): weak, since a runtime holds its model, its process group and,
# through the parameters' hooks, often the optimizer that keys this table (see [Note: the demand table holds
# nothing alive] in paramfsm.engine.storage.placeholder)
_MAPPED: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple]" = weakref.WeakKeyDictionary()
#: every shard of every sharded model -> (a weak reference to its scheduler, the index of its record
#: there): to tell a shard optimizer, and
#: whom its step must tell (see [Note: a step is a shard write]).
_SHARDS = WeakIdKeyDictionary()
_hook_handle = None
_generation = 0


class OptimizerStateMismatch(ParamFSMError):
    """An optimizer holds state for a full parameter that paramfsm would have to map to its shard."""


class OptimizerNotElementwise(ParamFSMError):
    """An optimizer whose update paramfsm cannot show to be element-wise was about to step flat shards."""


#: [Note: element-wise optimizers]
#: paramfsm steps an optimizer on each rank's flat 1-D shard of each parameter only when that is the
#: optimizer's own update: when each element's update depends on that element's gradient and state alone (plus
#: scalars the ranks share: the step count, the learning rate). These ``torch.optim`` optimizers are so: their
#: ``step`` is recognised, a subclass's included when it keeps the ``step`` (one changing defaults). Any other
#: rule may read the parameter's shape or a whole-tensor quantity (Adafactor's factored second moment, Muon's
#: orthogonalisation of the 2-D update, LAMB's and LARS's trust ratios, Shampoo's preconditioners): on flat
#: shards it would compute something else with no error, or raise torch's own error about the shape. So it is
#: stepped on whole parameters (:mod:`paramfsm.optim.whole_params`), which costs two all-gathers per parameter per
#: step and keeps its state replicated; an optimizer the user declares element-wise (:func:`elementwise`)
#: steps shards instead. Where whole parameters cannot be stepped (a closure, an offloaded model), its first
#: step is refused, naming the parameter and the declaration.
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
               torch.optim.RAdam, torch.optim.Adagrad, torch.optim.Adadelta, torch.optim.RMSprop,
               torch.optim.ASGD, torch.optim.Rprop, torch.optim.SparseAdam)
def _unwrapped(step):
    """The function under torch's wrappers (``Optimizer.__init__`` wraps its class's ``step`` for profiling)."""
    while hasattr(step, "__wrapped__"):
        step = step.__wrapped__
    return step


_STEPS = frozenset(_unwrapped(cls.step) for cls in ELEMENTWISE)
#: Optimizer classes the user declared element-wise (:func:`elementwise`).
_DECLARED: "weakref.WeakSet[type]" = weakref.WeakSet()


def elementwise(optimizer_class: type) -> type:
    """Declare ``optimizer_class`` element-wise: each element's update depends on that element's gradient and
    state alone, so paramfsm may step it on flat shards (see [Note: element-wise optimizers]). Returns the
    class, so it also works as a class decorator. Declaring an optimizer that is not element-wise trains
    something else, silently."""
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError(f"paramfsm.optim.elementwise expects a torch.optim.Optimizer subclass, not "
                        f"{optimizer_class!r}")
    _DECLARED.add(optimizer_class)
    return optimizer_class


def is_elementwise(optimizer) -> bool:
    """Whether ``optimizer`` steps flat shards (see [Note: element-wise optimizers])."""
    cls = type(optimizer)
    return _unwrapped(cls.step) in _STEPS or any(issubclass(cls, declared) for declared in _DECLARED)


def _refuse_whole(optimizer, why: str) -> None:
    """Raise :class:`OptimizerNotElementwise`: a whole-parameter optimizer cannot step here (``why``)."""
    cls = type(optimizer)
    name, unit, rank, state = _first_shard(optimizer)
    module = name.rpartition(".")[0] or "<root>"
    raise OptimizerNotElementwise(
        f"{cls.__name__}.step() refused on rank {rank}: parameter '{name}' (module '{module}', unit '{unit}', "
        f"{state}, event 'optimizer step'): {cls.__name__} is not known to be element-wise, so paramfsm steps "
        f"it on whole parameters, which it cannot do {why}. paramfsm recognises "
        f"{', '.join(c.__name__ for c in ELEMENTWISE)} as element-wise. What to do: {_WHOLE_FIX[why]}, or, if "
        f"{cls.__name__}'s update is element-wise, declare it before its first step: "
        f"paramfsm.optim.elementwise({cls.__name__}).")


_CLOSURE = "with a closure (it is evaluated between updates, on shards)"
_OFFLOADED = "under offload (the whole values would bypass the tiers)"
_WHOLE_FIX = {_CLOSURE: "call step() without a closure", _OFFLOADED: "shard the model without offload"}


def _first_shard(optimizer) -> tuple:
    """``(name, unit, rank, state)`` of the first partitioned parameter or shard ``optimizer`` steps."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            rec, entry = record_of(p), _SHARDS.get(p)
            scheduler = entry[0]() if entry is not None and entry[0] is not None else None
            if rec is None and scheduler is not None:
                rec = scheduler.records[entry[1]]
            if rec is not None:
                rank = scheduler.ctx.rank if scheduler is not None else owner(p)[2]
                return rec.name, rec.unit, rank, f"state {rec.state.name}"
    return "?", "?", "?", "state unknown"


def install(records=(), scheduler=None, rt=None) -> None:
    """Register the global step pre-hook once per process; called by every ``paramfsm.shard`` with its
    records, the scheduler that drives them and its runtime."""
    global _hook_handle, _generation
    _generation += 1
    ref = weakref.ref(scheduler) if scheduler is not None else None
    rt_ref = weakref.ref(rt) if rt is not None else None
    for index, rec in enumerate(records):  # weak: a record holds its shard, the dictionary's key
        _SHARDS[rec.shard] = (ref, index, rt_ref)
    if _hook_handle is None:
        _hook_handle = register_optimizer_step_pre_hook(_before_step)


@contextlib.contextmanager
def shards_in_groups(optimizer):
    """For the block, a whole-parameter optimizer's groups hold its parameters' shards: for code that reads
    every gradient of the groups element-wise (a scaler's ``unscale_``), where the parameters' own ``.grad``
    refuses to be read as a whole gradient. An element-wise optimizer's groups already hold shards."""
    groups = optimizer.param_groups
    if is_elementwise(optimizer):
        yield
        return
    saved = [group["params"] for group in groups]
    for group in groups:
        group["params"] = [rec.shard if rec is not None else p
                           for p, rec in zip(group["params"], map(record_of, group["params"]))]
    try:
        yield
    finally:
        for group, params in zip(groups, saved):
            group["params"] = params


def runtime_of(shard):
    """The runtime whose shard ``shard`` is (None: not a live runtime's shard)."""
    entry = _SHARDS.get(shard)
    return entry[2]() if entry is not None and entry[2] is not None else None


def shards():
    """Every live sharded model's shards."""
    return list(_SHARDS.keys())


def _before_step(optimizer, args, kwargs):
    if offload_step.inner():  # one unit's step inside an offloaded step (paramfsm.optim.offload_step)
        return None
    if offload_step.within_step(optimizer):  # a parent's step through super(), inside the user's
        return None
    offload_step.restore_if_left(optimizer)
    writers = _map(optimizer)
    closure = args[1] if len(args) > 1 else kwargs.get("closure")  # args[0] is the optimizer
    if writers is not None:
        scaler_guard.refuse_local_scaler(optimizer)
    if writers is not None and not is_elementwise(optimizer):
        if closure is not None:
            _refuse_whole(optimizer, _CLOSURE)
        if offload_step.offloading(writers):
            _refuse_whole(optimizer, _OFFLOADED)
        _check_and_announce(optimizer, writers)
        runtimes = [runtime_of(records[0].shard) for _, records in writers]
        offload_step.step_by_unit(optimizer, writers, args, kwargs, runtimes)
        return None
    if closure is None or writers is None or offload_step.offloading(writers):
        _check_and_announce(optimizer, writers)
        if writers is not None:
            _step_offloaded(optimizer, writers, args, kwargs)
        return None
    checked = _after_closure(optimizer, writers, closure)
    if len(args) > 1:
        return (args[0], checked, *args[2:]), kwargs
    return args, {**kwargs, "closure": checked}


def _check_and_announce(optimizer, writers) -> None:
    if UNSYNCED:  # gradients kept under rt.no_sync are never stepped (paramfsm.sharding.accumulation)
        refuse_step(optimizer)
    if writers is not None:
        _announce_writes(optimizer, writers)


def _after_closure(optimizer, writers, closure):
    """``closure``, followed by the step's checks and its write announcement.

    [Note: a closure's gradients come after the pre-hook]
    ``opt.step(closure)`` (Lightning's every step, LBFGS) runs the forward and
    backward inside the step, after this pre-hook. Checked here, the gradients
    would be the previous iteration's: the last micro-batch's backward, which
    syncs what ``no_sync`` kept, has not run yet (so the step would be refused
    wrongly), and the shards that get a gradient (the ones the step writes) are
    not known. So the checks and the announcement run each time the closure
    returns, right before the update that follows it (LBFGS calls it again
    between updates).
    """
    def checked():
        loss = closure()
        _check_and_announce(optimizer, writers)
        return loss
    return checked


def _map(optimizer):
    """Map ``optimizer``'s param groups to shards (cached per generation); the ``(scheduler, records)``
    pairs its step writes, or None when it steps no shard."""
    seen = _MAPPED.get(optimizer)
    if seen is not None and seen[:2] == (_generation, len(optimizer.param_groups)):
        return _alive(seen[3]) if seen[2] else None
    if not OWNERS:
        return None
    fresh = seen is None or seen[0] != _generation
    start = 0 if fresh else seen[1]
    sharded = False if fresh else seen[2]
    shards_of = is_elementwise(optimizer)
    for group in optimizer.param_groups[start:]:
        params = group["params"]
        if shards_of and any(record_of(p) is not None for p in params):
            group["params"] = [_shard_for(optimizer, p) for p in params]
            sharded = True
        elif not shards_of and any(p in _SHARDS for p in params):
            group["params"] = [_param_for(optimizer, p) for p in params]
        sharded = sharded or any(p in _SHARDS or record_of(p) is not None for p in group["params"])
    writers = _writers(optimizer) if sharded else ()
    _MAPPED[optimizer] = (_generation, len(optimizer.param_groups), sharded,
                          tuple((weakref.ref(scheduler), records) for scheduler, records in writers))
    return writers if sharded else None


def _alive(writers) -> tuple:
    """The cached ``writers`` whose runtime still exists, with their schedulers."""
    out = []
    for ref, records in writers:
        scheduler = ref()
        if scheduler is not None:
            out.append((scheduler, records))
    return tuple(out)


def _step_offloaded(optimizer, writers, args, kwargs) -> None:
    """Step the shards of offloading runtimes unit by unit now (see paramfsm.optim.offload_step)."""
    offloading = offload_step.offloading(writers)
    if offloading:
        offload_step.step_by_unit(optimizer, offloading, args, kwargs)


def _writers(optimizer) -> tuple:
    """``(scheduler, records)`` for each sharded model whose shards ``optimizer`` steps, in group order."""
    by_scheduler: dict = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            rec = record_of(p)  # a whole-parameter optimizer's parameter: its shard's entry
            entry = _SHARDS.get(rec.shard if rec is not None else p)
            scheduler = entry[0]() if entry is not None and entry[0] is not None else None
            if scheduler is not None:
                by_scheduler.setdefault(scheduler, {})[scheduler.records[entry[1]]] = None
    return tuple((scheduler, tuple(records)) for scheduler, records in by_scheduler.items())


def _announce_writes(optimizer, writers) -> None:
    """Tell each scheduler which shards this step writes, before it writes them.

    [Note: a step is a shard write]
    A full copy gathered before the step (a parameter kept DEFERRED_RELEASE for
    a retained graph, a GAN's discriminator stepped between two forwards) would
    otherwise be read again with the old values. The scheduler drops such
    copies, or refuses the step while one is held (see
    :mod:`paramfsm.engine.schedule.shard_writes`). A step changes only the shards that
    have a gradient (every ``torch.optim`` optimizer skips the others), so
    only those parameters get their autograd version bumped.
    """
    why = f"{type(optimizer).__name__}.step()"
    for scheduler, records in writers:
        if scheduler.peaks is not None:  # rt.reset_peak_memory(): this optimizer's state counts from now on
            scheduler.peaks.stepping(optimizer)
        paging = getattr(scheduler, "offload_plan", None) is None  # else stepped unit by unit, paging itself
        scheduler.shards_written(records, tuple([rec for rec in records if rec.shard.grad is not None]), why,
                                 paging=paging)


def map_optimizer(optimizer) -> None:
    """Map ``optimizer`` now rather than at its first step (what the hook does first; idempotent).

    Only the mapping: nothing is stepped, and no write is announced."""
    _map(optimizer)


def _shard_for(optimizer, param):
    rec = record_of(param)
    if rec is None:
        return param
    shard = rec.shard
    state = optimizer.state.pop(param, None)
    if state:
        mismatched = [key for key, value in state.items()
                      if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != shard.shape]
        if mismatched:
            optimizer.state[param] = state
            raise OptimizerStateMismatch(
                f"{type(optimizer).__name__} holds state {mismatched} for the full parameter '{rec.name}' "
                f"(shape {tuple(next(state[k] for k in mismatched).shape)}), but paramfsm steps its shard "
                f"(shape {tuple(shard.shape)}). It stepped before paramfsm.shard partitioned the model. "
                "What to do: create the optimizer after paramfsm.shard (or before its first step), or load "
                "its state from a checkpoint of the sharded run (paramfsm.checkpoint).")
        optimizer.state[shard] = state
    return shard


def _param_for(optimizer, shard):
    """The parameter of ``shard``, for a whole-parameter optimizer given shards (see [Note: whole-parameter
    optimizers] in :mod:`paramfsm.optim.whole_params`)."""
    entry = _SHARDS.get(shard)
    scheduler = entry[0]() if entry is not None and entry[0] is not None else None
    if scheduler is None:
        return shard
    rec = scheduler.records[entry[1]]
    state = optimizer.state.pop(shard, None)
    if state:
        optimizer.state[shard] = state
        raise OptimizerStateMismatch(
            f"{type(optimizer).__name__} holds state for the shard of '{rec.name}' (unit '{rec.unit}', rank "
            f"{scheduler.ctx.rank}), but it steps whole parameters (it is not known to be element-wise), so its "
            "state is the full parameter's. What to do: load its state from a checkpoint of a run that stepped "
            "whole parameters, or declare the optimizer element-wise if it is "
            f"(paramfsm.optim.elementwise({type(optimizer).__name__})).")
    return rec.param
