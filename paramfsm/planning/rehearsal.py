"""A rehearsal of one training step on rank 0 of a fake process group, with meta tensors: what a memory plan measures.

[Note: the plan is a rehearsal, not a second model of the runtime]
Which bytes paramfsm holds at any moment is which parameters are in which
state of the spec (a gathered full parameter while AVAILABLE, its all-gather
buffer while INFLIGHT, a kept copy while DEFERRED_RELEASE), plus the shard
gradients, the optimizer state and the gradients on their way to a
reduce-scatter. A plan that modelled those rules a second time would drift
from them. So :func:`rehearse` runs the real thing: ``paramfsm.shard`` of a
model built on the meta device, on rank 0 of torch's fake process group of
``world_size`` ranks (its collectives complete at once and move nothing),
with the shards on the meta device too. The real hooks emit the real events,
the real scheduler steps the spec's machines and the real executor issues
its gathers and reduce-scatters, over tensors that have a size and no
storage: nothing is allocated, so a 70B model plans on a laptop.

The runtime counts what it holds from the states (:func:`paramfsm.sharding.memory.memory`,
the figures ``rt.memory()`` reports). The rehearsal puts a :class:`~paramfsm.planning.sampler.Sampler`
where the runtime's trace sits: every transition the FSM takes calls it, and
it adds up the bytes held right then, by kind, keeping each phase's largest
total with the unit and the event that reached it. A meta tensor carries no
values, so the one place the engine reads gradient values (whether any rank
produced a gradient, ``grad_flags``) takes every rank to have one, as in a
step where every parameter is used.

What the rehearsal runs: ``shard()`` and ``rt.init_weights()`` (phase
``init``: the init streams module by module), a forward of the example
input (``forward``), a backward of the sum of its floating-point outputs
(``backward``), the optimizer's own step on the meta shards (``step``: its
state is the optimizer's, created by its first step), and what a checkpoint
save holds on top of that (``checkpoint``).
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist
from torch import nn

from paramfsm.sharding import meta
from paramfsm.errors import ParamFSMError
from paramfsm.planning.sampler import KINDS, PHASES, TIER_KINDS, Sampler, optimizer_state_bytes  # noqa: F401

@contextlib.contextmanager
def fake_world(world_size: int) -> Iterator[None]:
    """torch's fake process group of ``world_size`` ranks, this process rank 0, for the block.

    Only where no process group is initialised: a plan asked for inside a job runs in a child process
    (:func:`paramfsm.planning.plan`).
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def tensors_of(tree) -> list[torch.Tensor]:
    """The floating-point tensors of a model's output, whatever holds them (a tensor, a tuple, a dict, a
    ``ModelOutput``)."""
    if isinstance(tree, torch.Tensor):
        return [tree] if tree.is_floating_point() else []
    if isinstance(tree, dict):
        tree = list(tree.values())
    elif hasattr(tree, "to_tuple"):
        tree = tree.to_tuple()
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in tensors_of(item)]
    return []


@contextlib.contextmanager
def saved_activation_bytes(found: list) -> Iterator[None]:
    """Within the block, ``found[0]`` adds up the bytes autograd saves for backward that are not parameters:
    the activations, which are the model's and not the runtime's (a plan shows them on their own line)."""
    seen: set[int] = set()

    def pack(tensor):
        base = tensor._base if tensor._is_view() else tensor
        if not isinstance(base, nn.Parameter) and not isinstance(tensor, nn.Parameter) and id(base) not in seen:
            seen.add(id(base))
            found[0] += base.numel() * base.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield


def rehearse(model: nn.Module, world_size: int, example_input, build_optimizer, state_bytes_per_element,
             shard_options: dict, async_save: bool) -> dict:
    """Run one step of ``model`` (built on the meta device) sharded over ``world_size`` fake ranks; returns
    ``{"peaks": {phase: (total, by kind, unit, event)}, "activations": bytes or None, "gathered_bytes",
    "reduced_bytes", "units": n}``.

    ``build_optimizer(params)`` builds the optimizer to rehearse, or None; then ``state_bytes_per_element``
    (bytes of optimizer state per shard element) stands for its state.
    """
    import paramfsm

    if any(not p.is_meta for p in model.parameters()):
        raise ParamFSMError("paramfsm.plan: the model must be built on the meta device (with "
                            "torch.device('meta'): model = build()), so that planning allocates nothing")
    with fake_world(world_size), meta.rehearsing():
        if shard_options.get("mesh") is not None:  # a hybrid mesh's shape: (replicas, shards)
            from torch.distributed.device_mesh import init_device_mesh

            shard_options = dict(shard_options, mesh=init_device_mesh("cpu", tuple(shard_options["mesh"])))
        rt = paramfsm.shard(model, device="meta", trace=0, **shard_options)  # no flight recorder: nothing to dump
        try:
            return _steps(rt, model, example_input, build_optimizer, state_bytes_per_element, async_save)
        finally:
            rt.detach()


#: Steps rehearsed: the first records the unit order, from which the second prefetches (the steady state).
STEPS = 2


def _steps(rt, model, example_input, build_optimizer, state_bytes_per_element, async_save) -> dict:
    meta.assume_values(rt)
    records = list(rt._by_id.values())
    shard_elements = sum(rec.shard.numel() for rec in records)
    shard_bytes = sum(rec.shard.numel() * rec.shard.element_size() for rec in records)
    extra = {"optimizer_state": 0, "checkpoint_staging": 0}  # state given per element; a save's staged copy
    optimizer = None
    ctx = rt.ctx
    sampler = Sampler(rt, ctx.trace, lambda: extra)
    ctx.trace = sampler
    rt.init_weights(lambda module: None)  # streams module by module, as a real init does
    sampler.sample("", "init end")
    if build_optimizer is not None:
        optimizer = sampler.optimizer = build_optimizer(list(rt.shard_parameters()))
    activations = [0]
    before = dict(rt.counters)
    for _ in range(STEPS):
        before, tier_before = dict(rt.counters), _tier_traffic(rt)
        if example_input is not None:
            _forward_backward(sampler, model, example_input, activations)
        sampler.phase = "step"
        if optimizer is not None:
            for rec in records:  # a plan without a backward still steps every shard (its state is created)
                if rec.shard.grad is None:
                    rec.shard.grad = torch.empty_like(rec.shard)
            optimizer.step()
        else:
            extra["optimizer_state"] = int(state_bytes_per_element * shard_elements)
        sampler.sample("", "optimizer step")
        sampler.phase = "checkpoint"
        if async_save:  # a staged copy of the shards and the optimizer state while the save writes
            extra["checkpoint_staging"] = shard_bytes + (
                optimizer_state_bytes(optimizer, resident=False) if optimizer is not None else extra["optimizer_state"])
        sampler.sample("", "checkpoint save")
        extra["checkpoint_staging"] = 0
        if optimizer is not None:
            optimizer.zero_grad()
    ctx.trace = sampler.trace
    after = rt.counters
    return {"peaks": dict(sampler.peaks), "activations": activations[0] if example_input is not None else None,
            "gathered_bytes": after["gathered_bytes"] - before["gathered_bytes"],
            "reduced_bytes": after["reduced_bytes"] - before["reduced_bytes"],
            "units": len(rt.units), "shard_bytes": shard_bytes,
            "tier_bytes": _tier_traffic(rt) - tier_before}


def _tier_traffic(rt) -> int:
    """Bytes read from and written to the offload tiers so far (0 without offload)."""
    plan = getattr(rt, "offload", None)
    return 0 if plan is None else sum(plan.traffic().values())


def _forward_backward(sampler, model, example_input, activations: list) -> None:
    """A forward of the example input (its saved activations counted), then a backward of its outputs."""
    sampler.phase = "forward"
    inputs = example_input() if callable(example_input) else example_input
    # A real batch (on the host or a device) is rehearsed as its meta twin: the model's twin is on meta.
    inputs = torch.utils._pytree.tree_map(
        lambda value: value.to("meta") if isinstance(value, torch.Tensor) else value, inputs)
    found = [0]
    with saved_activation_bytes(found):
        if isinstance(inputs, dict):
            out = model(**inputs)
        else:
            out = model(*inputs) if isinstance(inputs, tuple) else model(inputs)
    activations[0] = max(activations[0], found[0])
    sampler.sample("", "forward end")
    sampler.phase = "backward"
    parts = tensors_of(out)
    if not parts:
        raise ParamFSMError("paramfsm.plan: the model's output on the example input has no floating-point tensor "
                            "to run a backward from")
    torch.stack([t.float().mean() for t in parts]).sum().backward()
    sampler.sample("", "backward end")
