"""Parameters added, replaced or deleted after ``paramfsm.shard()``: refused at the next forward.

``shard()`` partitions the parameters the model has at that moment. One that
appears later (``model.gain = nn.Parameter(...)``, a module attached with
parameters of its own) is a plain tensor paramfsm knows nothing of: every rank
would train its own copy with its own gradient, never averaged, and the ranks
would drift apart from the first step with no error. One that is deleted or
replaced leaves a record behind that the model no longer uses.

So such a change raises :class:`~paramfsm.errors.ModelChanged` at the next
forward, naming the parameter and what to do (shard after the change: ``model =
rt.close()``, change it, ``paramfsm.shard(model)`` again, and build the
optimizer anew).

[Note: how a change is seen]
Additions and replacements go through ``Module.register_parameter`` (also
what ``module.name = nn.Parameter(...)`` calls) or ``Module.add_module``,
and torch offers process-wide hooks on both. They note the change on the
model's watch (modules are found by identity in a weak table), and the
first change also registers a process-wide forward pre-hook, so the change
is refused at the next forward of any module of the model, a submodule
called directly included (a GAN's ``model.generator(z)``). Nothing runs per
forward until a change was seen. Deletions (``del module.weight``) have no
hook: the root forward checks that every partitioned parameter is still in
its owner's ``_parameters`` (one dictionary lookup each).
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules.module import (
    register_module_forward_pre_hook,
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)
from torch.utils.weak import WeakIdKeyDictionary

from paramfsm.engine.events.compile_guard import eager
from paramfsm.errors import ModelChanged

#: module of a sharded model -> that model's :class:`Watch`
_WATCHED = WeakIdKeyDictionary()
_registration_hooks: list = []
_forward_hook = None


class Watch:
    """What one sharded model held at ``shard()``, and the changes seen since."""

    __slots__ = ("rank", "names", "partitioned", "owners", "changes", "closed")

    def __init__(self, model: nn.Module, records, rank: int):
        self.rank = rank
        self.names = WeakIdKeyDictionary()
        for name, module in model.named_modules(remove_duplicate=False):
            self.names.setdefault(module, name)
        self.partitioned = WeakIdKeyDictionary({rec.param: True for rec in records})
        self.owners = []  # (owner's _parameters, local name, parameter, qualified name, owner name)
        for module in model.modules():
            for local, param in module._parameters.items():
                if param is not None and param in self.partitioned:
                    prefix = self.names.get(module, "")
                    self.owners.append((module._parameters, local, param, f"{prefix}.{local}" if prefix else local,
                                        prefix))
        self.changes: list[tuple[str, str, str]] = []  # (parameter, module, what happened)
        self.closed = False

    def note(self, module: nn.Module, name: str, what: str) -> None:
        prefix = self.names.get(module, "")
        self.changes.append((f"{prefix}.{name}" if prefix else name, prefix or "<root>", what))
        _arm()

    def check(self) -> None:
        """Raise :class:`ModelChanged` for the first change seen, or a partitioned parameter gone."""
        if self.closed:
            return
        if not self.changes:
            for params, local, param, qualified, owner in self.owners:
                if params.get(local) is not param:
                    what = "deleted" if params.get(local) is None else "replaced by another tensor"
                    self.changes.append((qualified, owner or "<root>", what))
                    break
            else:
                return
        param, module, what = self.changes[0]
        raise ModelChanged(param=param, module=module, rank=self.rank, what=what)


def watch(model: nn.Module, records, rank: int) -> Watch:
    """Start watching ``model`` (at ``shard()``); returns the watch, checked at every root forward."""
    if not _registration_hooks:  # the hooks look their functions up at each call, as any patch expects
        _registration_hooks.append(register_module_parameter_registration_hook(
            lambda module, name, param: _on_parameter(module, name, param)))
        _registration_hooks.append(register_module_module_registration_hook(
            lambda module, name, submodule: _on_module(module, name, submodule)))
    found = Watch(model, records, rank)
    for module in model.modules():
        _WATCHED[module] = found
    return found


def forget(found: Watch, model: nn.Module) -> None:
    """Stop watching (``rt.close()``, ``rt.detach()``)."""
    found.closed = True
    for module in model.modules():
        if _WATCHED.get(module) is found:
            del _WATCHED[module]
    _disarm()


def _on_parameter(module, name, param):
    found = _WATCHED.get(module)
    if found is not None and not found.closed and param is not None and param not in found.partitioned:
        found.note(module, name, "added or replaced after paramfsm.shard()")


def _on_module(module, name, submodule):
    found = _WATCHED.get(module)
    if found is None or found.closed or submodule is None:
        return
    for local, param in submodule.named_parameters():
        if param not in found.partitioned:
            found.note(module, f"{name}.{local}", "attached after paramfsm.shard() with a new module")
            return


def _arm() -> None:
    """Refuse the next forward of any watched module (see [Note: how a change is seen])."""
    global _forward_hook
    if _forward_hook is None:
        _forward_hook = register_module_forward_pre_hook(eager(_refuse_changed))


def _disarm() -> None:
    """Remove the global forward hook once no watched model has a change to refuse: it costs every module of the
    process a call per forward, and ``torch.compile`` warns about any global module hook."""
    global _forward_hook
    if _forward_hook is not None and not any(found.changes and not found.closed for found in set(_WATCHED.values())):
        _forward_hook.remove()
        _forward_hook = None


def _refuse_changed(module, args) -> None:
    found = _WATCHED.get(module)
    if found is not None and found.changes and not found.closed:
        found.check()
