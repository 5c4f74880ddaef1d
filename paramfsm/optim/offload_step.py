"""The optimizer step over offloaded shards and state: unit by unit, paging each unit in and out.

An optimizer built over ``model.parameters()`` steps every shard in one
``step()`` call, which would need every offloaded shard and state tensor
resident at once. :func:`step_by_unit` runs from the optimizer step pre-hook
(:mod:`paramfsm.optim`) instead: for each unit in order it pages in the unit's
shards, their gradients and optimizer state, runs the optimizer's own ``step()`` over only
those shards, marks them changed and releases them (the resident set is then
trimmed, which writes them back to their tier). Shards that are not offloaded
are stepped last, together. The call the user made then steps nothing.

[Note: the step the user called]
A step pre-hook cannot cancel the step it precedes. So after stepping unit by
unit, every param group's ``params`` is emptied: the user's ``step()`` then
runs the optimizer over no parameters (every ``torch.optim`` optimizer returns
at once). The optimizer's per-parameter state (Adam's ``step`` included) is
stepped exactly once per parameter, so the result is the optimizer's own, bit
for bit. A closure (LBFGS) would be evaluated once per unit, so it is refused.

[Note: hooks see the step the user called]
What watches the optimizer must see one step, as without offload. Each unit's
step calls the optimizer's step function under torch's hook wrapper, so no
hook runs per unit. The optimizer's own step pre-hooks would run after
paramfsm's global pre-hook, that is after every unit stepped; so they are run
here, first, with every parameter in the groups and none updated yet, and are
then held aside until the step ends. Its post-hooks run after the step as
usual, but torch runs an optimizer's own post-hooks before the global ones: so
paramfsm's restoring post-hook is the optimizer's first own post-hook, and
every other post-hook sees the groups whole and every parameter stepped. A
global pre-hook registered after paramfsm's runs after the units stepped.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from collections import OrderedDict

import torch

from paramfsm.optim import step_space, whole_params
from paramfsm.sharding import rank_errors
from paramfsm.errors import OffloadError
from paramfsm.sharding.offload import optimizer_placement

#: optimizer -> (the param groups' params, its own step pre-hooks), held aside until its step's post-hook
#: restores them (see [Note: hooks see the step the user called]).
_EMPTIED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
#: optimizer -> the id of paramfsm's restoring post-hook among the optimizer's own post-hooks.
_RESTORERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


class _Running(threading.local):
    """Whether a unit's step is running (the hooks let it through), per thread: the flag belongs to the call
    that set it, and a step another thread runs meanwhile (another rank's, in tests that run ranks as threads)
    is the user's own."""

    unit = False


_inner = _Running()


def inner() -> bool:
    """Whether the optimizer step now running is one unit's (the pre-hook lets it through)."""
    return _inner.unit


def offloading(writers) -> list:
    """The ``(scheduler, records)`` pairs of ``writers`` whose runtime offloads something."""
    return [(s, r) for s, r in writers if getattr(s, "offload_plan", None) is not None]


def step_by_unit(optimizer, writers, args, kwargs, runtimes=None) -> None:
    """Step ``optimizer`` unit by unit over the offloaded runtimes in ``writers`` (module docstring), or, with
    ``runtimes`` (each writer's runtime), on whole parameters (:mod:`paramfsm.optim.whole_params`)."""
    if runtimes is None:  # before any hook or unit: a step refused for its space changes nothing
        step_space.reserve_new_state(optimizer, offloading(writers))
    args, kwargs = _own_pre_hooks(optimizer, args, kwargs)
    closure = args[1] if len(args) > 1 else kwargs.get("closure")  # args[0] is the optimizer
    if closure is not None:
        raise OffloadError(
            f"{type(optimizer).__name__}.step(closure) over offloaded shards: the step runs unit by unit, so a "
            "closure would be evaluated once per unit. What to do: call step() without a closure, or do not "
            "offload this model (paramfsm.shard(..., offload=None)).")
    groups = optimizer.param_groups
    saved = [group["params"] for group in groups]
    stepped: set[int] = set()
    try:
        with _agreed(writers if runtimes is None else ()):  # [Note: a later step one rank cannot finish]
            for i, (scheduler, records) in enumerate(writers):
                if runtimes is not None:
                    whole_params.step_runtime(optimizer, runtimes[i], records, saved, stepped, _step_only)
                else:
                    _step_runtime(optimizer, scheduler, records, saved, stepped)
            rest = {id(p) for params in saved for p in params if id(p) not in stepped}
            if rest:
                _step_only(optimizer, saved, rest)
            for scheduler, _ in writers if runtimes is None else ():
                scheduler.offload_plan.residency.end_step()
    except BaseException:
        for group, params in zip(groups, saved):
            group["params"] = params
        raise
    for group in groups:
        group["params"] = []
    hooks = optimizer._optimizer_step_pre_hooks
    _EMPTIED[optimizer] = (saved, OrderedDict(hooks))
    hooks.clear()
    _restore_first(optimizer)


def _agreed(writers):
    """The unit-by-unit step's outcome agreed over the process groups of the offloaded runtimes in ``writers``.

    [Note: a later step one rank cannot finish]
    The first offloaded step reserves its disk space before any unit steps, so a full disk changes nothing
    (:mod:`paramfsm.optim.step_space`). A later step can still fail on one rank: a page-in or a write-back that
    its disk refuses (an I/O error), or the optimizer's own step raising on that rank's values. Raised there
    alone, the other ranks would finish their step and wait in the next forward's gather for
    ``collective_timeout``. So the loop over the units, which makes no collective call, ends with one
    agreement (a one-element all-reduce per offloaded step, beside a step that pages every unit through its
    tier), and every rank raises. The failed rank stopped part-way while the others stepped every unit, so
    the ranks' parameters now differ: the message says to load the last checkpoint.
    """
    groups: list = []  # None: the default group
    for scheduler, _ in offloading(writers):
        ex = scheduler.executor
        for group in (ex.group,) + ((ex.replicate_group,) if ex.replicate_group is not None else ()):
            if all(group is not g for g in groups):
                groups.append(group)
    if not groups:
        return contextlib.nullcontext()
    return rank_errors.agreed(groups, "the offloaded optimizer step",
                              "The ranks that finished the step stepped every unit and the failed rank did not, "
                              "so the parameters now differ between ranks. What to do: fix the cause, then "
                              "load the last checkpoint (paramfsm.checkpoint.load) before training on.")


def _own_pre_hooks(optimizer, args, kwargs) -> tuple:
    """Run ``optimizer``'s own step pre-hooks now, as torch's step wrapper would (they may replace the
    arguments); they are held aside once the units stepped."""
    for hook in list(optimizer._optimizer_step_pre_hooks.values()):
        result = hook(optimizer, args, kwargs)
        if result is not None:
            if not (isinstance(result, tuple) and len(result) == 2):
                raise RuntimeError(f"{hook} must return None or a tuple of (new_args, new_kwargs), but got "
                                   f"{result}.")
            args, kwargs = result
    return args, kwargs


def _restore_first(optimizer) -> None:
    """Make paramfsm's restoring post-hook ``optimizer``'s first own post-hook."""
    hooks = optimizer._optimizer_step_post_hooks
    key = _RESTORERS.get(optimizer)
    if key not in hooks:
        key = optimizer.register_step_post_hook(_restore).id
        _RESTORERS[optimizer] = key
    hooks.move_to_end(key, last=False)


def _step_runtime(optimizer, scheduler, records, saved, stepped: set) -> None:
    plan = scheduler.offload_plan
    residency = plan.residency
    residency.settle()
    if plan.grads is not None:
        plan.grads.prune()
    wanted = set(records)
    index = {id(rec): i for i, rec in enumerate(scheduler.records)}
    seen: set = set()
    for unit in scheduler.units:
        recs = [rec for rec in unit.records if rec in wanted and rec not in seen and rec.shard.grad is not None]
        if not recs:
            continue
        seen.update(recs)
        before = [residency.shards.get(rec) for rec in recs]
        before += [optimizer_placement(plan, optimizer, rec, unit.name, index[id(rec)]) for rec in recs]
        grads = plan.grads.of(recs) if plan.grads is not None else []
        residency.need(before + grads)
        residency.read(before + grads)
        versions = [rec.shard.grad._version for rec in recs] if grads else []
        try:
            _step_only(optimizer, saved, {id(rec.shard) for rec in recs})
            residency.written(before)
            # A step reads gradients; one that changed a gradient in place has it written back too.
            residency.written([p for p, rec, v in zip(grads, recs, versions) if rec.shard.grad._version != v])
        finally:
            residency.release(before + grads)
        for rec in recs:  # state the step created (its first) gets its placement now
            optimizer_placement(plan, optimizer, rec, unit.name, index[id(rec)])
        stepped.update(id(rec.shard) for rec in recs)


def _step_only(optimizer, saved, ids: set) -> None:
    """Step ``optimizer`` over the parameters in ``ids`` alone, running no step hook."""
    for group, params in zip(optimizer.param_groups, saved):
        group["params"] = [p for p in params if id(p) in ids]
    step = step_space.bare_step(optimizer)
    _inner.unit = True
    try:
        step()
    finally:
        _inner.unit = False


def _restore(optimizer, args, kwargs) -> None:
    if _inner.unit:
        return
    held = _EMPTIED.pop(optimizer, None)
    if held is not None:
        saved, pre_hooks = held
        for group, params in zip(optimizer.param_groups, saved):
            group["params"] = params
        pre_hooks.update(optimizer._optimizer_step_pre_hooks)  # any registered during the step
        optimizer._optimizer_step_pre_hooks.clear()
        optimizer._optimizer_step_pre_hooks.update(pre_hooks)


def within_step(optimizer) -> bool:
    """Whether this pre-hook call is a parent class's ``step`` reached through ``super().step()`` inside the
    step the user called, after paramfsm stepped the units (see [Note: a parent's step inside the user's]).

    [Note: a parent's step inside the user's]
    torch wraps an optimizer class's ``step`` with its hooks when the first
    instance of that class is built. A subclass whose ``step`` calls
    ``super().step()`` (a check before the update, a logging wrapper) then
    runs the parent's wrapper too, once any instance of the parent exists in
    the process, and the global pre-hooks run again inside the user's step.
    paramfsm's pre-hook had already stepped every unit and emptied the groups
    for the rest of the call; taken for a new step, the nested call put the
    groups back and stepped every unit a second time, silently (a test
    passed alone and failed after any test that built a plain SGD). The call
    is told apart by the function torch's wrapper is running: the user's step
    is the optimizer's own class's; any other is a parent's, inside it, and
    passes through (over the emptied groups it steps nothing). The wrapper is
    the nearest frame of torch's that runs a step as ``func``, found by walking
    up from here rather than at a fixed depth: a frame added in between (a
    decorator on the pre-hook, a tracing tool) must not turn a parent's step
    into a new one, which would step every unit twice.
    """
    if optimizer not in _EMPTIED:
        return False
    running = _hooked_step()
    own = type(optimizer).step
    return running is not None and running is not getattr(own, "__wrapped__", own)


def _hooked_step():
    """The step function torch's hook-running wrapper (``Optimizer.profile_hook_step``) is running on this
    thread's stack, nearest first, or None."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is _WRAPPER_CODE:
            return frame.f_locals.get("func")
        frame = frame.f_back
    return None


_WRAPPER_CODE = torch.optim.Optimizer.profile_hook_step(lambda *args, **kwargs: None).__code__


def restore_if_left(optimizer) -> None:
    """Put back param groups a step left emptied (its post-hook did not run: the step raised)."""
    _restore(optimizer, (), {})
