"""The autograd nodes of a unit's output, whatever structure holds its tensors.

A unit's forward hook (:mod:`paramfsm.engine.events.hooks`) hooks these nodes so
that the unit is gathered before its backward. A plain tensor output never
comes here (the hook handles it inline); everything else is walked by
:func:`graph_nodes`.

[Note: how an output is walked]
``torch.utils._pytree`` flattens what it knows: tuples, lists, dicts,
namedtuples, structseqs and registered types (Hugging Face registers its
``ModelOutput`` classes). What it does not know comes back as a leaf, and a
leaf is looked into here: a dataclass through its fields (frozen or not, to
any depth), and a mapping, list, tuple or set subclass nobody registered
through its items. Ints, strings, None and other values without tensors are
skipped. Any other object is looked into only to decide whether it hides
tensors of the autograd graph: its attributes (and the containers among
them) are searched one object deep, and a tensor with a ``grad_fn`` there
raises :class:`~paramfsm.errors.UnsupportedOutput` at the forward, where the
message can name the module, instead of a shape error deep in the backward.
Objects nested in such an object are not searched: state kept for a later
call (a key/value cache of per-layer objects) holds tensors made by the
units inside, which hook their own outputs, and guessing which attributes
are outputs would hook tensors the unit never returned.

[Note: the base of an output view]
An in-place op on a view moves the view onto a new node (``CopySlices``
over the base's node, with the view's node replayed on top), so the node the
forward hook saw never runs. The base's node does run, right after
``CopySlices``, and before any node of the unit that the view depends on,
so it is hooked as well. Only a base made inside the unit is hooked: one of
the unit's inputs (or an input's base) belongs to the unit that made it, and
hooking its node would gather this unit after its backward. The inputs are
the positional arguments; a view of a keyword argument that is returned
gets its base hooked too, which at worst gathers the unit once more in a
backward that no longer needs it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch.utils._pytree import tree_flatten

from paramfsm.errors import UnsupportedOutput

#: Leaf types that hold no tensor: skipped without a look.
_PLAIN = frozenset({int, float, complex, bool, str, bytes, type(None), torch.dtype, torch.device})


def graph_nodes(unit, output, args) -> tuple[list, list]:
    """``(nodes, bases)``: the distinct nodes of the output's tensors, and the nodes of the bases of its views
    that the unit made (see [Note: the base of an output view]), none of them among ``nodes``.

    Raises ``UnsupportedOutput`` for an object that hides graph tensors (see [Note: how an output is walked]).
    """
    tensors: list = []
    _collect(output, tensors, set(), unit)
    by_id: dict = {}
    for t in tensors:
        node = t.grad_fn
        if node is not None:
            by_id[id(node)] = node
    nodes = list(by_id.values())
    views = [t for t in tensors if t.grad_fn is not None and t._is_view()]
    return nodes, view_bases(views, nodes, args) if views else []


def view_bases(views, nodes, args) -> list:
    """The nodes of the bases of ``views`` made inside the unit whose positional inputs are ``args``,
    leaving out those already in ``nodes``."""
    known = {id(node) for node in nodes}
    inputs = None
    bases = []
    for view in views:
        node = view._base.grad_fn
        if node is None or id(node) in known:
            continue
        if inputs is None:
            inputs = _input_nodes(args)
        if id(node) not in inputs:
            known.add(id(node))
            bases.append(node)
    return bases


def _input_nodes(args) -> set:
    """The ids of the nodes that made the unit's positional inputs (or their bases)."""
    found = set()
    for t in args if all(isinstance(a, torch.Tensor) for a in args) else tree_flatten(args)[0]:
        if isinstance(t, torch.Tensor):
            found.add(id(t.grad_fn))
            if t._is_view():
                found.add(id(t._base.grad_fn))
    return found


def _collect(obj, tensors: list, seen: set, unit) -> None:
    """Append the tensors in ``obj`` to ``tensors``. With ``unit`` None (searching inside an object the walk
    cannot enter) objects of unknown types are skipped; otherwise one that hides graph tensors raises."""
    leaves, _ = tree_flatten(obj)
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
            continue
        if type(leaf) in _PLAIN or id(leaf) in seen:
            continue
        seen.add(id(leaf))
        children = _children(leaf)
        if children is not None:
            for child in children:
                _collect(child, tensors, seen, unit)
        elif unit is not None and _hides_graph(leaf):
            kind = type(leaf)
            raise UnsupportedOutput(module=unit.name, type_name=kind.__qualname__,
                                    full_type_name=f"{kind.__module__}.{kind.__qualname__}")


def _children(leaf):
    """What the walk enters of a leaf pytree returned whole, or None for an object it cannot enter."""
    if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
        return [getattr(leaf, f.name, None) for f in dataclasses.fields(leaf)]
    if isinstance(leaf, Mapping):
        return list(leaf.values())
    if isinstance(leaf, (list, tuple, set, frozenset)):
        return list(leaf)
    return None


def _hides_graph(obj) -> bool:
    """Whether the attributes of ``obj`` hold a tensor with a ``grad_fn`` (one object deep)."""
    values = list(getattr(obj, "__dict__", {}).values())
    for cls in type(obj).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(obj, name):
                values.append(getattr(obj, name))
    found: list = []
    _collect(values, found, set(), None)
    return any(t.grad_fn is not None for t in found)
