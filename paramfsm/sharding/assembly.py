"""Building a runtime: ``paramfsm.shard``'s checks and the wiring of the layers (units -> hooks ->
scheduler -> fsm -> executor) behind :class:`paramfsm.runtime.Runtime`.

The facade keeps the public methods; what it takes to put a model under
paramfsm, and to hand it back (:mod:`paramfsm.sharding.teardown`), lives here, so each
concern has one module.
"""

from __future__ import annotations

import contextlib
import logging
import math
import numbers
import os
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakIdKeyDictionary

from paramfsm.sharding import conversions, full_state, memory, meta, model_changes, rank_agreement
from paramfsm.core.fsm import StepContext, compile_table, default_table
from paramfsm.core.spec import load_spec
from paramfsm.engine.effects.collectives import resolve_group, resolve_mesh, timeout_s
from paramfsm.engine.effects.executor import Executor
from paramfsm.engine.effects.streams import streams_for
from paramfsm.engine.events import hooks
from paramfsm.engine.events.compile_guard import eager
from paramfsm.engine.schedule import reshard
from paramfsm.engine.schedule.flight import FlightRecorder, make_trace
from paramfsm.engine.schedule.scheduler import Scheduler
from paramfsm.engine.storage import default_units, partitioned, placeholder
from paramfsm.engine.storage.units import build_units, select_unit_modules
from paramfsm.engine.storage.unsupported import refuse_transforms, refuse_unsupported
from paramfsm.errors import ArgumentError, ArgumentTypeError, ParamFSMError
from paramfsm.sharding.offload import plan as offload_plan
from paramfsm.sharding.rank_errors import agreed, spanned

RETAIN_POLICIES = ("defer", "regather")
# Weak registries (they never keep a model alive): sharded models, and each partitioned
# parameter's owning model class, so sharding twice is refused with a clear message.
SHARDED = WeakIdKeyDictionary()
PARTITIONED = WeakIdKeyDictionary()
log = logging.getLogger("paramfsm")


def check_arguments(model: nn.Module, group, units, mesh, *, retain, max_deferred_bytes, prefetch, trace, spec,
                    strict, bucket_bytes, param_dtype, reduce_dtype, debug, collective_timeout, sync_module_states,
                    reshard_after_forward, min_unit_bytes=None):
    """Refuse what ``shard`` cannot take, before anything is partitioned or communicated.

    Returns ``(group, replicate_group, timeout seconds, unit modules)``. A wrong
    type raises :class:`~paramfsm.errors.ArgumentTypeError`, a wrong value
    :class:`~paramfsm.errors.ArgumentError`, each naming the argument and what
    it takes, so a typo fails here rather than steps into training.
    """
    refuse_unsupported(model)  # before anything reads a parameter's size (a lazy module's has none yet)
    if not isinstance(retain, str):
        raise ArgumentTypeError(f"retain={retain!r}: expected 'defer' or 'regather'")
    if retain not in RETAIN_POLICIES:
        raise ArgumentError(f"retain={retain!r}: expected 'defer' or 'regather'")
    check_count("max_deferred_bytes", max_deferred_bytes, "None or a number of bytes >= 0 (the most that "
                "parameters kept gathered for a later backward may hold; None: no bound)", optional=True)
    check_count("prefetch", prefetch, "a number of buckets >= 0 to gather ahead of use (0: none)")
    check_count("bucket_bytes", bucket_bytes, "a number of bytes >= 0 (consecutive units are gathered, and "
                "gradients reduce-scattered, together up to that size; 0: each alone)")
    check_count("min_unit_bytes", min_unit_bytes, "None or a number of bytes >= 0 (under the default units, a "
                "module holding less joins its parent's unit; 0: none joins; None: $PARAMFSM_MIN_UNIT_BYTES, or "
                "64 KiB)", optional=True)
    try:
        min_unit_bytes = default_units.min_unit_bytes(min_unit_bytes)
    except ValueError as exc:
        raise ArgumentError(str(exc)) from None
    check_timeout(collective_timeout)
    for name, dtype in (("param_dtype", param_dtype), ("reduce_dtype", reduce_dtype)):
        check_dtype(name, dtype)
    check_trace(trace)
    if spec is not None and not isinstance(spec, (str, os.PathLike)):
        raise ArgumentTypeError(f"spec={spec!r}: expected None (the shipped spec) or a path to a lifetime spec file")
    for name, flag in (("strict", strict), ("debug", debug), ("sync_module_states", sync_module_states)):
        if not isinstance(flag, bool):
            raise ArgumentTypeError(f"{name}={flag!r}: expected True or False")
    check_reshard_policy(reshard_after_forward)
    if model in SHARDED:
        raise ParamFSMError("this model is already sharded by paramfsm; call rt.close() before sharding it again")
    for name, param in model.named_parameters():
        owner = PARTITIONED.get(param)
        if owner is not None:
            raise ParamFSMError(f"parameter '{name}' is already partitioned by paramfsm (it belongs to a "
                                f"sharded {owner}); shard the outermost model once, "
                                "or call rt.close() on the other runtime first")
    unit_modules = select_unit_modules(model, units, min_unit_bytes)
    try:
        limit = timeout_s(collective_timeout)
    except ValueError as exc:  # $PARAMFSM_COLLECTIVE_TIMEOUT: the argument itself is checked above
        raise ParamFSMError(str(exc)) from None
    replicate_group = None
    if mesh is not None:
        if group is not None:
            raise ArgumentError("give group= or mesh=, not both")
        try:
            group, replicate_group = resolve_mesh(mesh)
        except ValueError as exc:
            raise ArgumentError(str(exc)) from None
    return group, replicate_group, limit, unit_modules


def check_count(name: str, value, expected: str, *, optional: bool = False) -> None:
    """An integer argument >= 0 (None too when ``optional``); a bool is refused, though Python counts it an int."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"{name}={value!r}: expected {expected} (got {type(value).__name__})")
    if value < 0:
        raise ArgumentError(f"{name}={value!r}: expected {expected}")


def check_timeout(value) -> None:
    """``collective_timeout``: None or a finite, positive number of seconds (a wait's limit must be reachable)."""
    expected = "None or a finite number of seconds > 0 (None: $PARAMFSM_COLLECTIVE_TIMEOUT, or 600)"
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ArgumentTypeError(f"collective_timeout={value!r}: expected {expected} (got {type(value).__name__})")
    if not (math.isfinite(value) and value > 0):
        raise ArgumentError(f"collective_timeout={value!r}: expected {expected}")


def check_dtype(name: str, dtype) -> None:
    """``param_dtype`` / ``reduce_dtype``: None or a floating-point ``torch.dtype`` (parameters are floating point)."""
    expected = "None or a floating-point torch.dtype, such as torch.bfloat16 or torch.float32"
    if dtype is None:
        return
    if not isinstance(dtype, torch.dtype):
        raise ArgumentTypeError(f"{name}={dtype!r}: expected {expected} (got {type(dtype).__name__})")
    if not dtype.is_floating_point:
        raise ArgumentError(f"{name}={dtype!r}: expected {expected}; {dtype} is not floating point")


def check_trace(trace) -> None:
    """``trace``: what :func:`paramfsm.engine.schedule.flight.make_trace` takes; a path is checked before partitioning,
    since the file is opened only once the parameters are sharded."""
    expected = ("False (the flight recorder), True (every transition), a number of records to keep (0: none) "
                "or a JSON Lines path to stream to")
    if trace is None or isinstance(trace, bool):
        return
    if isinstance(trace, (str, os.PathLike)):
        path = Path(trace)
        if not str(trace):
            raise ArgumentError(f"trace={trace!r}: expected {expected}, not an empty path")
        if path.is_dir():
            raise ArgumentError(f"trace={trace!r}: {path} is a directory; give a file inside it to stream to, "
                                f"e.g. trace={str(path / 'run.jsonl')!r}")
        return
    check_count("trace", trace, expected)


def check_reshard_policy(policy) -> None:
    """``reshard_after_forward``: a bool or a predicate (the predicate's answers are checked per unit later)."""
    if not (isinstance(policy, bool) or callable(policy)):
        raise ArgumentTypeError(f"reshard_after_forward={policy!r}: expected True, False or a predicate "
                                "(name, module) -> bool")


def assemble(cls, model, group, units, *, retain, max_deferred_bytes, prefetch, trace, spec, strict, bucket_bytes,
             param_dtype, reduce_dtype, debug, collective_timeout, mesh, replicate_group, device=None,
             device_mesh=None, sync_module_states: bool = False, offload=None, reshard_after_forward=True,
             planned=None):
    """Partition ``model``'s parameters, build every part of its runtime in one pass, and return the runtime
    (``cls``, a :class:`~paramfsm.sharding.record.RuntimeRecord`) constructed with all of them.

    Each engine part receives its wiring as constructor arguments ([Note: a runtime's state is
    declared] in :mod:`paramfsm.sharding.record`). A setting refused once the shards are cut (the
    reshard predicate, the offload plan) gives every value back first ([Note: a refused shard()
    changes nothing]).
    """
    refuse_unsupported(model)
    device, born_meta = meta.placement(model, device, device_mesh)
    group, rank, world = resolve_group(group, device)
    # Hybrid sharding: the 2-D mesh and its replicate group; traces and dumps carry the global rank.
    replicas = dist.get_world_size(replicate_group) if replicate_group is not None else 1
    if world > 1 or replicas > 1:
        rank_agreement.agree(model, spanned(group, replicate_group), device,
                             sync_module_states=sync_module_states)
    trace_rank = dist.get_rank() if mesh is not None else rank
    table = compile_table(load_spec(spec)) if spec is not None else default_table()
    units, by_id = build_units(model, units, rank, world, device=device, release=True)
    records = list(by_id.values())
    compute_dtypes(model, records, param_dtype)
    index = {id(rec): i for i, rec in enumerate(records)}  # numbers full-tensor collectives
    # Always a Trace (rt.trace works with trace=0); only a recording one reaches the FSM.
    coord = (dist.get_rank(replicate_group), rank) if mesh is not None else ()
    trace = make_trace(trace, trace_rank, table.digest, records, coord)
    recording = trace if trace.limit != 0 else None
    ctx = StepContext(trace_rank, recording)
    executor = Executor(group, rank, world, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                        bucket_bytes=bucket_bytes, streams=streams_for(device), timeout_s=collective_timeout,
                        replicate_group=replicate_group, replicas=replicas, ctx=ctx,
                        unit_names=full_state.collective_names(units, records),
                        rank_check="header" if debug else "tag")
    if debug:
        log.info("paramfsm units of %s on rank %d:\n%s", type(model).__name__, trace_rank,
                 default_units.describe(units))
    plan = None
    try:  # a tier's folder or disk can fail on one rank only ([Note: an error one rank meets])
        kept = reshard.kept_units(units, reshard_after_forward)
        with agreed(spanned(group, replicate_group), "paramfsm.shard's offload setting") \
                if offload is not None else contextlib.nullcontext():
            plan = offload_plan(offload, units=units, index=index, rank=rank, world=world, ctx=ctx)
    except BaseException:
        if plan is not None:  # built here, refused on another rank
            plan.close(strict=False)
        give_back(executor, len(units), index, records, born_meta, trace)
        raise
    for rec in records:
        partitioned.adopt(rec.param, rec, trace_rank)
        executor.free((rec,))
    rt = None  # the runtime, constructed below: the flight recorder's memory line reads it once it exists
    flight = FlightRecorder(recording, ctx, memory=lambda: memory.describe(memory.memory(rt)))
    scheduler = Scheduler(table, units, records, executor, ctx=ctx, retain=retain, prefetch=prefetch,
                          max_deferred_bytes=max_deferred_bytes, bucket_bytes=bucket_bytes, strict=strict,
                          on_failure=flight.failed, keep_after_forward=kept, offload=plan)
    rt = cls(model=model, group=group, rank=rank, world=world, mesh=mesh, replicate_group=replicate_group,
             replicas=replicas, table=table, units=units, ctx=ctx, trace=trace, flight=flight, executor=executor,
             scheduler=scheduler, grads=scheduler.grads, unsynced=executor.unsynced, offload=plan, by_id=by_id,
             by_name={name: rec for rec in records for name in rec.names}, index=index,
             handles=hooks.install(model, units, records, scheduler.emit),
             watch=model_changes.watch(model, records, trace_rank), values=meta.Values(), planned=planned or {})
    rt._handles.append(model.register_forward_pre_hook(eager(partial(root_checks, rt, trace_rank)), prepend=True))
    meta.watch(rt, born_meta, device)
    placeholder.answer_demands(records, scheduler.on_demand.demand)
    if param_dtype is not None:
        rt._handles.append(model.register_forward_pre_hook(partial(cast_inputs, param_dtype), with_kwargs=True))
    SHARDED[model] = True
    conversions.guard(model)
    for rec in records:
        PARTITIONED[rec.param] = type(model).__name__
    return rt


def root_checks(rt, rank, module, args) -> None:
    """The root forward's first pre-hook: refuse a torch.func transform, then any change to the model."""
    refuse_transforms(rt._by_id.values(), rank)
    rt._watch.check()


def compute_dtypes(model: nn.Module, records, param_dtype) -> None:
    """Each record's compute dtype under ``param_dtype``: the gathered parameter's and its gradient's.

    [Note: batch norms compute in their parameters' precision]
    A batch norm's statistics are sums over the batch: in bfloat16 they lose
    most of their digits, and torch's ``batch_norm`` takes low-precision inputs
    only with full-precision weights and running statistics (it raised
    "expected scalar type BFloat16 but found Float" against the float32
    buffers). So, as FSDP's mixed precision does by default, the parameters of
    every ``_BatchNorm`` (BatchNorm1d/2d/3d, SyncBatchNorm) keep their shard's
    dtype; the batch norm then takes the ``param_dtype`` activations and returns
    them in that dtype, and its gradients are reduced in full precision (a
    bucket of mixed dtypes is reduced in the widest).
    """
    if param_dtype is None:
        return
    kept = {id(p) for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)
            for p in m.parameters(recurse=False)}
    for rec in records:
        rec.compute_dtype = rec.shard.dtype if id(rec.param) in kept else param_dtype


def give_back(executor, units: int, index: dict, records, born_meta: bool, trace) -> None:
    """Put each parameter's full values back after ``shard()`` refused a setting once the shards were cut.

    [Note: a refused shard() changes nothing]
    The offload plan is resolved on the built units (the predicate's answers, the
    bounds against each unit's shard bytes, the tiers' folders and reserved
    space), after :func:`~paramfsm.engine.storage.units.build_units` let each
    full parameter go, so the model is never held twice. A refusal there must
    still leave the model as it was: trainable, with the same values, and
    shardable again. No hook, class or placeholder is in place yet, so the full
    values are all-gathered from the shards (collective: the settings that fail
    here fail on every rank alike) and put back; a parameter born on the meta
    device goes back to meta.
    """
    try:
        for rec in records:
            if born_meta:
                torch.utils.swap_tensors(rec.param, nn.Parameter(
                    torch.empty(rec.shape, dtype=rec.param.dtype, device="meta"), requires_grad=rec.requires_grad))
            else:
                rec.param.data = full_state.gather_with(executor, rec, rec.shard, units=units, index=index, step=0)
    finally:
        trace.close()


def cast_inputs(dtype, module, args, kwargs):
    """Root forward pre-hook under ``param_dtype``: cast floating-point tensor inputs to the compute dtype."""
    def cast(value):
        return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value
    return tree_map(cast, args), tree_map(cast, kwargs)

