"""What a partitioned parameter is to user code: its class, its ``.grad`` and its ``requires_grad``.

A partitioned parameter keeps its identity, but its gradient lives on its
shard and its data is gathered only while its unit runs. Code written for plain
torch reaches the gradient and the trainable flag through the parameter
(``opt.zero_grad()`` over ``model.parameters()``, ``clip_grad_value_``,
``p.requires_grad_(True)`` to unfreeze), so those two attributes must mean the
right thing. :func:`adopt` switches the parameter, for as long as it is
partitioned, to a subclass of its own class that adds exactly that:

* ``p.grad`` is autograd's own gradient while one is being accumulated, and
  otherwise a :class:`ShardGrad` view of this rank's shard gradient (None when
  there is none). ``p.grad = None`` clears the shard gradient. The view allows
  what optimizers and clipping by value do to gradients (zero, detach, clamp:
  element-wise, so the shard's result is exactly the full gradient's slice) and
  raises :class:`~paramfsm.errors.NotGathered` for anything that would read it
  as the full gradient (norms, sums, copies), naming ``rt.full_grad`` and
  ``rt.clip_grad_norm_``.
* ``p.requires_grad = ...`` and ``p.requires_grad_(...)`` are recorded, and the
  scheduler applies the change at the next root forward (shard, gradient hooks
  and holds follow), so freezing and unfreezing between iterations train
  exactly like plain torch.

The subclass keeps ``nn.Parameter``'s disabled ``__torch_function__``, so
operations on a gathered parameter cost nothing extra. [Note: the class of an
empty parameter] in :mod:`paramfsm.engine.storage.placeholder` derives its guard class
from this one.
"""

from __future__ import annotations

import torch
from torch._C import DisableTorchFunctionSubclass
from torch._guards import TracingContext
from torch.utils.weak import WeakIdKeyDictionary

from paramfsm.errors import NotGathered, ParamFSMError

_TENSOR_GRAD = torch._C.TensorBase.grad
#: ``nn.Parameter``'s (and so a gathered partitioned parameter's) ``__torch_function__``: none at all.
_NO_TORCH_FUNCTION = torch._C._disabled_torch_function_impl
_TENSOR_REQUIRES_GRAD = torch._C.TensorBase.requires_grad
_TENSOR_REQUIRES_GRAD_ = torch._C.TensorBase.requires_grad_

#: parameter (or a view handed out for it) -> (record, rank); keyed by identity, weakly.
OWNERS = WeakIdKeyDictionary()
_PARTITIONED: dict[type, type] = {}  # original class -> partitioned class
_ORIGINAL: dict[type, type] = {}  # partitioned class -> original class
#: Records whose parameter's requires_grad was changed by user code since the scheduler last looked.
REQUIRES_GRAD_CHANGED: set = set()


def adopt(param: torch.Tensor, record, rank: int) -> None:
    """Make ``param`` a partitioned parameter of ``record`` (see the module docstring)."""
    OWNERS[param] = (record, rank)
    cls = param.__class__
    partitioned = _PARTITIONED.get(cls) or _partitioned_class(cls)
    param.__class__ = partitioned


def release(param: torch.Tensor) -> None:
    """Give ``param`` back its original class (``rt.close()``, ``rt.detach()``)."""
    cls = param.__class__
    while cls not in _ORIGINAL and cls.__bases__ and cls.__bases__[0] is not torch.Tensor:
        cls = cls.__bases__[0]  # from the guard class of an empty parameter to its partitioned class
    original = _ORIGINAL.get(cls)
    if original is not None:
        param.__class__ = original
    entry = OWNERS.pop(param, None)
    if entry is not None:
        REQUIRES_GRAD_CHANGED.discard(entry[0])


def owner(tensor) -> tuple[str, str, int]:
    """(qualified name, unit name, rank) of a partitioned parameter or of a view handed out for it."""
    entry = OWNERS.get(tensor)
    if entry is None:
        return "<unknown>", "<unknown>", -1
    record, rank = entry
    return record.name, record.unit, rank


def record_of(tensor):
    entry = OWNERS.get(tensor)
    return entry[0] if entry is not None else None


def real_grad(param: torch.Tensor):
    """Autograd's own ``.grad`` of ``param`` (what AccumulateGrad wrote), bypassing the shard view."""
    if param.__class__.__torch_function__ is _NO_TORCH_FUNCTION:  # a gathered parameter: nothing to bypass
        return _TENSOR_GRAD.__get__(param)
    with DisableTorchFunctionSubclass():
        return _TENSOR_GRAD.__get__(param)


def set_real_grad(param: torch.Tensor, value) -> None:
    if param.__class__.__torch_function__ is _NO_TORCH_FUNCTION:
        _TENSOR_GRAD.__set__(param, value)
        return
    with DisableTorchFunctionSubclass():
        _TENSOR_GRAD.__set__(param, value)


def real_requires_grad(param: torch.Tensor) -> bool:
    with DisableTorchFunctionSubclass():
        return _TENSOR_REQUIRES_GRAD.__get__(param)


def _get_grad(self):
    grad = real_grad(self)
    if grad is not None:
        return grad
    entry = OWNERS.get(self)
    if entry is None or TracingContext.try_get() is not None:  # [Note: a compiler sees no shard gradient]
        return None
    shard_grad = entry[0].shard.grad
    if shard_grad is None:
        return None
    view = shard_grad.as_subclass(ShardGrad)
    OWNERS[view] = entry
    return view


#: [Note: a compiler sees no shard gradient]
#: When ``torch.compile`` traces a forward that reads a parameter (a compiled block, a recompilation after an
#: eval forward between steps, a smaller last batch), Dynamo describes the parameter to build its fake copy, and
#: that reads ``.grad``. Between a backward and ``zero_grad`` the gradient is this rank's shard gradient, whose
#: shape is not the parameter's and whose values are refused (:class:`ShardGrad`): the compilation failed with
#: ``InternalTorchDynamoError(NotGathered)``, blaming a gradient read the user never made. A traced forward
#: never uses the gradient, and autograd's own (the one accumulating now) is what it would see in plain torch,
#: so while a compiler traces, a partitioned parameter reports autograd's gradient alone: None outside backward.


def _set_grad(self, value) -> None:
    if value is None:
        set_real_grad(self, None)
        entry = OWNERS.get(self)
        if entry is not None:
            entry[0].shard.grad = None
        return
    if isinstance(value, ShardGrad) and OWNERS.get(value) is OWNERS.get(self):
        return  # p.grad = p.grad
    name, unit, rank = owner(self)
    raise ParamFSMError(
        f"parameter '{name}' (unit '{unit}', rank {rank}) is partitioned by paramfsm: its gradient lives on "
        "this rank's shard, so a full-size .grad cannot be assigned. What to do: let backward produce "
        "gradients, or set the shard's gradient (dict(rt.named_shard_parameters())[name].grad = ...); "
        "p.grad = None clears it.")


def _get_requires_grad(self) -> bool:
    return real_requires_grad(self)


def _set_requires_grad(self, value: bool) -> None:
    with DisableTorchFunctionSubclass():
        _TENSOR_REQUIRES_GRAD.__set__(self, value)
    _note_change(self)


def _requires_grad_(self, requires_grad: bool = True):
    with DisableTorchFunctionSubclass():
        _TENSOR_REQUIRES_GRAD_(self, requires_grad)
    _note_change(self)
    return self


def _note_change(param) -> None:
    entry = OWNERS.get(param)
    if entry is not None and entry[0].requires_grad != real_requires_grad(param):
        REQUIRES_GRAD_CHANGED.add(entry[0])


def _partitioned_class(cls: type) -> type:
    partitioned = type(f"Partitioned{cls.__name__[0].upper()}{cls.__name__[1:]}", (cls,), {
        "grad": property(_get_grad, _set_grad, doc="Autograd's gradient while accumulating, else the "
                                                   "shard gradient's view (see paramfsm.engine.storage.partitioned)."),
        "requires_grad": property(_get_requires_grad, _set_requires_grad),
        "requires_grad_": _requires_grad_,
        "__module__": __name__,
        "__doc__": f"A {cls.__name__} partitioned by paramfsm (see paramfsm.engine.storage.partitioned).",
    })
    _PARTITIONED[cls], _ORIGINAL[partitioned] = partitioned, cls
    return partitioned


#: What may be done to a shard gradient through a parameter's ``.grad``: zeroing and detaching
#: (``zero_grad``), clamping (``clip_grad_value_``: element-wise, exact on shards), and metadata.
_GRAD_OPS = frozenset({
    "zero_", "_foreach_zero_", "detach_", "requires_grad_",
    "clamp_", "clamp_min_", "clamp_max_", "clip_", "_foreach_clamp_min_", "_foreach_clamp_max_",
    "__repr__", "__format__", "__hash__",
})
_GRAD_PROPERTIES = frozenset({
    "grad_fn", "_grad_fn", "requires_grad", "is_leaf", "device", "dtype", "layout", "is_sparse",
    "is_cuda", "is_cpu", "is_meta", "_version",
})


class ShardGrad(torch.Tensor):
    """This rank's shard gradient, as a parameter's ``.grad`` reports it (see the module docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", None)
        allowed = name in _GRAD_OPS or (name == "__get__" and _accessed(func) in _GRAD_PROPERTIES)
        if allowed:
            with DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        view = next((a for a in _flatten(args, kwargs) if isinstance(a, ShardGrad)), None)
        name_, unit, rank = owner(view)
        op = getattr(func, "__qualname__", None) or name or repr(func)
        if name == "__get__":
            op = f"the property .{_accessed(func)}"
        raise NotGathered(param=name_, unit=unit, rank=rank, op=f"{op} on its .grad", grad=True)


def _accessed(accessor) -> str | None:
    """The name of the property whose ``__get__`` this is."""
    owner_ = getattr(accessor, "__self__", None)
    return getattr(owner_, "__name__", None) or getattr(getattr(owner_, "fget", None), "__name__", None)


def _flatten(args, kwargs) -> list:
    flat = list(args) + list((kwargs or {}).values())
    for value in list(flat):
        if isinstance(value, (list, tuple)):
            flat.extend(value)
    return flat
