"""The fault catalogue's loss-scaling, clipping and checkpoint bugs (:data:`paramfsm.verify.faults.CATALOGUE`).

Each function returns the context manager that injects one bug by patching
``paramfsm.amp.GradScaler``, ``paramfsm.optim.grad_norm.clip_grad_norm_`` or
``paramfsm.checkpoint.layout.valid_range`` (the shard range both layouts save) for the duration of the block; the
catalogue entries in :mod:`paramfsm.verify.faults` name each bug's source.
"""

from __future__ import annotations

import contextlib
import math

import torch

from paramfsm import amp, optim
from paramfsm.optim import grad_norm
from paramfsm.checkpoint import layout as checkpoint_layout
from paramfsm.verify.faults.patching import patched


def found_inf_not_agreed():
    def make(original):
        def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
            optim.map_optimizer(optimizer)
            return torch.amp.GradScaler._unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16)
        return _unscale_grads_
    return patched(amp.GradScaler, "_unscale_grads_", make)


def unscaled_once_per_backward():
    scaled: list = []  # losses scaled since the last unscale: one per backward pass

    @contextlib.contextmanager
    def both():
        def scale(original):
            def scale_(self, outputs):
                scaled.append(None)
                return original(self, outputs)
            return scale_

        def unscale(original):
            def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
                passes = max(len(scaled), 1)
                scaled.clear()
                return original(self, optimizer, inv_scale.pow(passes), found_inf, allow_fp16)
            return _unscale_grads_
        with patched(amp.GradScaler, "scale", scale), patched(amp.GradScaler, "_unscale_grads_", unscale):
            yield
    return both()


def scale_not_backpropagated():
    def make(original):
        def scale(self, outputs):
            original(self, outputs)  # the scaled loss is computed, and dropped
            return outputs
        return scale
    return patched(amp.GradScaler, "scale", make)


def clip_without_clamp():
    def make(original):
        def clip_grad_norm_(shards, max_norm, norm_type=2.0, **kwargs):
            total = original(shards, math.inf, norm_type, **kwargs)  # the norm, nothing scaled
            coef = max_norm / (total + 1e-6)  # not clamped at 1: a norm below max_norm scales gradients up
            for shard in shards:
                if shard.grad is not None:
                    shard.grad.detach().mul_(coef.to(shard.grad.dtype))
            return total
        return clip_grad_norm_
    return patched(grad_norm, "clip_grad_norm_", make)


def checkpoint_offset_unpadded():
    def make(original):
        def valid_range(rt, rec):
            start = min(rt.rank * (rec.numel // rt.world), rec.numel)  # not the padded shard size
            return start, min(start + rec.shard_numel, rec.numel)
        return valid_range
    return patched(checkpoint_layout, "valid_range", make)
