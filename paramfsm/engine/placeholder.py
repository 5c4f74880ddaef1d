"""A parameter that is not gathered raises a clear error when it is used, instead of computing on nothing.

While a parameter is NOT_AVAILABLE (or INFLIGHT) its ``param.data`` is an
empty tensor. Code that touches it outside its unit's forward or backward
(reading ``model.lin.weight`` after ``opt.step()``, another unit's forward
using it directly, ``model.state_dict()``, ``model.to(...)``) would otherwise
get shape errors that do not say why, or silently wrong values (``p.sum()``
of an empty tensor is 0).

[Note: the class of an empty parameter]
The ``free`` effect, which makes ``param.data`` empty, also switches the
parameter's class to a subclass of its own class whose ``__torch_function__``
raises :class:`NotGathered` for every operation except metadata (property
access such as ``.data``, ``.grad``, ``.shape``; hook registration;
``repr``; naming it as an autograd input), and which refuses to be pickled.
``install`` switches it back before the full tensor goes in. So a gathered
parameter is its plain class and pays nothing per operation; only operations
on an empty one take the Python path, and all of those are errors. Identity,
``isinstance(p, nn.Parameter)``, autograd metadata and hooks are unchanged
(the class is the only thing that changes, exactly as ``param.data`` does).
Autograd's C++ kernels never consult ``__torch_function__``, so backward is
unaffected. The switch costs about 0.2 us per parameter per gather/free
cycle (measured on CPU: a ``.data`` swap pair 275 ns, with the switch 467 ns).
A ``TorchFunctionMode`` outside forwards was rejected: it would run Python
for every operation of the loss and optimizer step.

Limits: ``type(p) is nn.Parameter`` is False while the parameter is empty;
code that reads only metadata (``p.numel()`` is 0, ``p.shape`` is ``(0,)``)
is not stopped; ``copy.deepcopy`` of a sharded model copies the empty
placeholders; code that only looks at ``p.grad`` (an optimizer built on
``model.parameters()`` instead of ``rt.shard_parameters()``,
``torch.nn.utils.clip_grad_norm_(model.parameters())``) sees ``None`` and
does nothing, since gradients live on the shards (use
``rt.clip_grad_norm_``).
"""

from __future__ import annotations

import torch
from torch._C import DisableTorchFunctionSubclass
from torch.utils.weak import WeakIdKeyDictionary

from paramfsm.errors import NotGathered

#: parameter -> (qualified name, unit name, rank), for error messages (keyed by identity).
_OWNERS = WeakIdKeyDictionary()
_GUARDED: dict[type, type] = {}  # plain class -> guard class
_PLAIN: dict[type, type] = {}  # guard class -> plain class

#: Functions that read or change metadata only, or name the parameter as an autograd leaf
#: (``torch.autograd.grad(loss, params)``, ``backward(inputs=params)``); allowed on an empty parameter.
_METADATA = frozenset({
    "__repr__", "__format__", "__hash__",
    "register_hook", "register_post_accumulate_grad_hook", "requires_grad_",
    "size", "dim", "numel", "element_size", "is_floating_point", "is_complex", "data_ptr",
    "grad", "backward",
})
#: Properties that are metadata (``.T``, ``.mT``, ``.real`` compute views of the values: not allowed).
_PROPERTIES = frozenset({
    "data", "grad", "_grad", "requires_grad", "is_leaf", "grad_fn", "_grad_fn", "retains_grad",
    "shape", "dtype", "device", "layout", "ndim", "names", "itemsize", "nbytes", "_version", "output_nr",
    "_base", "_backward_hooks", "_post_accumulate_grad_hooks",
    "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mkldnn", "is_nested", "is_xpu", "is_mps",
})
_ACCESSORS = frozenset({"__get__", "__set__", "__delete__"})


def register(param: torch.Tensor, name: str, unit: str, rank: int) -> None:
    """Remember who owns ``param``, for the message of :class:`NotGathered`."""
    _OWNERS[param] = (name, unit, rank)


def conceal(param: torch.Tensor) -> None:
    """Switch an emptied parameter to its guard class (part of the ``free`` effect)."""
    cls = param.__class__
    if cls in _PLAIN:
        return
    guard = _GUARDED.get(cls)
    if guard is None:
        guard = _guard_class(cls)
    param.__class__ = guard


def reveal(param: torch.Tensor) -> None:
    """Switch a parameter back to its plain class before its full tensor is installed."""
    plain = _PLAIN.get(param.__class__)
    if plain is not None:
        param.__class__ = plain


def _guard_class(cls: type) -> type:
    guard = type(f"NotGathered{cls.__name__[0].upper()}{cls.__name__[1:]}", (cls,), {
        "__torch_function__": classmethod(_torch_function),
        "__reduce_ex__": _refuse_pickle,
        "__module__": __name__,
        "__doc__": f"A {cls.__name__} whose data is not gathered on this rank (see paramfsm.engine.placeholder).",
    })
    _GUARDED[cls], _PLAIN[guard] = guard, cls
    return guard


def _torch_function(cls, func, types, args=(), kwargs=None):
    name = getattr(func, "__name__", None)
    if name in _METADATA or (name in _ACCESSORS and _property_name(func) in _PROPERTIES):
        with DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))
    raise _error(func, args, kwargs)


def _refuse_pickle(param, protocol):
    """``torch.save(model)`` / pickling would silently store the empty placeholder."""
    name, unit, rank = _OWNERS.get(param, ("<unknown>", "<unknown>", -1))
    raise NotGathered(param=name, unit=unit, rank=rank, op="pickling (torch.save of the model)")


def _property_name(accessor) -> str | None:
    """The name of the property whose ``__get__``/``__set__`` this is."""
    owner = getattr(accessor, "__self__", None)
    return getattr(owner, "__name__", None) or getattr(getattr(owner, "fget", None), "__name__", None)


def _error(func, args, kwargs) -> NotGathered:
    flat = list(args) + list((kwargs or {}).values())
    for value in list(flat):
        if isinstance(value, (list, tuple)):
            flat.extend(value)
    param = next((a for a in flat if isinstance(a, torch.Tensor) and a.__class__ in _PLAIN), None)
    name, unit, rank = _OWNERS.get(param, ("<unknown>", "<unknown>", -1)) if param is not None \
        else ("<unknown>", "<unknown>", -1)
    op = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    if op.endswith(("__get__", "__set__")):
        op = f"the property .{_property_name(func)}"
    return NotGathered(param=name, unit=unit, rank=rank, op=op)


#: The guard class of ``nn.Parameter`` (the common case), importable by name.
NotGatheredParameter = _guard_class(torch.nn.Parameter)
