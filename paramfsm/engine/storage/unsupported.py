"""``torch.nn`` modules that cannot work on sharded parameters, refused at ``shard`` with a clear error.

A module whose forward writes its own parameter in place would write into
the gathered copy, which is freed after the unit, so the write is lost; and
each rank would write from its own batch only. A lazy module's parameters have
no shape before its first forward, so there is nothing to partition yet. The
README lists these modules.
"""

from __future__ import annotations

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
