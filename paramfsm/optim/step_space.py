"""Disk space for the optimizer state a step creates, reserved before any unit steps, agreed across ranks.

[Note: a first step that cannot finish changes nothing]
torch optimizers create their state (Adam's moments, SGD's momentum buffer)
inside the first ``step()`` that sees a parameter. Under
``Offload(optimizer="disk")`` that state is paged out unit by unit as the
step goes (:mod:`paramfsm.optim.offload_step`), and its tier space was reserved
then: a full disk raised after some units had already stepped, leaving
parameters neither as they were nor one step on, state created for some
parameters and never placed (every later step failed on it), and the other
ranks, whose disks had room, one step ahead. So before any unit steps,
:func:`reserve_new_state` works out the bytes of the state this step will
create and reserves them in each disk tier, and the ranks agree on the
outcome: when any rank cannot, every rank raises the same
:class:`~paramfsm.errors.OffloadError` and nothing has changed, so the step
can simply be called again once there is room.

The bytes come from the optimizer itself: an optimizer of the same class and
the same group options steps a two-element probe parameter, and each state
tensor it creates either has the probe's size (it scales with the parameter:
a moment) or not (a fixed size, kept as is). Steps that create no state (all
but the first, for a fixed set of trainable parameters) reserve nothing and
exchange nothing: whether a step creates state is the same on every rank.
An optimizer that cannot be probed this way is stepped as before, without
the reservation.
"""

from __future__ import annotations

import logging

import torch

from paramfsm.sharding import rank_errors
from paramfsm.engine.storage.tiers import ALIGN
from paramfsm.errors import OffloadError

logger = logging.getLogger(__name__)

_PROBE = 2  # elements of the probe parameter: a state of its size scales with the parameter


def reserve_new_state(optimizer, writers) -> None:
    """Reserve the disk-tier bytes of the state this step of ``optimizer`` creates (module docstring).

    ``writers``: ``(scheduler, records)`` of each offloading runtime whose shards ``optimizer`` steps.
    Collective over each runtime's group when, and only when, the step creates state.
    """
    needs = _new_state_bytes(optimizer, writers)
    if needs is None:
        return
    error = None
    try:
        for tier, (nbytes, owner) in needs.items():
            tier.reserve(nbytes, owner)
    except OffloadError as exc:
        error = str(exc)
    for scheduler, _ in writers:
        _agree(scheduler.executor.group, error)


def _new_state_bytes(optimizer, writers) -> dict | None:
    """Disk tier -> (bytes, first owner) of the state this step creates; None when it creates none."""
    group_of = {id(p): i for i, group in enumerate(optimizer.param_groups) for p in group["params"]}
    fresh = False
    needs: dict = {}
    layouts: dict = {}
    for scheduler, records in writers:
        units = scheduler.offload_plan.optimizer_units
        wanted = set(records)
        for unit in scheduler.units:
            pager = units.get(unit.name)
            for rec in unit.records:
                if rec not in wanted or optimizer.state.get(rec.shard) or id(rec.shard) not in group_of:
                    continue
                if rec.shard.grad is None:  # torch steps (and gives state to) parameters with a gradient only
                    continue
                fresh = True
                if pager is None or not hasattr(pager.tier, "reserve"):
                    continue
                key = (group_of[id(rec.shard)], rec.shard.dtype, rec.shard.device)
                if key not in layouts:
                    layouts[key] = _layout(optimizer, *key)
                if layouts[key] is None:
                    return None
                nbytes, owner = needs.get(pager.tier, (0, rec.name))
                needs[pager.tier] = (nbytes + _bytes(layouts[key], rec.shard.numel()), owner)
    return needs if fresh and needs else None  # the same on every rank: no exchange for a step without any


def _bytes(layout, numel: int) -> int:
    """A parameter's state bytes in a disk tier: each tensor its own aligned slot."""
    total = 0
    for scales, size, element in layout:
        total += -(-((numel if scales else size) * element) // ALIGN) * ALIGN
    return total


def _layout(optimizer, group_index: int, dtype, device):
    """``(scales with the parameter, elements, element size)`` of each state tensor of a fresh parameter."""
    options = {k: v for k, v in optimizer.param_groups[group_index].items() if k != "params"}
    probe_param = torch.zeros(_PROBE, dtype=dtype, device=device, requires_grad=True)
    probe_param.grad = torch.zeros_like(probe_param)
    try:
        probe = type(optimizer)([{"params": [probe_param], **options}])
        bare_step(probe)()
    except Exception as exc:  # noqa: BLE001 - an optimizer we cannot probe is stepped without the reservation
        logger.debug("cannot probe %s for its state layout: %s", type(optimizer).__name__, exc)
        return None
    return [(t.numel() == _PROBE, t.numel(), t.element_size())
            for t in probe.state[probe_param].values() if isinstance(t, torch.Tensor) and t.dim() > 0]


def bare_step(optimizer):
    """``optimizer``'s own step function, bound, without torch's hook-running wrapper
    (``Optimizer._patch_step_function``): no step hook runs."""
    step = type(optimizer).step
    if getattr(step, "hooked", False):
        step = step.__wrapped__
    return step.__get__(optimizer)


def _agree(group, error: str | None) -> None:
    """Raise OffloadError on every rank of ``group`` when any rank has an error (the lowest such rank's)."""
    found = rank_errors.agree(group, error)
    if found is not None:
        raise OffloadError(f"{found[1]} Nothing was stepped on any rank: the parameters and the optimizer state "
                           "are as they were before this step, and the step can be called again once there is "
                           "room.")
