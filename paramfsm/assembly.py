"""Building a runtime: ``paramfsm.shard``'s checks and the wiring of the layers (units -> hooks ->
scheduler -> fsm -> executor) behind :class:`paramfsm.runtime.Runtime`.

The facade keeps the public methods; what it takes to put a model under
paramfsm, and to hand it back (:mod:`paramfsm.teardown`), lives here, so each
concern has one module.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakIdKeyDictionary

from paramfsm import full_state, memory, meta, optim, rank_agreement
from paramfsm.core.fsm import compile_table, default_table
from paramfsm.core.spec import load_spec
from paramfsm.engine import hooks, on_demand, partitioned, reshard
from paramfsm.engine.collectives import resolve_group, resolve_mesh, timeout_s
from paramfsm.engine.executor import Executor
from paramfsm.engine.flight import FlightRecorder, make_trace
from paramfsm.engine.scheduler import Scheduler
from paramfsm.engine.streams import streams_for
from paramfsm.engine.units import build_units
from paramfsm.engine.unsupported import refuse_unsupported
from paramfsm.errors import ParamFSMError

RETAIN_POLICIES = ("defer", "regather")
# Weak registries (they never keep a model alive): sharded models, and each partitioned
# parameter's owning model class, so sharding twice is refused with a clear message.
SHARDED = WeakIdKeyDictionary()
PARTITIONED = WeakIdKeyDictionary()


def check_arguments(model: nn.Module, group, retain: str, prefetch: int, collective_timeout, mesh):
    """Refuse what ``shard`` cannot take; returns ``(group, replicate_group, timeout seconds)``."""
    if retain not in RETAIN_POLICIES:
        raise ParamFSMError(f"retain={retain!r}: expected one of {RETAIN_POLICIES}")
    if model in SHARDED:
        raise ParamFSMError("this model is already sharded by paramfsm; call rt.close() before sharding it again")
    for name, param in model.named_parameters():
        owner = PARTITIONED.get(param)
        if owner is not None:
            raise ParamFSMError(f"parameter '{name}' is already partitioned by paramfsm (it belongs to a "
                                f"sharded {owner}); shard the outermost model once, "
                                "or call rt.close() on the other runtime first")
    if prefetch < 0:
        raise ParamFSMError(f"prefetch={prefetch}: must be >= 0")
    try:
        limit = timeout_s(collective_timeout)
        replicate_group = None
        if mesh is not None:
            if group is not None:
                raise ValueError("give group= or mesh=, not both")
            group, replicate_group = resolve_mesh(mesh)
    except ValueError as exc:
        raise ParamFSMError(str(exc)) from None
    return group, replicate_group, limit


def check_reshard_policy(policy) -> None:
    if not (isinstance(policy, bool) or callable(policy)):
        raise ParamFSMError(f"reshard_after_forward={policy!r}: expected True, False or a predicate "
                            "(name, module) -> bool")


def apply_reshard_policy(rt, policy) -> None:
    """Resolve ``reshard_after_forward`` per unit; a predicate that fails hands the model back first."""
    try:
        rt.scheduler.keep_after_forward = reshard.kept_units(rt.units, policy)
    except BaseException:
        rt.close()
        raise


def assemble(rt, model, group, units, retain, max_deferred_bytes, prefetch, trace, spec, strict,
             bucket_bytes, param_dtype, reduce_dtype, debug, collective_timeout, mesh, replicate_group,
             device=None, device_mesh=None, sync_module_states: bool = False) -> None:
    """Partition ``model``'s parameters and wire the layers onto ``rt`` (the fields the facade reads)."""
    rt.model = model
    refuse_unsupported(model)
    device, born_meta = meta.placement(model, device, device_mesh)
    rt.group, rt.rank, rt.world = resolve_group(group, device)
    # Hybrid sharding: the 2-D mesh and its replicate group; traces and dumps carry the global rank.
    rt.mesh, rt.replicate_group = mesh, replicate_group
    rt.replicas = dist.get_world_size(replicate_group) if replicate_group is not None else 1
    if rt.world > 1 or rt.replicas > 1:
        rank_agreement.agree(model, [rt.group] + ([replicate_group] if replicate_group is not None else []), device,
                             sync_module_states=sync_module_states)
    trace_rank = dist.get_rank() if mesh is not None else rt.rank
    rt.table = compile_table(load_spec(spec)) if spec is not None else default_table()
    rt.units, by_id = build_units(model, units, rt.rank, rt.world, device=device, release=True)
    records = list(by_id.values())
    rt._by_id = by_id
    rt._by_name = {name: rec for rec in records for name in rec.names}
    rt._index = {id(rec): i for i, rec in enumerate(records)}  # numbers full-tensor collectives
    # Always a Trace (rt.trace works with trace=0); only a recording one reaches the FSM.
    coord = (dist.get_rank(replicate_group), rt.rank) if mesh is not None else ()
    rt.trace = make_trace(trace, trace_rank, rt.table.digest, records, coord)
    recording = rt.trace.limit != 0
    rt.executor = Executor(rt.group, rt.rank, rt.world, param_dtype=param_dtype,
                           reduce_dtype=reduce_dtype, bucket_bytes=bucket_bytes,
                           streams=streams_for(device), timeout_s=collective_timeout,
                           replicate_group=replicate_group, replicas=rt.replicas)
    rt.scheduler = Scheduler(rt.table, rt.units, records, rt.executor,
                             rank=trace_rank, retain=retain, prefetch=prefetch,
                             max_deferred_bytes=max_deferred_bytes, bucket_bytes=bucket_bytes,
                             trace=rt.trace if recording else None, strict=strict)
    rt.flight = FlightRecorder(rt.trace if recording else None, rt.scheduler.ctx)
    rt.scheduler.on_failure = rt.flight.failed
    rt.flight.memory = lambda: memory.describe(memory.memory(rt))
    rt.executor.ctx = rt.scheduler.ctx
    rt.executor.unit_names = full_state.collective_names(rt.units, records)
    if debug:
        rt.executor.rank_check = "header"
    for rec in records:
        partitioned.adopt(rec.param, rec, trace_rank)
        rt.executor.free((rec,))
    rt._handles = hooks.install(model, rt.units, records, rt.scheduler.emit)
    meta.watch(rt, born_meta, device)
    on_demand.watch(records, rt.scheduler)
    if param_dtype is not None:
        rt._handles.append(model.register_forward_pre_hook(partial(cast_inputs, param_dtype), with_kwargs=True))
    SHARDED[model] = True
    optim.install(rt.shard_parameters())
    for rec in records:
        PARTITIONED[rec.param] = type(model).__name__


def cast_inputs(dtype, module, args, kwargs):
    """Root forward pre-hook under ``param_dtype``: cast floating-point tensor inputs to the compute dtype."""
    def cast(value):
        return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value
    return tree_map(cast, args), tree_map(cast, kwargs)

