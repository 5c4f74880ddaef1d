"""``paramfsm.plan``: whether a configuration fits, per rank and per phase, before anything is launched.

The plan rehearses a training step of the model's meta twin on rank 0 of a fake process group (see [Note: the
plan is a rehearsal, not a second model of the runtime] in :mod:`paramfsm.planning.rehearsal`): the same
``shard()``, hooks, scheduler, spec and executor as training, over tensors with no storage. Nothing is
allocated, so a 70B model plans in seconds on a laptop.

Inside a job (a process group already initialised) the rehearsal needs a process group of its own, so it
runs in a child process; elsewhere it runs in this one.
"""

from __future__ import annotations

import pickle
import subprocess
import sys

import attrs
import torch
import torch.distributed as dist
from torch import nn

from paramfsm.errors import ArgumentError, ParamFSMError
from paramfsm.sharding.rank_errors import agreed
from paramfsm.planning import budget as budget_search
from paramfsm.planning.report import Plan, PhasePeak, parse_bytes, size
from paramfsm.planning.twin import meta_twin

__all__ = ["plan", "plan_runtime", "refuse_over_budget", "Plan", "PhasePeak", "parse_bytes"]

#: Optimizer kinds a plan rehearses by name: each builds the optimizer over the meta shards, whose first step
#: creates its state as it would in training.
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params),
    "adamw": lambda params: torch.optim.AdamW(params),
    "adafactor": lambda params: torch.optim.Adafactor(params),
}
#: ``shard()`` options a plan rehearses as given.
PLANNED = ("units", "min_unit_bytes", "prefetch", "bucket_bytes", "reshard_after_forward", "retain",
           "max_deferred_bytes", "param_dtype", "reduce_dtype", "offload", "mesh")
#: ``shard()`` options a plan does not rehearse yet (a plan with one of them set is refused, not approximated).
NOT_PLANNED = ("group",)


def plan(model: nn.Module, world_size: int | None = None, *, optimizer="adamw", example_input=None,
         activations=None, budget=None, async_save: bool = False, **options) -> Plan:
    """The memory plan of ``model`` sharded over ``world_size`` ranks with ``shard()``'s ``options``.

    ``model``: any model (its meta twin is rehearsed; nothing of it is changed or copied in memory), best
    built on the meta device. ``world_size``: the ranks (default: the current process group's).
    ``optimizer``: ``"sgd"`` (with momentum), ``"adam"``, ``"adamw"``, ``"adafactor"``, a function that builds
    one from parameters, a number (bytes of state per shard element) or None. ``example_input``: what the
    model takes (a tensor, a tuple of positional or a dict of keyword arguments, on the meta device, or a
    function returning one); a Hugging Face model gets ``input_ids`` of shape (1, 128) when it is None, and
    a model whose first layer is a ``Linear`` or an ``Embedding`` a batch of one for it (the activations line
    says so). Without one, or when the model does not take the guess, only ``init``, ``step`` and
    ``checkpoint`` are rehearsed. ``activations``: bytes, or a size
    string, the model's own activations per rank (default: those saved for backward on the example input).
    ``budget``: bytes per rank (or ``"20GiB"``); the plan says whether it fits, and when it does not, the least
    costly placement that does (``plan.placement``, :mod:`paramfsm.planning.budget`). ``async_save``: the checkpoint
    phase holds a staged copy (``paramfsm.checkpoint.save(..., async_save=True)``).
    """
    for name in options:
        if name in NOT_PLANNED and options[name] is not None:
            raise ParamFSMError(f"paramfsm.plan({name}=...): a plan does not rehearse {name}= yet, and it would "
                                f"not guess. What to do: plan without it (the figures then hold every value in "
                                f"working memory, an upper bound), or measure a step with rt.memory().")
        if name not in PLANNED and name not in NOT_PLANNED:
            raise ArgumentError(f"paramfsm.plan: unknown option {name}=; it takes shard()'s options {PLANNED}")
    if world_size is None:
        if not dist.is_initialized():
            raise ArgumentError("paramfsm.plan: pass world_size= (no process group is initialised to take it from)")
        world_size = dist.get_world_size()
    if not isinstance(world_size, int) or world_size < 1:
        raise ArgumentError(f"paramfsm.plan(world_size={world_size!r}): a positive number of ranks")
    if options.get("mesh") is not None:  # a DeviceMesh, or its shape (replicas, shards): rehearsed as a shape
        shape = tuple(getattr(options["mesh"], "shape", options["mesh"]))
        if len(shape) != 2 or shape[0] * shape[1] != world_size:
            raise ArgumentError(f"paramfsm.plan(mesh={options['mesh']!r}): a 2-D mesh (replicas, shards) of "
                                f"world_size={world_size} ranks")
        options = dict(options, mesh=shape)
    budget_bytes = None if budget is None else parse_bytes(budget)
    given = None if activations is None else parse_bytes(activations)
    name, build, per_element = _optimizer(optimizer)
    guessed = example_input is None and _hf_input(model) is None
    if example_input is None:
        example_input = _hf_input(model) or _first_layer_input(model)
    planned = {k: v for k, v in options.items() if k in PLANNED}

    def rehearsed(extra: dict) -> Plan:
        nonlocal example_input
        job = (meta_twin(model), world_size, example_input, name, per_element, {**planned, **extra}, async_save)
        try:
            found = _in_child(job) if dist.is_initialized() else _rehearse(job, build)
        except Exception:  # noqa: BLE001 - a guessed input the model does not take: plan without a forward
            if not guessed or example_input is None:
                raise
            example_input = None
            return rehearsed(extra)
        measured = found["activations"]
        phases = tuple(PhasePeak(phase, *found["peaks"][phase]) for phase in
                       ("init", "forward", "backward", "step", "checkpoint") if phase in found["peaks"])
        source = ("given" if given is not None else
                  f"saved for backward on a guessed input of shape {tuple(example_input.shape)}: pass "
                  "example_input= or activations= for your batch" if guessed and measured is not None else
                  "saved for backward on the example input" if measured is not None else
                  "not counted: pass activations= or example_input=")
        notes = () if example_input is not None else (
            "forward and backward were not rehearsed: pass example_input= (what the model takes, on the meta "
            "device)",)
        return Plan(world_size, phases, given if given is not None else measured, source, found["gathered_bytes"],
                    found["reduced_bytes"], found["tier_bytes"], found["units"], name, {**options, **extra},
                    budget_bytes, notes)

    result = rehearsed({})
    if budget_bytes is not None and result.peak > budget_bytes:
        found = budget_search.search(rehearsed, planned, budget_bytes)
        result = attrs.evolve(result, placement=found,
                              notes=result.notes + (_advice(result), budget_search.describe(found, result)))
    return result


def refuse_over_budget(model: nn.Module, budget, group, options: dict) -> None:
    """``shard(..., memory_budget=budget)``: raise, before anything changes, when the plan of ``model`` with
    ``options`` over ``group``'s ranks exceeds ``budget`` (every rank plans alike, so every rank raises)."""
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    with agreed(group, "paramfsm.shard(memory_budget=...)'s plan"):  # a child that fails on one rank only
        result = plan(model, world, budget=budget,
                      **{k: v for k, v in options.items() if v is not None or k in PLANNED})
    if not result.fits(result.budget):
        unrehearsed = "" if any(p.phase == "backward" for p in result.phases) else (
            " (forward and backward were not rehearsed: shard() has no example input for this model; "
            "paramfsm.plan(model, example_input=...) plans them)")
        raise ParamFSMError(f"paramfsm.shard(memory_budget={size(result.budget)}): the memory plan's peak is "
                            f"{size(result.peak)} per rank in {result.peak_phase}, {size(result.peak - result.budget)} "
                            f"over{unrehearsed}; nothing was changed. {_advice(result)}\n{result}")


def plan_runtime(rt, **kwargs) -> Plan:
    """``rt.plan()``: the plan of a live runtime's model, rehearsed on a meta twin of it (its partitioned
    parameters at their full shapes, without the runtime's hooks)."""
    shapes = {id(rec.param): (tuple(rec.shape), rec.shard.dtype) for rec in rt._by_id.values()}
    twin = meta_twin(rt.model, shapes, strip_hooks=True)
    options = {k: v for k, v in rt._planned.items() if v is not None or k in PLANNED}
    return plan(twin, rt.world * (getattr(rt, "replicas", 1) or 1), **kwargs, **options)


def _advice(result: Plan) -> str:
    """What would take the peak under the budget, from the kinds at the peak."""
    peak = max(result.phases, key=result.with_activations)
    biggest = sorted(((v, k) for k, v in peak.kinds.items() if v), reverse=True)[:3]
    over = result.peak - (result.budget or 0)
    held = ", ".join(f"{kind} {size(value)}" for value, kind in biggest)
    return (f"What to do: the {peak.phase} peak is {size(result.peak)}, {size(over)} over; its largest parts are "
            f"{held}. More ranks divide shards, shard gradients and optimizer state; paramfsm.Offload(optimizer="
            f"'cpu', grads='cpu') moves those two off this memory; a smaller batch shrinks the activations.")


def _optimizer(optimizer):
    """(name, builder or None, state bytes per shard element or None)."""
    if optimizer is None:
        return "none", None, 0
    if isinstance(optimizer, str):
        key = optimizer.lower()
        if key not in OPTIMIZERS:
            raise ArgumentError(f"paramfsm.plan(optimizer={optimizer!r}): one of {sorted(OPTIMIZERS)}, a function "
                                "that builds an optimizer from parameters, a number of bytes per element, or None")
        return key, OPTIMIZERS[key], None
    if callable(optimizer):
        return getattr(optimizer, "__name__", "custom"), optimizer, None
    if isinstance(optimizer, (int, float)) and optimizer >= 0:
        return f"{optimizer:g} bytes per element", None, float(optimizer)
    raise ArgumentError(f"paramfsm.plan(optimizer={optimizer!r}): a name, a function, a number or None")


def _hf_input(model: nn.Module):
    """``input_ids`` of shape (1, 128) on the meta device for a Hugging Face causal or masked LM, else None."""
    config = getattr(model, "config", None)
    if config is None or not getattr(config, "vocab_size", None):
        return None
    length = min(128, getattr(config, "max_position_embeddings", 128) or 128)
    return {"input_ids": torch.zeros(1, length, dtype=torch.long, device="meta")}


def _first_layer_input(model: nn.Module):
    """A batch of one for the first module holding parameters, when it is a ``Linear`` (its features) or an
    ``Embedding`` (16 indices), on the meta device; else None. A guess: a model that does not take it is
    planned without a forward (see :func:`plan`)."""
    first = next((m for m in model.modules() if next(m.parameters(recurse=False), None) is not None), None)
    if isinstance(first, nn.Linear):
        return torch.empty(1, first.in_features, dtype=first.weight.dtype, device="meta")
    if isinstance(first, nn.Embedding):
        return torch.zeros(1, 16, dtype=torch.long, device="meta")
    return None


def _rehearse(job, build=None) -> dict:
    from paramfsm.planning.rehearsal import rehearse

    twin, world_size, example_input, name, per_element, options, async_save = job
    if build is None and name in OPTIMIZERS:
        build = OPTIMIZERS[name]
    return rehearse(twin, world_size, example_input, build, per_element, options, async_save)


def serve() -> None:
    """The child's side of :func:`_in_child`: a pickled job on stdin, ``("ok", found)`` or ``("error", text)``
    pickled on stdout."""
    job = pickle.loads(sys.stdin.buffer.read())
    try:
        answer = ("ok", _rehearse(job))
    except BaseException as exc:  # noqa: BLE001 - sent to the parent, which raises it
        answer = ("error", f"{type(exc).__name__}: {exc}")
    sys.stdout.buffer.write(pickle.dumps(answer))


def _in_child(job) -> dict:
    """The rehearsal in a child process (this one's process group is taken, and a rank of a pool or of
    torchrun may not fork helpers of its own): the model's twin goes by pickle over a pipe."""
    if job[3] not in OPTIMIZERS and job[4] is None and job[3] != "none":
        raise ParamFSMError("paramfsm.plan inside a job: the plan runs in a child process, so pass optimizer= by "
                            "name or as a number of bytes per element, not as a function")
    done = subprocess.run([sys.executable, "-c", "from paramfsm.planning import serve; serve()"],
                          input=pickle.dumps(job), capture_output=True, check=False)
    try:
        status, found = pickle.loads(done.stdout)
    except Exception:  # noqa: BLE001 - no answer: what it printed says why
        raise ParamFSMError(f"paramfsm.plan: the planning process ended without a plan (exit code "
                            f"{done.returncode}): {done.stderr.decode(errors='replace')[-2000:]}") from None
    if status != "ok":
        raise ParamFSMError(f"paramfsm.plan: the rehearsal failed: {found}")
    return found
