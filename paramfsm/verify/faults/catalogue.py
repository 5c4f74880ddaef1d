"""A catalogue of real parameter-lifetime bugs, each injectable into paramfsm for a test.

Every entry re-creates, inside paramfsm, a bug that shipped in a ZeRO-3 or
FSDP implementation, or in the loss scaling, clipping or sharded
checkpointing around one (the ``source`` says where it was reported), or a
bug planted in paramfsm's own newest code that its test suite missed
(``paramfsm #28``; the ``source`` names the closest bug reported elsewhere). A
fault is a context manager that monkeypatches one scheduler, executor, hooks
or graph-task function (or, in :mod:`paramfsm.verify.faults.training`, the
scaler, clipping or checkpoint function) for the duration of the ``with``
block and restores it afterwards; nothing in the normal code path knows
about faults.

Faults act in the process that activates them. Under a
:class:`~paramfsm.verify.launch.RankPool` the rank job activates the fault by name
(``paramfsm.verify.runner.run_program`` takes it in its options), around
``paramfsm.shard`` and the whole program: patches of methods the scheduler
binds at construction (its effect table) only take effect on runtimes
created while the fault is active.

``paramfsm verify`` must kill every entry (``paramfsm trace check`` an entry
with a ``trace_scenario``): ``python -m paramfsm.testing.mutants`` prints the
table and ``tests/test_mutants.py`` asserts it.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import attrs
import torch
import torch.distributed as dist

from paramfsm.core.spec import State
from paramfsm.engine.effects import executor
from paramfsm.engine.effects.executor import Executor
from paramfsm.engine.events import events, graph_task, hooks
from paramfsm.engine.schedule.backward import GraphTasks
from paramfsm.engine.schedule.deferral import Deferral
from paramfsm.engine.schedule.prefetch import Prefetch
from paramfsm.engine.schedule.scheduler import Scheduler
from paramfsm.engine.storage.partitioned import real_grad, set_real_grad
from paramfsm.verify.faults.accumulation import ACCUMULATION
from paramfsm.verify.faults.compute import COMPUTE
from paramfsm.verify.faults.default_units import DEFAULT_UNITS
from paramfsm.verify.faults.patching import patched as _patched
from paramfsm.verify.faults.regressions import REGRESSIONS
from paramfsm.verify.faults.routing import ROUTING
from paramfsm.verify.faults.offload import OFFLOAD
from paramfsm.verify.faults.shard_writes import SHARD_WRITES
from paramfsm.verify.faults.steps import STEPS
from paramfsm.verify.faults.training import (
    checkpoint_offset_unpadded, clip_without_clamp, found_inf_not_agreed, scale_not_backpropagated,
    unscaled_once_per_backward,
)
from paramfsm.verify.faults.user_paths import (
    retain_lost_in_higher_order, ring_window_forgets_idle, scrolled_leak_scenario, snapshot_accepted_anywhere,
    spliced_snapshot_scenario, tied_aliases_compared_by_identity,
)


@attrs.frozen(slots=True)
class Fault:
    """One catalogued bug: what goes wrong, where it was reported, and how to inject it."""

    name: str
    bug: str
    source: str
    kind: str  # "correctness", "memory" or "performance": what verify must notice
    inject: Callable[[], contextlib.AbstractContextManager]
    #: For a bug in what ``paramfsm trace check`` reads: a trace made with the bug active that the check must
    #: reject; ``make mutants`` kills such a fault through ``trace check`` instead of verify.
    trace_scenario: Callable[[], list] | None = None
    subject: str | None = None  # the verify factory that exercises it (None: the catalogue's default)


def _preprocess_once_per_process():
    done: set = set()

    def make(original):
        def on_pre_backward(self, ev):
            if ev.unit in done:
                self._begin_task(ev.graph_task, ev.keep_graph)
                return
            done.add(ev.unit)
            original(self, ev)
        return on_pre_backward
    return _patched(GraphTasks, "on_pre_backward", make)


def _release_in_retained_window():
    def make(original):
        def _effect_runners(self):
            runners = original(self)
            defer, free = runners["defer"], runners["free"]
            runners["defer"] = lambda records: (defer(records), free(records))
            return runners
        return _effect_runners
    return _patched(Scheduler, "_effect_runners", make)


@contextlib.contextmanager
def _once_per_forward_flag():
    ran: set = set()

    def pre_backward(original):
        def on_pre_backward(self, ev):
            if id(ev.call) in ran:
                self._begin_task(ev.graph_task, ev.keep_graph)
                return
            ran.add(id(ev.call))
            original(self, ev)
        return on_pre_backward

    def forward_begin(original):
        def _on_forward_begin(self, ev):
            if ev.graph_task == graph_task.NO_TASK:
                ran.clear()
            original(self, ev)
        return _on_forward_begin

    with _patched(GraphTasks, "on_pre_backward", pre_backward), \
            _patched(Scheduler, "_on_forward_begin", forward_begin):
        yield


def _deferred_never_flushed():
    return _patched(Deferral, "flush", lambda original: lambda self: None)


def _tied_reduced_twice():
    def make(original):
        def take_grad(self, records):
            for rec in records:
                grad = real_grad(rec.param)
                original(self, (rec,))
                for _ in rec.units[1:]:
                    set_real_grad(rec.param, grad)
                    original(self, (rec,))
        return take_grad
    return _patched(Executor, "take_grad", make)


def _release_before_last_holder():
    def make(original):
        def release(self, unit, keep_graph):
            defer = keep_graph and self.allowed
            for rec in unit.records:
                while rec.holds > 1:
                    self._step(rec, "release", defer)
            original(self, unit, keep_graph)
        return release
    return _patched(Deferral, "release", make)


def _abandoned_prefetch_left_inflight():
    return _patched(Prefetch, "_abandon", lambda original: lambda self, plan, passes: None)


def _no_grad_forward_left_gathered():
    def make(original):
        def _post_forward(emit, unit, chain, module, args, output):
            if not torch.is_grad_enabled():
                return None
            return original(emit, unit, chain, module, args, output)
        return _post_forward
    return _patched(hooks, "_post_forward", make)


def _grads_summed_not_averaged():
    def make(original):
        def reduce_scatter_flat(out, inp, group, async_op=True, **kwargs):
            return original(out, inp.mul_(dist.get_world_size(group)), group, async_op, **kwargs)
        return reduce_scatter_flat
    return _patched(executor, "reduce_scatter_flat", make)


def _deferred_reuse_regathers():
    def make(original):
        def fetch(self, unit, plan, passes):
            for rec in unit.records:
                if rec.state is State.DEFERRED_RELEASE:
                    self._step(rec, "flush")
            original(self, unit, plan, passes)
        return fetch
    return _patched(Prefetch, "fetch", make)


def _released_data_not_emptied():
    return _patched(Executor, "free", lambda original: lambda self, records: None)


def _final_callback_once_per_process():
    queued: list = []

    def make(original):
        def queue_final_callback(callback):
            if not queued:
                queued.append(callback)
                original(callback)
        return queue_final_callback
    return _patched(graph_task, "queue_final_callback", make)


def _retained_graph_drop_not_returned():
    return _patched(events.ForwardCall, "__del__", lambda original: lambda self: None)


def _recompute_not_gathered():
    def pre(original):
        def _on_pre_forward(self, ev):
            if ev.graph_task == graph_task.NO_TASK:
                original(self, ev)
        return _on_pre_forward

    def post(original):
        def _on_post_forward(self, ev):
            if ev.graph_task == graph_task.NO_TASK:
                original(self, ev)
        return _on_post_forward

    @contextlib.contextmanager
    def both():
        with _patched(Scheduler, "_on_pre_forward", pre), _patched(Scheduler, "_on_post_forward", post):
            yield
    return both()


CATALOGUE: tuple[Fault, ...] = (
    Fault("preprocess_once_per_process",
          "pre-backward preprocessing (the unit's fetch) runs once per process, not once per graph task",
          "DeepSpeed #7352 (PR #8135: 'preprocess/prologue is triggered only once across two backward calls')",
          "correctness", _preprocess_once_per_process),
    Fault("release_in_retained_window",
          "a release inside a keep-graph backward frees the data while the lifetime says it is kept "
          "(no deferral, no re-gather)",
          "DeepSpeed #7352 (PR #8045: 'tensor size mismatch on the second backward (0 vs 4)'), DeepSpeed #3539",
          "correctness", _release_in_retained_window),
    Fault("once_per_forward_flag",
          "a per-forward 'pre-backward ran' flag skips the unshard in a second backward over the same forward",
          "FSDP1 pre-backward flag: pytorch/pytorch #106637 (retain_graph with FSDP)",
          "correctness", _once_per_forward_flag),
    Fault("deferred_never_flushed",
          "deferred releases are never flushed (end of backward, new forward, rt.flush())",
          "DeepSpeed PR #8135 review: keeping parameters gathered after the first backward defeats ZeRO-3",
          "memory", _deferred_never_flushed),
    Fault("tied_reduced_twice",
          "a tied parameter's gradient is reduce-scattered once per holding unit",
          "fairscale PR #513 ('if it fires more than once, we incorrectly shard the grad multiple times'), "
          "DeepSpeed #684",
          "correctness", _tied_reduced_twice),
    Fault("release_before_last_holder",
          "a release drops every holder, so a shared parameter is freed while another unit still uses it",
          "DeepSpeed #7811 (assert not param.ds_active_sub_modules in free_param)",
          "correctness", _release_before_last_holder),
    Fault("abandoned_prefetch_left_inflight",
          "a prefetch the pass never used is not abandoned and stays gathered or in flight",
          "DeepSpeed #5828 ('still have inflight params'), fixed by DeepSpeed PR #6557",
          "memory", _abandoned_prefetch_left_inflight),
    Fault("no_grad_forward_left_gathered",
          "the post-forward release only runs when grad is enabled, so a no_grad forward leaves parameters gathered",
          "DeepSpeed PR #8130 review (parameters stay AVAILABLE when the block input needs no grad), DeepSpeed #3025",
          "memory", _no_grad_forward_left_gathered),
    Fault("grads_summed_not_averaged",
          "reduce-scatter sums gradients over ranks instead of averaging them",
          "facebookresearch/dinov3 PR #250 ('Average the gradients instead of sum')",
          "correctness", _grads_summed_not_averaged),
    Fault("deferred_reuse_regathers",
          "a fetch of a DEFERRED_RELEASE parameter flushes and re-gathers it (correct values, wasted all-gathers)",
          "DeepSpeed PR #8045 (defer release so the second backward reuses the gathered parameters), "
          "DeepSpeed #1069 (ZeRO-3 slowdown from redundant fetches)",
          "performance", _deferred_reuse_regathers),
    Fault("released_data_not_emptied",
          "a released parameter's .data is not emptied, so its full storage stays live",
          "DeepSpeed #3658 (param.data = torch.empty(0) but the memory is not returned)",
          "memory", _released_data_not_emptied),
    Fault("final_callback_once_per_process",
          "the end-of-backward callback is queued once per process, not once per backward",
          "fairscale PR #753 (final backward callback queued on the wrong backward call)",
          "correctness", _final_callback_once_per_process),
    Fault("retained_graph_drop_not_returned",
          "dropping a retained graph without a final backward never returns its deferred parameters",
          "DeepSpeed PR #8135 review (bound the retained window; no state leak beyond it)",
          "memory", _retained_graph_drop_not_returned),
    Fault("recompute_not_gathered",
          "activation-checkpoint recomputation inside backward does not gather the parameters it uses",
          "huggingface/transformers #47254 and DeepSpeed PR #8148 (recomputed metadata shape [0])",
          "correctness", _recompute_not_gathered),
    Fault("found_inf_not_agreed",
          "the loss scaler's found_inf stays local: only the rank owning an overflowed slice skips the step",
          "pytorch/pytorch PR #115710 ('when rank 0 have inf grad, rank 1...k should get found_inf=1'), "
          "the motivation of FSDP's ShardedGradScaler (pytorch/pytorch PR #76918)",
          "correctness", found_inf_not_agreed),
    Fault("unscaled_once_per_backward",
          "gradients are unscaled once per backward pass since the last step, so after a retained second "
          "backward they are divided by the scale twice",
          "DeepSpeed PR #7665 (a backward epilogue per backward call), Megatron-DeepSpeed PR #42 "
          "('grad accum double scaling bug')",
          "correctness", unscaled_once_per_backward),
    Fault("scale_not_backpropagated",
          "the loss scale is applied to a value that is not backpropagated: the unscaled loss is",
          "DeepSpeed PR #7793 ('Fix loss scaling and backward call of ZenFlow')",
          "correctness", scale_not_backpropagated),
    Fault("clip_without_clamp",
          "clip_grad_norm_ multiplies by max_norm / total without clamping at 1, scaling gradients up when the "
          "total norm is below max_norm",
          "GS-WGAN #5 ('it seems we need to add clip_coef = clip_coef.clamp(max=1.0)'), tinygrad PR #11761 "
          "('clamp GRAD_CLIP_NORM in llama'), pytorch/pytorch #151554",
          "correctness", clip_without_clamp),
    Fault("checkpoint_offset_unpadded",
          "a sharded checkpoint's slice offset is numel // world, not the padded shard size: the last rank's "
          "chunk runs past the parameter into the padding",
          "NVIDIA/Megatron-LM PR #5898 (a terminal shard extending past the unpadded size into bucket padding), "
          "NVIDIA/Megatron-LM PR #5077 (offsets that still include padding)",
          "correctness", checkpoint_offset_unpadded),
    Fault("retain_lost_in_higher_order",
          "a backward with retain_graph=True through recorded gradients (a gradient penalty) releases the units "
          "it fetches instead of deferring them, so the next backward over the graph gathers them again",
          "DeepSpeed PR #8045 ('Propagate retain_graph through the ZeRO backward path'), here on the "
          "create_graph path; paramfsm #28",
          "performance", retain_lost_in_higher_order),
    Fault("tied_aliases_compared_by_identity",
          "loading a full state dict refuses tied keys that hold equal values in distinct tensors (a state "
          "dict copied or converted key by key) as 'different values'",
          "fairscale #815 and pytorch/pytorch PR #86524 (shared parameters on loading a state dict); "
          "paramfsm #28",
          "correctness", tied_aliases_compared_by_identity),
    Fault("snapshot_accepted_anywhere",
          "trace replay accepts a snapshot record after a parameter's records, so a spliced trace hides a "
          "holder nobody released",
          "paramfsm #28 (trace check accepted a snapshot in the middle of a parameter's records)",
          "memory", snapshot_accepted_anywhere, spliced_snapshot_scenario),
    Fault("ring_window_forgets_idle",
          "a flight-recorder window snapshots only parameters with records in it, so a leak whose last record "
          "scrolled out of the ring is missing from the dump",
          "NVIDIA/nccl PR #2304 (a ring buffer that loses records silently); paramfsm #28",
          "memory", ring_window_forgets_idle, scrolled_leak_scenario),
    *(Fault(*entry) for entry in ROUTING),  # gradients missing on a rank, reads outside a unit
    *(Fault(*entry) for entry in ACCUMULATION),  # gradient accumulation and reshard_after_forward
    *(Fault(*entry) for entry in SHARD_WRITES),  # shard writes: optimizer steps, rt.gathered write-back
    *(Fault(*entry) for entry in REGRESSIONS),  # reentrant checkpointing inside a unit
    *(Fault(*entry) for entry in OFFLOAD),  # offload: page-in, write-back, a tier copy older than the step
    *(Fault(*entry) for entry in DEFAULT_UNITS),  # merged units, units kept for their backward
    *(Fault(*entry) for entry in STEPS),  # offloaded and whole-parameter steps, clipping, refused shard()
    *(Fault(*entry) for entry in COMPUTE),  # a batch norm under param_dtype, a compiler reading gradients
)

FAULTS: dict[str, Fault] = {fault.name: fault for fault in CATALOGUE}


def inject(name: str) -> Fault:
    """Activate the named fault for the rest of the process (for reproduction scripts)."""
    manager = activate(name)
    fault = manager.__enter__()
    _INJECTED.append(manager)
    return fault


_INJECTED: list = []  # managers of faults injected for the rest of the process


@contextlib.contextmanager
def activate(name: str | None) -> Iterator[Fault | None]:
    """Inject the named fault for the duration of the block (no-op for None)."""
    if name is None:
        yield None
        return
    try:
        fault = FAULTS[name]
    except KeyError:
        raise KeyError(f"unknown fault {name!r}; known: {', '.join(FAULTS)}") from None
    with fault.inject():
        yield fault
