"""The public facade: ``paramfsm.shard(model)`` returns a :class:`Runtime` (DESIGN §4).

The runtime wires the layers together (units -> hooks -> scheduler -> fsm ->
executor) and offers what training loops use: shard parameters for the
optimizer, states, full gradients/parameters/state dicts, backward, flush,
gathered access, and close.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from paramfsm import optim
from paramfsm.optim import grad_norm
from paramfsm.sharding import accumulation, assembly, full_state, materialize, memory, teardown
from paramfsm.sharding import offload as offload_module
from paramfsm.core.spec import State
from paramfsm.engine.effects.executor import DEFAULT_BUCKET_BYTES
from paramfsm.engine.events import graph_task as gt
from paramfsm.engine.storage.default_units import describe
from paramfsm.engine.storage.units import ParamRecord
from paramfsm.errors import ParamFSMError
from paramfsm.sharding.gathered import gathered as gathered_block
from paramfsm.sharding.record import RuntimeRecord


def shard(model: nn.Module, *, group=None, units=None, retain: str = "defer", max_deferred_bytes=None,
          prefetch: int = 1, trace=False, spec=None, strict: bool = False,
          bucket_bytes: int = DEFAULT_BUCKET_BYTES, param_dtype=None, reduce_dtype=None, debug: bool = False,
          collective_timeout: float | None = None, mesh=None, device=None,
          sync_module_states: bool = False, reshard_after_forward=True, offload=None,
          min_unit_bytes: int | None = None, memory_budget=None) -> "Runtime":
    """Partition every parameter of ``model`` across the ranks of ``group`` and drive its lifetimes.

    ``units``: None (the default units: the blocks named in the model's
    ``_no_split_modules``, else every module owning parameters directly, a module
    holding less than ``min_unit_bytes`` joining its parent's unit (None:
    ``$PARAMFSM_MIN_UNIT_BYTES``, else 64 KiB; 0: none joins);
    ``rt.describe_units()`` shows the choice), ``by_size(...)``, a predicate
    ``(name, module) -> bool``, or a list of module classes, modules of the
    model and predicates; a class or module that matches nothing raises
    ``ArgumentError`` when no entry matches, else warns ``UnmatchedUnits``
    (:func:`paramfsm.engine.storage.units.select_unit_modules`). Every argument is checked
    before anything changes: a wrong type raises ``ArgumentTypeError``, a wrong
    value ``ArgumentError``, naming it (:func:`paramfsm.sharding.assembly.check_arguments`). ``retain``:
    "defer" keeps parameters released inside a keep-graph backward for the
    next backward; "regather" releases at once. ``max_deferred_bytes`` bounds
    deferred memory. ``prefetch``: buckets gathered ahead of use.
    ``bucket_bytes``: consecutive units are gathered (and gradients
    reduce-scattered) together up to this many bytes (8 MiB: see [Note: the
    default bucket is 8 MiB] in :mod:`paramfsm.engine.effects.executor`). ``spec``: a path to an
    alternative lifetime spec. ``trace``: False keeps the flight recorder, a ring
    of the last ``$PARAMFSM_TRACE_RECORDS`` (default 8192) transitions dumped
    when something fails (:mod:`paramfsm.engine.schedule.flight`); an int N keeps the last
    N (0: no trace at all); True keeps every transition in memory; a path
    streams every transition to that JSON Lines file. ``strict``: cross-check every transition against
    the spec's ``transitions`` Machine (microseconds per step) and raise on leaks
    instead of logging them.
    ``param_dtype``: gather and compute in this dtype (e.g. ``torch.bfloat16``)
    while shards, gradients and the optimizer stay in the parameters' dtype;
    floating-point inputs of the root forward are cast to it. ``reduce_dtype``:
    reduce-scatter gradients in this dtype. ``debug``: check that all ranks
    issue the same collectives with a small blocking header all-gather before
    every all-gather and reduce-scatter, on every backend (see
    :mod:`paramfsm.engine.effects.rankcheck`). Without it, on gloo, a tag rides in each
    gather bucket and every collective agrees its sizes across ranks before it
    moves (headers the exchange threads swap, none once the steps repeat), so a
    desync still raises RankDesync on every rank instead of aborting the
    process; on CUDA only ``debug`` checks.
    ``collective_timeout``: seconds any host wait on a collective may take
    before :class:`~paramfsm.errors.CollectiveTimeout` is raised (default
    ``$PARAMFSM_COLLECTIVE_TIMEOUT`` or 600).
    ``mesh``: a ``DeviceMesh`` instead of ``group``. 1-D: shard over it. 2-D
    ``(replicate, shard)``: hybrid sharding, as FSDP2 takes it: parameters are
    sharded along the shard dimension and replicated along the other; gradients
    are reduce-scattered within the shard group, then all-reduced across
    replicas (averaged over every rank, like plain torch on the global batch).
    ``device``: where the shards of a model built on the meta device go (default:
    the current CUDA device when CUDA is available, else the CPU); its values are
    then set by :meth:`Runtime.init_weights` or a load (see :mod:`paramfsm.sharding.meta`).
    A model off the meta device keeps its own device, and ``device`` must agree with it.
    ``sync_module_states``: broadcast rank 0's parameters and buffers before
    sharding. Every call checks that all ranks hold the same model (one small
    collective, :mod:`paramfsm.sharding.rank_agreement`): different parameters raise
    ``ModelMismatch``, different values warn ``RanksDiffer``.
    ``reshard_after_forward``: True releases every unit after its forward, the
    root included (gathered again in backward); False keeps every unit gathered
    from its forward to its backward (one all-gather per unit per step, more
    memory); a predicate ``(name, module) -> bool`` decides per unit (``""`` is
    the root: ``lambda name, module: name != ""`` keeps only the root, FSDP2's
    default). See :mod:`paramfsm.engine.schedule.reshard`.
    ``offload``: None, a :class:`paramfsm.Offload` (where every unit's shards and optimizer state
    live: working memory, ``"cpu"`` or ``"disk"``), or a predicate ``(name, module) -> Offload | None``
    choosing per unit; see :mod:`paramfsm.sharding.offload`.
    ``memory_budget``: bytes per rank (or ``"20GiB"``); when the memory plan of this call
    (:func:`paramfsm.plan`) exceeds it, ``shard()`` raises before anything changes, naming what to move.
    """
    offload_module.check_offload(offload)
    planned = dict(units=units, min_unit_bytes=min_unit_bytes, prefetch=prefetch, bucket_bytes=bucket_bytes,
                   reshard_after_forward=reshard_after_forward, retain=retain, max_deferred_bytes=max_deferred_bytes,
                   param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    if memory_budget is not None:
        from paramfsm import planning

        planning.refuse_over_budget(model, memory_budget, group, dict(planned, offload=offload, mesh=mesh))
    group, replicate_group, limit, units = assembly.check_arguments(
        model, group, units, mesh, retain=retain, max_deferred_bytes=max_deferred_bytes, prefetch=prefetch,
        trace=trace, spec=spec, strict=strict, bucket_bytes=bucket_bytes, param_dtype=param_dtype,
        reduce_dtype=reduce_dtype, debug=debug, collective_timeout=collective_timeout,
        sync_module_states=sync_module_states, reshard_after_forward=reshard_after_forward,
        min_unit_bytes=min_unit_bytes)
    rt = assembly.assemble(
        Runtime, model, group, units, retain=retain, max_deferred_bytes=max_deferred_bytes, prefetch=prefetch,
        trace=trace, spec=spec, strict=strict, bucket_bytes=bucket_bytes, param_dtype=param_dtype,
        reduce_dtype=reduce_dtype, debug=debug, collective_timeout=limit,
        mesh=mesh if replicate_group is not None else None, replicate_group=replicate_group, device=device,
        device_mesh=mesh, sync_module_states=sync_module_states, offload=offload,
        reshard_after_forward=reshard_after_forward, planned=dict(planned, offload=offload, mesh=mesh))
    # The optimizer step pre-hook that maps optimizers built over model.parameters() to the shards, and
    # torch's clip_grad_norm_ over shard gradients: installed from here, as sharding/ stands below optim/.
    optim.install(list(rt._by_id.values()), rt.scheduler, rt)
    grad_norm.install()
    return rt


class Runtime(RuntimeRecord):
    """A sharded model's lifetime runtime. Create it with :func:`paramfsm.shard`.

    Its fields are :class:`~paramfsm.sharding.record.RuntimeRecord`'s, each documented there; this class adds
    the public methods and no state.
    """

    # ------------------------------------------------------------------ lookup
    def record(self, param_or_name):
        """The side-table record of a parameter, by qualified name or by the parameter itself."""
        if isinstance(param_or_name, ParamRecord):
            return param_or_name
        if isinstance(param_or_name, str):
            rec = self._by_name.get(param_or_name)
        else:
            rec = self._by_id.get(id(param_or_name))
        if rec is None:
            raise ParamFSMError(f"{param_or_name if isinstance(param_or_name, str) else 'the given tensor'} "
                                "is not a parameter partitioned by this runtime; names are "
                                f"qualified as in model.named_parameters(), e.g. {next(iter(self._by_name))!r}")
        return rec

    def describe_units(self) -> str:
        """A table of the units: each one's module, parameter count, bytes and why it was chosen
        (``units=``, ``_no_split_modules``, a module owning parameters, the root, and the small
        modules merged into it); logged at INFO on the "paramfsm" logger with ``debug=True``."""
        return describe(self.units)

    def state(self, param_or_name) -> State:
        return self.record(param_or_name).state

    def states(self) -> dict[str, State]:
        return {rec.name: rec.state for rec in self._by_id.values()}

    def shard_parameters(self) -> list[nn.Parameter]:
        """This rank's shards, as leaf Parameters, in model order: give them to the optimizer."""
        return [rec.shard for rec in self._by_id.values()]

    def named_shard_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        return ((rec.name, rec.shard) for rec in self._by_id.values())

    @property
    def deferred_bytes(self) -> int:
        return self.scheduler.deferral.bytes

    def plan(self, example_input=None, *, optimizer="adamw", activations=None, budget=None):
        """The memory plan of this runtime's model and options (:func:`paramfsm.plan`); no collective."""
        from paramfsm import planning

        return planning.plan_runtime(self, example_input=example_input, optimizer=optimizer,
                                     activations=activations, budget=budget)

    def memory(self) -> dict[str, int]:
        """Bytes held now, by kind (shards, gathered parameters, unsynchronised gradients, ...): see
        :mod:`paramfsm.sharding.memory`."""
        return memory.memory(self)

    def reset_peak_memory(self) -> None:
        """Count each phase's peak from now on; ``rt.memory()`` then gains ``peak_<phase>``. Off until the first
        call (it costs a sample per transition); see :class:`paramfsm.planning.measure.Tracker`."""
        if self.scheduler.peaks is None:
            from paramfsm.planning.measure import Tracker

            self.scheduler.peaks = Tracker(self)
        self.scheduler.peaks.reset()

    def peak_memory(self) -> dict:
        """Each phase's peak since the last :meth:`reset_peak_memory`: ``{phase: {"total", "unit", "event",
        "kinds"}}``, counted as :meth:`plan` counts it."""
        return memory.peaks(self)

    @property
    def counters(self) -> dict[str, int]:
        return self.executor.counters.as_dict()

    # ------------------------------------------------------------------ collectives
    @contextlib.contextmanager
    def _reporting(self):
        """Hand an exception raised outside the scheduler (a collective here) to the flight recorder."""
        try:
            yield
        except Exception as exc:
            self.flight.failed(exc)
            raise

    def full_param(self, param_or_name) -> torch.Tensor:
        """The full parameter, all-gathered from the shards (collective: every rank calls it; rank-checked)."""
        rec = self.record(param_or_name)
        with self._reporting():
            return full_state.gather(self, rec, rec.shard, full_state.PARAMETER)

    def full_grad(self, param_or_name) -> torch.Tensor | None:
        """The full averaged gradient, all-gathered from the shard grads (collective; rank-checked).

        None when no backward produced a gradient for it since the last zero_grad
        (the same on every rank, as every rank runs the same backward).
        """
        rec = self.record(param_or_name)
        accumulation.require_synced(self, "rt.full_grad()")
        grad = rec.shard.grad
        if grad is None:
            return None
        with self._reporting():
            return full_state.gather(self, rec, grad, full_state.GRADIENT)

    def full_state_dict(self, *, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """A plain state dict (full tensors, the model's own keys): loadable without paramfsm. Collective.

        Each distinct parameter is gathered once; the keys of a tied parameter
        share one tensor. ``rank0_only=True``: rank 0 gets the full tensors on
        the CPU, the other ranks an empty dict (see :mod:`paramfsm.sharding.full_state`).
        """
        with self._reporting():
            return full_state.full_state_dict(self, rank0_only=rank0_only)

    def init_weights(self, fn=None) -> None:
        """Initialise every parameter module by module: ``reset_parameters()`` in ``model.modules()`` order,
        or ``fn(module)`` in ``model.apply`` order; bit-identical to the same init of the unsharded model.

        Every rank calls it, seeded identically. Again, or on a model not built on
        meta, it re-initialises. See :mod:`paramfsm.sharding.materialize`.
        """
        materialize.init_weights(self, fn)

    def load_full_state_dict(self, state_dict) -> None:
        """Load a plain (full) state dict: each rank keeps its slice of every parameter (tied keys: any one)."""
        full_state.load_full_state_dict(self, state_dict)

    def sharded_state_dict(self, layout: str = "model") -> dict:
        """This rank's shards (plus buffers), for ``torch.distributed.checkpoint``.

        ``layout="model"`` (the default): each parameter with its model shape, as
        the pieces this rank holds (the standard layout, which plain models and
        FSDP2 load, and :func:`paramfsm.checkpoint.save` writes); ``layout="flat"``:
        flat sharded DTensors of ``(numel,)``, the layout of the first releases.
        ``dcp.save(rt.sharded_state_dict(), checkpoint_id=path)`` saves; a checkpoint
        saved on any number of ranks loads with ``sd = rt.sharded_state_dict();
        dcp.load(sd, checkpoint_id=path); rt.load_sharded_state_dict(sd)``. See
        :mod:`paramfsm.checkpoint` (also for optimizer state).
        """
        from paramfsm import checkpoint  # DTensor and DCP: paid for by the first checkpoint, not by shard()

        return checkpoint.sharded_state_dict(self, layout=layout)

    def load_sharded_state_dict(self, state_dict) -> None:
        """Load a state dict shaped like :meth:`sharded_state_dict` (any saving world size, via DCP)."""
        from paramfsm import checkpoint

        checkpoint.load_sharded_state_dict(self, state_dict)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, *,
                        error_if_nonfinite: bool = False) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` over the shard gradients; returns the total norm. Collective."""
        accumulation.require_synced(self, "rt.clip_grad_norm_()")
        with self._reporting():
            reduce = None if self.world == 1 else (
                lambda values, op: full_state.all_reduce(self, values, op, full_state.REDUCTIONS[0]))
            paging = self.offload.residency.holding if self.offload is not None else None
            return grad_norm.clip_grad_norm_(self.shard_parameters(), max_norm, norm_type,
                                             error_if_nonfinite=error_if_nonfinite, reduce=reduce, paging=paging)

    # ------------------------------------------------------------------ control
    def set_step(self, step: int) -> None:
        """Name the training step about to run; call it on every rank at the top of each iteration.

        Forwards from now on carry ``step`` (in traces, dumps and the rank-order
        check) instead of a count of root forwards. A count cannot tell a step
        a rank skipped (``continue`` before the forward) from one it took, so
        the skipping rank's next step would silently pair with its peers'
        current one; a named step makes that rank's next collective raise
        RankDesync (on the CPU with the default check, everywhere with
        ``debug=True``).
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ParamFSMError(f"rt.set_step({step!r}): expected a training step number >= 0")
        self.ctx.pinned = step

    def backward(self, loss, retain_graph=None, create_graph: bool = False, **kwargs) -> None:
        """``loss.backward(...)``; identical to calling it directly (kept for explicitness and fallback)."""
        keep = create_graph if retain_graph is None else retain_graph
        gt.explicit_keep_graph.append(bool(keep))
        try:
            with self._reporting():
                loss.backward(retain_graph=retain_graph, create_graph=create_graph, **kwargs)
        finally:
            gt.explicit_keep_graph.pop()

    def no_sync(self):
        """Context manager: backward passes inside keep full gradients locally (see :mod:`paramfsm.sharding.accumulation`)."""
        return accumulation.no_sync(self)

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """False: backward keeps full gradients locally until sync is on again (FSDP2's switch)."""
        accumulation.set_requires_gradient_sync(self, requires_gradient_sync)

    def sync_gradients(self) -> None:
        """Reduce-scatter the gradients kept under ``no_sync`` now. Collective: every rank calls it."""
        accumulation.sync_gradients(self)

    def flush(self) -> None:
        """Return every deferred parameter to NOT_AVAILABLE now.

        It releases what a retained graph keeps gathered for a later backward
        (DEFERRED_RELEASE) and nothing else: parameters held by a forward or
        backward in progress, or by ``rt.gathered``, stay. A backward over a
        retained graph after a flush gathers again. After an exception, use
        :meth:`reset`.
        """
        self.scheduler.request_flush()

    def reset(self) -> None:
        """Return every parameter to NOT_AVAILABLE now, after an exception inside forward or backward.

        An exception leaves parameters gathered (prefetched, held by the
        interrupted unit, deferred). The next forward recovers by itself; this
        releases the memory at once, e.g. before handling the error. It issues
        no collective: all-gathers and reduce-scatters already issued (every
        rank issued them) are waited for and their results dropped, and the
        gradients of an interrupted backward never reach the shard gradients.
        If a peer rank died, an issued collective may never complete: use
        :meth:`detach` instead. Call it between iterations, not inside forward or backward.
        """
        self.scheduler.recover("rt.reset()")

    def gathered(self, *modules: nn.Module, writeback: bool = True):
        """Hold the full parameters of ``modules`` (all units if none given) for use outside forward.

        Collective: every rank enters and leaves together. ``writeback=True``: in-place
        changes to the full parameters reach the shards when the block ends, checked to be the
        same on every rank; ``writeback=False``: read-only. See :mod:`paramfsm.sharding.gathered`.
        """
        return gathered_block(self, modules, writeback)

    def generate(self, *args, **kwargs):
        """``model.generate(...)`` for a sharded Hugging Face model, ready for different prompts per rank.

        Collective: every rank of the default process group calls it. It turns
        on ``synced_gpus`` (unless given), which transformers enables by itself
        only for DeepSpeed ZeRO-3 and FSDP; see :func:`paramfsm.integrations.hf.generate`.
        """
        from paramfsm.integrations import hf

        return hf.generate(self, *args, **kwargs)

    def detach(self) -> None:
        """Stop managing the model without any collective: remove every hook and forget it.

        For error recovery when a peer rank failed and a collective could hang;
        parameters stay as they are (their shards are lost). Prefer ``close()``.
        """
        teardown.detach(self)

    def close(self) -> nn.Module:
        """Restore plain full parameters in the model and remove every hook; returns the model."""
        return teardown.close(self)
