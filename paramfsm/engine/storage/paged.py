"""A paged-out value is paged in when something reads it, or raises; it is never read as it stands.

While an offloaded shard or optimizer state tensor is PAGED_OUT its working
storage is freed: ``tensor.data`` is one element expanded to the tensor's
shape, so the shape, dtype and device stay what code expects (a shard
gradient can still be assigned to a paged-out shard) while no memory is held.
Its values must never be read like that.

[Note: the class of a paged-out tensor]
``drop_resident`` switches the tensor to a subclass of its own class whose
``__torch_function__`` lets metadata through (shape, dtype, device, the
gradient, hooks) and, for anything else, asks the tensor's pager to page it
in now (:data:`PAGERS`, installed by the schedule): the read then runs on the
real values. When no pager can (the runtime was closed, or the read comes from
a thread other than the one driving the schedule) it raises
:class:`~paramfsm.errors.NotResident` naming the parameter. ``finish_read``
switches it back, so a resident tensor pays nothing per operation. This is
what makes every reader outside the schedule correct by default
(``full_state_dict``, a checkpoint save, ``optimizer.state_dict()``, user code
reading a shard), exactly as :mod:`paramfsm.engine.storage.placeholder` does
for a parameter that is not gathered.
"""

from __future__ import annotations

import torch
from torch._C import DisableTorchFunctionSubclass
from torch.utils.weak import WeakIdKeyDictionary

from paramfsm.errors import NotResident

#: paged-out tensor -> ``page_in(tensor) -> bool`` (the schedule's on-demand page-in), weakly keyed.
PAGERS = WeakIdKeyDictionary()
#: offloaded tensor -> (parameter name, what of it, unit, rank), for messages.
OWNERS = WeakIdKeyDictionary()

_GUARDED: dict[type, type] = {}  # plain class -> paged-out class
_PLAIN: dict[type, type] = {}  # paged-out class -> plain class

_PROPERTIES = frozenset({
    "grad", "_grad", "requires_grad", "is_leaf", "grad_fn", "_grad_fn", "retains_grad", "shape",
    "dtype", "device", "layout", "names", "itemsize", "_version", "output_nr", "ndim",
    "_backward_hooks", "_post_accumulate_grad_hooks",
    "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mkldnn", "is_nested", "is_xpu", "is_mps",
})
_METADATA = frozenset({
    "__hash__", "size", "dim", "ndimension", "numel", "nelement", "element_size", "is_floating_point",
    "is_complex", "register_hook", "register_post_accumulate_grad_hook", "requires_grad_", "backward",
})


def is_paged_out(tensor: torch.Tensor) -> bool:
    return tensor.__class__ in _PLAIN


def working(tensor: torch.Tensor) -> torch.Tensor:
    """The storage really behind ``tensor.data``, for paramfsm's own effects."""
    with DisableTorchFunctionSubclass():
        return torch.Tensor.data.__get__(tensor)


def set_working(tensor: torch.Tensor, value: torch.Tensor) -> None:
    with DisableTorchFunctionSubclass():
        torch.Tensor.data.__set__(tensor, value)


def conceal(tensor: torch.Tensor) -> None:
    """Free ``tensor``'s working storage and switch it to its paged-out class (``drop_resident``)."""
    set_working(tensor, torch.empty(1, dtype=tensor.dtype, device=tensor.device).expand(tensor.shape))
    cls = tensor.__class__
    if cls not in _PLAIN:
        tensor.__class__ = _GUARDED.get(cls) or _guard_class(cls)


def reveal(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """Give ``tensor`` its working storage back (``finish_read``) and its plain class."""
    plain = _PLAIN.get(tensor.__class__)
    if plain is not None:
        tensor.__class__ = plain
    set_working(tensor, value)


def _guard_class(cls: type) -> type:
    guard = type(f"PagedOut{cls.__name__[0].upper()}{cls.__name__[1:]}", (cls,), {
        "__torch_function__": classmethod(_torch_function),
        "__module__": __name__,
        "__doc__": f"A {cls.__name__} whose working copy is paged out (see paramfsm.engine.storage.paged).",
    })
    _GUARDED[cls], _PLAIN[guard] = guard, cls
    return guard


def _torch_function(cls, func, types, args=(), kwargs=None):
    kwargs = kwargs or {}
    name = getattr(func, "__name__", None)
    if name in ("__get__", "__set__", "__delete__"):
        prop = _property_name(func)
        if prop in _PROPERTIES or (name == "__set__" and prop == "data"):
            with DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
    elif name in _METADATA:
        with DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    for tensor in _paged_operands(args, kwargs):
        page_in = PAGERS.get(tensor)
        if page_in is None or not page_in(tensor):
            raise _not_resident(tensor, func)
    with DisableTorchFunctionSubclass():
        return func(*args, **kwargs)


def _paged_operands(args, kwargs) -> list:
    flat = list(args) + list(kwargs.values())
    for value in list(flat):
        if isinstance(value, (list, tuple)):
            flat.extend(value)
    return [a for a in flat if a.__class__ in _PLAIN]


def _property_name(accessor) -> str | None:
    """The property an accessor (``__get__`` / ``__set__`` / ``__delete__``) belongs to: every one let through is a
    getset descriptor of torch's C tensor, named; a Python property (``__cuda_array_interface__``) gives None and
    is a read."""
    return getattr(getattr(accessor, "__self__", None), "__name__", None)


def _not_resident(tensor, func) -> NotResident:
    name, what, unit, rank = OWNERS.get(tensor, ("<unknown>", "value", "<unknown>", -1))
    op = getattr(func, "__qualname__", None) or repr(func)  # torch's functions have one; a partial does not
    return NotResident(
        f"{op} read the {what} of parameter '{name}' (unit '{unit}', rank {rank}) while it is paged out to "
        "its offload tier, and it could not be paged in here (the runtime is closed, or the read runs on "
        "another thread). What to do: read it on the training thread while the runtime is open, or "
        "after rt.close() read the model's parameters instead.")
