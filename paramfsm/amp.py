"""Loss scaling for sharded models: ``torch.amp.GradScaler`` with the overflow check agreed across ranks.

A gradient scaler skips the optimizer step when any gradient overflowed
(``found_inf``) and then shrinks the scale. With sharded gradients each rank
checks only its own slices: an inf in rank 1's slice of one gradient is
invisible to rank 0, so rank 1 would skip the step and rank 0 would take it,
and the shards (and the scales) would silently drift apart.
:class:`GradScaler` is ``torch.amp.GradScaler`` with one change: after
unscaling, the ranks take the maximum of their ``found_inf`` flags (one small
all-reduce per optimizer per step), so every rank makes the same skip
decision and the same scale update. Everything else is torch's: the recipe
is unchanged, and so is the backward (the scaled loss is what is
backpropagated, through ``loss.backward()`` or ``rt.backward``; there is no
separate entry point to forget)::

    scaler = paramfsm.amp.GradScaler(rt)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)                 # shard gradients, unscaled; found_inf agreed
    rt.clip_grad_norm_(1.0)              # clip after unscaling, as in torch's AMP recipe
    scaler.step(opt); scaler.update()

A plain ``torch.amp.GradScaler`` stepping an optimizer of a sharded model is
refused at ``scaler.step`` (see :mod:`paramfsm.optim`) rather than left to
diverge.
"""

from __future__ import annotations

import torch

from paramfsm import optim
from paramfsm.sharding import accumulation, full_state


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose ``found_inf`` is the same on every rank of ``rt``'s group.

    ``rt``: the runtime of the sharded model the optimizers step. Other
    arguments are ``torch.amp.GradScaler``'s (``init_scale``,
    ``growth_factor``, ``backoff_factor``, ``growth_interval``, ``enabled``);
    ``device`` defaults to the type of the model's device.
    """

    #: Read by paramfsm.optim's step check: this scaler's skip decisions agree across ranks.
    agrees_across_ranks = True

    def __init__(self, rt, device: str | None = None, **kwargs):
        if device is None:
            shards = rt.shard_parameters()
            device = shards[0].device.type if shards else "cpu"
        super().__init__(device, **kwargs)
        self.rt = rt

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        optim.map_optimizer(optimizer)  # unscale the shard gradients, never the placeholders
        accumulation.require_synced(self.rt, "GradScaler.unscale_()")
        with optim.shards_in_groups(optimizer):  # a whole-parameter optimizer holds the parameters
            per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        rt = self.rt
        if rt.world > 1:
            agreed = torch.zeros((), dtype=torch.float32, device=found_inf.device)
            for flag in per_device.values():
                agreed += flag.to(agreed.device)
            agreed = full_state.all_reduce(rt, agreed.reshape(1), "max", full_state.REDUCTIONS[1])[0]
            for flag in per_device.values():
                flag.copy_(agreed)
            per_device.setdefault(agreed.device, agreed)
        return per_device
