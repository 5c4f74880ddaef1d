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
access such as ``.grad``, ``.shape``; hook registration; ``repr``; naming it
as an autograd input), and which refuses to be pickled. ``install`` switches
it back before the full tensor goes in. So a gathered
parameter is its plain class and pays nothing per operation; only operations
on an empty one take the Python path, and all of those are errors. Identity,
``isinstance(p, nn.Parameter)``, autograd metadata and hooks are unchanged
(the class is the only thing that changes, exactly as ``param.data`` does).
Autograd's C++ kernels never consult ``__torch_function__``, so backward is
unaffected. The switch costs about 0.2 us per parameter per gather/free
cycle (measured on CPU: a ``.data`` swap pair 275 ns, with the switch 467 ns).
A ``TorchFunctionMode`` outside forwards was rejected: it would run Python
for every operation of the loss and optimizer step.

[Note: logical metadata at rest]
Like a DTensor, an empty parameter reports its logical (full) shape:
``shape``, ``size()``, ``dim()``, ``ndim``, ``numel()``, ``nelement()`` and
``nbytes`` answer for the full parameter, so parameter counts
(``sum(p.numel() for p in model.parameters())``, Hugging Face's
``num_parameters()``) are right. ``p.data`` is the empty storage behind the
same guard (:class:`NotGatheredData`): its shape is logical too, and reading
its values raises instead of returning an empty tensor or 0. paramfsm's own
code reaches the real storage through :func:`storage`.

Limits: ``type(p) is nn.Parameter`` is False while the model is sharded
(:mod:`paramfsm.engine.storage.partitioned`); ``copy.deepcopy`` of a sharded model
copies the empty placeholders.
"""

from __future__ import annotations

import types
import weakref

import torch
from torch._C import DisableTorchFunctionSubclass
from torch.utils.weak import WeakIdKeyDictionary

from paramfsm.engine.storage.partitioned import OWNERS, owner, record_of
from paramfsm.errors import NotGathered

_GUARDED: dict[type, type] = {}  # plain class -> guard class
_PLAIN: dict[type, type] = {}  # guard class -> plain class

#: Functions that read or change metadata only, or name the parameter as an autograd leaf
#: (``torch.autograd.grad(loss, params)``, ``backward(inputs=params)``); allowed on an empty parameter.
_METADATA = frozenset({
    "__repr__", "__format__", "__hash__",
    "register_hook", "register_post_accumulate_grad_hook", "requires_grad_",
    "element_size", "is_floating_point", "is_complex", "data_ptr",
    "grad", "backward",
})
#: Properties that are metadata (``.T``, ``.mT``, ``.real`` compute views of the values: not allowed).
_PROPERTIES = frozenset({
    "grad", "_grad", "requires_grad", "is_leaf", "grad_fn", "_grad_fn", "retains_grad",
    "dtype", "device", "layout", "names", "itemsize", "_version", "output_nr",
    "_base", "_backward_hooks", "_post_accumulate_grad_hooks",
    "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mkldnn", "is_nested", "is_xpu", "is_mps",
})
#: Read as they are, but never set: a gradient dtype set on the full parameter would not reach its shard's
#: gradient (the reduce-scatter decides that dtype: ``reduce_dtype``), so setting one raises NotGathered.
_READ_ONLY_PROPERTIES = frozenset({"grad_dtype"})
_ACCESSORS = frozenset({"__get__", "__set__", "__delete__"})
#: Answered for the full parameter (see [Note: logical metadata at rest]).
_LOGICAL_METHODS = frozenset({"size", "dim", "ndimension", "numel", "nelement"})
_LOGICAL_PROPERTIES = frozenset({"shape", "ndim", "nbytes", "data"})


def storage(param: torch.Tensor) -> torch.Tensor:
    """The tensor really behind ``param.data`` (empty at rest), for paramfsm's own checks."""
    with DisableTorchFunctionSubclass():
        return torch.Tensor.data.__get__(param)


def conceal(param: torch.Tensor) -> None:
    """Switch an emptied parameter to its guard class (part of the ``free`` effect)."""
    cls = _UNWATCHED.get(param.__class__, param.__class__)
    if cls in _PLAIN:
        return
    guard = _GUARDED.get(cls)
    if guard is None:
        guard = _guard_class(cls)
    param.__class__ = guard


def reveal(param: torch.Tensor) -> None:
    """Switch a parameter back to its plain class before its full tensor is installed."""
    plain = _PLAIN.get(param.__class__) or _UNWATCHED.get(param.__class__)
    if plain is not None:
        param.__class__ = plain


# ---------------------------------------------------------------- kept parameters
#: [Note: a read of a kept parameter outside its unit]
#: An empty parameter finds out who reads it: its guard asks for an on-demand gather, and the reading unit
#: borrows it (:mod:`paramfsm.engine.schedule.on_demand`). A unit kept from its forward to its backward
#: (``reshard_after_forward``) is gathered while later units run, so another unit's forward can read it
#: unnoticed: the root of a model whose output layer is tied through ``F.linear(h, self.emb.weight)``. The
#: reading unit's graph then saves the full parameter without owning it, and its next backward reads it before
#: the parameter's own unit is gathered again. After a retained backward whose deferral bound released the
#: embedding, the root's second backward computed on an empty or half-gathered tensor (garbage, then NaN). So
#: while a unit is kept its parameters are of a *watching* subclass, whose ``__torch_function__`` tells the
#: schedule of every operation on them (through the same demand table as the guards) and then runs it on the
#: plain class: a read by another running unit borrows the parameter exactly as an on-demand gather does, with
#: nothing to gather. Only operations on kept parameters pay the Python call (the unit's own later calls in
#: the forward, another unit's reads, user code between forward and backward); autograd's kernels never consult
#: ``__torch_function__``, so the backward pays nothing. ``unwatch`` switches back when the kept hold goes.
_WATCHING: dict[type, type] = {}  # plain class -> watching class
_UNWATCHED: dict[type, type] = {}  # watching class -> plain class


def watch(param: torch.Tensor) -> None:
    """Switch a kept (gathered) parameter to its watching class: see [Note: a read of a kept parameter ...]."""
    cls = param.__class__
    if cls in _UNWATCHED or cls in _PLAIN:
        return
    watching = _WATCHING.get(cls)
    if watching is None:
        watching = type(f"Kept{cls.__name__[0].upper()}{cls.__name__[1:]}", (cls,), {
            "__torch_function__": classmethod(_kept_function),
            "__module__": __name__,
            "__doc__": f"A gathered {cls.__name__} kept for its backward (see paramfsm.engine.storage.placeholder).",
        })
        _WATCHING[cls], _UNWATCHED[watching] = watching, cls
    param.__class__ = watching


def unwatch(param: torch.Tensor) -> None:
    """Switch a parameter that is no longer kept back to its plain class."""
    plain = _UNWATCHED.get(param.__class__)
    if plain is not None:
        param.__class__ = plain


def _kept_function(cls, func, types, args=(), kwargs=None):
    name = getattr(func, "__name__", None)
    if name not in _ACCESSORS and name not in _METADATA and name not in _LOGICAL_METHODS:
        flat = list(args) + list((kwargs or {}).values())
        for value in list(flat):
            if isinstance(value, (list, tuple)):
                flat.extend(value)
        for value in flat:
            if type(value) in _UNWATCHED:
                _gather_on_demand(value)  # nothing to gather: the reading unit borrows it
    with DisableTorchFunctionSubclass():
        return func(*args, **(kwargs or {}))


def _guard_class(cls: type) -> type:
    guard = type(f"NotGathered{cls.__name__[0].upper()}{cls.__name__[1:]}", (cls,), {
        "__torch_function__": classmethod(_torch_function),
        "__reduce_ex__": _refuse_pickle,
        "__module__": __name__,
        "__doc__": f"A {cls.__name__} whose data is not gathered on this rank (see paramfsm.engine.storage.placeholder).",
    })
    _GUARDED[cls], _PLAIN[guard] = guard, cls
    return guard


def _torch_function(cls, func, types, args=(), kwargs=None):
    name = getattr(func, "__name__", None)
    if name in _ACCESSORS:
        prop = _property_name(func)
        if name == "__get__" and prop in _LOGICAL_PROPERTIES and (rec := record_of(args[0])) is not None:
            return _logical_property(prop, args[0], rec)
        if prop in _PROPERTIES or (name == "__set__" and prop == "data") or (
                name == "__get__" and prop in _READ_ONLY_PROPERTIES):
            with DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
    elif name in _LOGICAL_METHODS and (rec := record_of(args[0])) is not None:
        return _logical_method(name, rec, *args[1:], **(kwargs or {}))
    elif name in _METADATA:
        with DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))
    empty = _empty_parameters(args, kwargs)
    if empty and all(_gather_on_demand(p) for p in empty):  # read by a running unit: gathered for it
        return func(*args, **(kwargs or {}))
    raise _error(func, args, kwargs)


def _empty_parameters(args, kwargs) -> list:
    """The empty partitioned parameters among an operation's operands (one level of lists)."""
    flat = list(args) + list((kwargs or {}).values())
    for value in list(flat):
        if isinstance(value, (list, tuple)):
            flat.extend(value)
    return [a for a in flat if type(a) in _PLAIN]


def _logical_method(name: str, rec, dim=None):
    shape = rec.shape
    if name == "size":
        return shape if dim is None else shape[dim]
    if name in ("dim", "ndimension"):
        return len(shape)
    return rec.numel  # numel, nelement


def _logical_property(name: str, tensor: torch.Tensor, rec):
    if name == "shape":
        return rec.shape
    if name == "ndim":
        return len(rec.shape)
    if name == "nbytes":
        return rec.numel * tensor.element_size()
    # data: the empty storage, behind the same guard and reporting the same logical shape
    view = storage(tensor).as_subclass(NotGatheredData)
    OWNERS[view] = OWNERS[tensor]
    return view


def _refuse_pickle(param, protocol):
    """``torch.save(model)`` / pickling would silently store the empty placeholder."""
    name, unit, rank = owner(param)
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
    owned = [a for a in flat if isinstance(a, torch.Tensor) and a in OWNERS]
    # Name the operand that is really empty: the others may be gathered parameters of a running unit.
    param = next((a for a in owned if type(a) in _PLAIN or type(a) is NotGatheredData), owned[0] if owned else None)
    name, unit, rank = owner(param)
    op = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)
    if op.endswith(("__get__", "__set__")):
        op = f"the property .{_property_name(func)}"
    return NotGathered(param=name, unit=unit, rank=rank, op=op)


class NotGatheredData(torch.Tensor):
    """``p.data`` of an empty parameter: the same guard, on a plain tensor."""

    __torch_function__ = classmethod(_torch_function)
    __reduce_ex__ = _refuse_pickle


#: partitioned parameter -> a weak reference to the scheduler's ``demand(param) -> bool``. The schedule installs
#: it (:mod:`paramfsm.engine.schedule.on_demand`); storage never imports it.
#:
#: [Note: the demand table holds nothing alive]
#: The table is module-global. A strong value would be a bound method of the runtime's schedule, which holds the
#: runtime, its model and its process group, and so the very parameter that keys it: a weak key that its own value
#: keeps alive is never dropped, and every runtime ever built (and its gloo group's threads) lived until the
#: process ended. So the key is weak, the value is a ``WeakMethod``, and ``rt.close()`` / ``rt.detach()`` remove
#: their entries (:func:`forget_demands`).
DEMANDS = WeakIdKeyDictionary()


def answer_demands(records, demand) -> None:
    """Let the placeholders of ``records`` ask ``demand`` for an on-demand gather before raising NotGathered."""
    ref = weakref.WeakMethod(demand) if isinstance(demand, types.MethodType) else (lambda: demand)
    for rec in records:
        DEMANDS[rec.param] = ref


def forget_demands(records) -> None:
    """Remove the on-demand entries of ``records`` (the runtime that answered them is closing)."""
    for rec in records:
        DEMANDS.pop(rec.param, None)


def _gather_on_demand(param) -> bool:
    """Gather the empty parameter ``param`` for the unit reading it; False when no unit is running."""
    ref = DEMANDS.get(param)
    demand = ref() if ref is not None else None
    return demand is not None and demand(param)
