"""``torch.nn`` modules that cannot work on sharded parameters, refused at ``shard`` with a clear error.

A module whose forward writes its own parameter in place would write into
the gathered copy, which is freed after the unit, so the write is lost; and
each rank would write from its own batch only. A lazy module's parameters have
no shape before its first forward, so there is nothing to partition yet. The
README lists these modules.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.parameter import UninitializedParameter

from paramfsm.errors import ParamFSMError


def refuse_unsupported(model: nn.Module) -> None:
    """Raise :class:`ParamFSMError` naming the first module of ``model`` paramfsm cannot shard correctly."""
    for name, module in model.named_modules():
        lazy = next((n for n, p in module.named_parameters(recurse=False) if isinstance(p, UninitializedParameter)),
                    None)
        if lazy is not None:
            qualified = f"{name}.{lazy}" if name else lazy
            raise ParamFSMError(
                f"parameter '{qualified}' of module '{name or '<root>'}' ({type(module).__name__}) is not "
                "initialised yet: a lazy module learns its shapes at its first forward, so there is nothing to "
                "partition (event 'shard', before any state). What to do: run one forward of the model on a real "
                "batch before paramfsm.shard, or build the module with its sizes (nn.Linear(in_features, "
                "out_features) instead of nn.LazyLinear).")
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.max_norm is not None:
            raise ParamFSMError(
                f"module '{name or '<root>'}' is {type(module).__name__}(max_norm={module.max_norm}): its forward "
                "renormalises the rows it looks up in place, in the weight itself. Under paramfsm the forward "
                "sees a gathered copy that is freed after the unit, so the renorm would be lost, and each rank "
                "would renormalise only the rows of its own batch: the result would silently differ from plain "
                "torch. What to do: build the module without max_norm (normalise its output instead, e.g. "
                "F.normalize), or keep it out of the sharded model.")


def refuse_transforms(records, rank: int) -> None:
    """Raise :class:`ParamFSMError` when a ``torch.func`` transform runs the sharded model (root forward).

    [Note: torch.func through a sharded model]
    ``grad``, ``vmap``, ``jacrev`` and ``jvp`` run the forward under functorch
    interpreters that wrap every tensor and differentiate without autograd's
    engine: paramfsm's gradient routing (an ``autograd.Function`` with no vmap
    rule), its post-backward callbacks (queued on the engine) and its hooks on
    ``AccumulateGrad`` never run there, and ``functional_call`` swaps wrapped
    tensors in for the partitioned parameters. The transform failed inside
    paramfsm, or reported the parameters as replaced. So a root forward under a
    transform is refused before anything is gathered.
    """
    if torch._C._functorch.peek_interpreter_stack() is None:
        return
    rec = next(iter(records), None)
    name, unit, state = (rec.name, rec.unit, rec.state.name) if rec is not None else ("?", "?", "?")
    raise ParamFSMError(
        f"a torch.func transform (grad, vmap, jacrev, jvp, ...) ran the model sharded by paramfsm on rank {rank} "
        f"(event 'forward' of the root; its first parameter '{name}', module "
        f"'{name.rpartition('.')[0] or '<root>'}', unit '{unit}', state {state}): paramfsm gathers parameters "
        "from module hooks and reduces gradients from autograd callbacks, which functorch's transforms do not "
        "run, so the result would be wrong. Nothing was gathered. What to do: run the transform on a plain copy "
        "of the model (plain.load_state_dict(rt.full_state_dict()), collective), or use torch.autograd "
        "(torch.autograd.grad, is_grads_batched=True for batched vector-Jacobian products) on the sharded model."
    )
