"""A model's meta twin: the same modules and parameter shapes on the meta device, for a plan to rehearse on.

A plan never touches the user's model: it shards a copy (:mod:`paramfsm.planning.rehearsal`), and a copy of
real tensors would allocate the model a second time. ``copy.deepcopy`` takes a ``memo`` of objects already
copied; seeding it with a meta stand-in for every parameter and buffer makes the copy share nothing and
allocate nothing.
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import torch
from torch import nn

#: The dictionaries in which ``nn.Module`` keeps hooks.
HOOK_DICTS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
              "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_state_dict_hooks",
              "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def meta_twin(model: nn.Module, shapes: dict | None = None, strip_hooks: bool = False) -> nn.Module:
    """``model``'s modules on the meta device.

    ``shapes``: ``id(parameter) -> (shape, dtype)`` for parameters whose tensor is not their shape (a sharded
    model's placeholders). ``strip_hooks``: the twin keeps no hook and no per-instance attribute a runtime set
    (a sharded model's, so that the twin drives nothing of the live runtime).
    """
    memo: dict = {}
    shapes = shapes or {}
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and id(param) not in memo:
                shape, dtype = shapes.get(id(param), (param.shape, param.dtype))
                memo[id(param)] = nn.Parameter(torch.empty(shape, dtype=dtype, device="meta"),
                                               requires_grad=param.requires_grad)
        for name, buf in module._buffers.items():
            if buf is not None and id(buf) not in memo:
                memo[id(buf)] = torch.empty_like(buf, device="meta")
        if strip_hooks:
            for name in HOOK_DICTS:
                hooks = module.__dict__.get(name)
                if hooks is not None:
                    memo[id(hooks)] = OrderedDict()
            if "_apply" in module.__dict__:  # a runtime's checked _apply (paramfsm.sharding.conversions), bound to it
                memo[id(module.__dict__["_apply"])] = None
    twin = copy.deepcopy(model, memo)
    if strip_hooks:
        for module in twin.modules():
            if module.__dict__.get("_apply", 0) is None:
                del module.__dict__["_apply"]
    return twin
