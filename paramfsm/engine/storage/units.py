"""Partitioning: which parameters form which unit, and each parameter's shard and side-table record.

A *unit* is a module whose parameters are gathered together in one
collective. Each parameter belongs to the nearest enclosing unit module;
a parameter reachable from several unit modules (tied weights) belongs to
all of them, and its record counts every holder.

The side table (:class:`ParamRecord`, keyed by the parameter) extends the
FSM's :class:`~paramfsm.core.fsm.Lifetime` with what the executor needs: the
rank's shard (a leaf ``nn.Parameter`` the optimizer updates), the full shape,
the padded layout, and the staged / pending buffers of an in-flight gather.
Nothing is set on the user's ``nn.Parameter`` objects except ``.data``.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch
from torch import nn

from paramfsm.core.fsm import Lifetime
from paramfsm.engine.storage import default_units
from paramfsm.engine.storage.default_units import ROOT_REASON, choose
from paramfsm.errors import ArgumentError, ArgumentTypeError, ParamFSMError, warn_at_caller


class ParamRecord(Lifetime):
    """One partitioned parameter: lifetime (from fsm) plus shard and buffers (executor-owned)."""

    __slots__ = ("param", "shard", "shape", "numel", "shard_numel", "units", "names",
                 "requires_grad", "staged", "pending", "local_view", "full", "grad_hooks", "version",
                 "compute_dtype")

    def __init__(self, name: str, param: nn.Parameter, shard: nn.Parameter, shard_numel: int):
        super().__init__(name, "", param.numel() * param.element_size())
        self.param = param
        self.shard = shard
        self.shape = param.shape
        self.numel = param.numel()
        self.shard_numel = shard_numel
        self.units: tuple[Unit, ...] = ()
        self.names: tuple[str, ...] = (name,)
        self.requires_grad = param.requires_grad
        self.staged: torch.Tensor | None = None  # the full tensor unpacked, not yet installed
        self.pending = None  # the in-flight Gather this parameter is part of
        self.local_view: torch.Tensor | None = None  # world 1: the shard viewed as the full parameter
        self.full: torch.Tensor | None = None  # world > 1, large: the persistent full tensor (executor)
        self.grad_hooks: list = []  # handles of the gradient hooks while it requires grad (hooks.watch_grads)
        self.version: int | None = None  # the full parameter's version at its gather ([Note: a write to a ...])
        self.compute_dtype = shard.dtype  # the gathered full parameter's (param_dtype: see compute_dtypes)

    def __repr__(self) -> str:
        return f"<ParamRecord {self.name} {self.state.name} holds={self.holds}>"


#: The name of the unit of the model itself.
ROOT = "<root>"


class Unit:
    """A module whose parameters are gathered in one collective."""

    __slots__ = ("index", "name", "module", "records", "nbytes", "live_graphs", "reason", "merged")

    def __init__(self, index: int, name: str, module: nn.Module, records: Sequence[ParamRecord],
                 reason: str = "", merged: Sequence[str] = ()):
        self.index = index
        self.name = name or ROOT
        self.module = module
        self.records = tuple(records)
        self.nbytes = sum(r.nbytes for r in self.records)
        self.live_graphs = 0  # forward calls of this unit still referenced by an autograd graph
        self.reason = reason  # why it is a unit (rt.describe_units())
        self.merged = tuple(merged)  # the small modules whose parameters joined it

    def __repr__(self) -> str:
        return f"<Unit {self.index} {self.name} params={len(self.records)}>"


class by_size:  # noqa: N801 - used like a function: units=paramfsm.by_size(min_bytes=...)
    """A unit policy by size, like FSDP's size-based auto-wrap: ``units=paramfsm.by_size(min_bytes=...)``.

    Modules are visited bottom-up; a module becomes a unit once the parameters
    under it that no unit below it owns add up to ``min_bytes``, and the root
    takes whatever is left. A model of many tiny layers so gets a few units
    (one all-gather and one reduce-scatter each, far fewer hooks' worth of
    bookkeeping per step), while a model of big blocks keeps a unit per block.

    Use it when layers are small next to the fixed cost of a collective (a few
    tens of microseconds on gloo, more per launch on NCCL) or when per-layer
    Python overhead dominates the step. The price is memory: a unit is gathered
    whole, so ``min_bytes`` bounds how much is gathered at once beyond one
    layer. Tied parameters are counted once.
    """

    def __init__(self, min_bytes: int = 1 << 20):
        if isinstance(min_bytes, bool) or not isinstance(min_bytes, int):
            raise ArgumentTypeError(f"by_size(min_bytes={min_bytes!r}): expected a positive number of bytes")
        if min_bytes <= 0:
            raise ArgumentError(f"by_size(min_bytes={min_bytes!r}): expected a positive number of bytes")
        self.min_bytes = min_bytes

    def __repr__(self) -> str:
        return f"by_size(min_bytes={self.min_bytes})"

    def select(self, model: nn.Module) -> set[str]:
        """Qualified names of the unit modules (the root is added by the caller)."""
        chosen: set[str] = set()
        seen_params: set[int] = set()
        seen_modules: set[int] = set()

        def unowned_bytes(name: str, module: nn.Module) -> int:
            seen_modules.add(id(module))
            size = 0
            for p in module.parameters(recurse=False):
                if id(p) not in seen_params:
                    seen_params.add(id(p))
                    size += p.numel() * p.element_size()
            for child_name, child in module.named_children():
                if id(child) not in seen_modules:
                    size += unowned_bytes(f"{name}.{child_name}" if name else child_name, child)
            if name and size >= self.min_bytes:
                chosen.add(name)
                return 0
            return size

        unowned_bytes("", model)
        return chosen


Predicate = Callable[[str, nn.Module], bool]
UnitsArg = None | by_size | type | Predicate | Sequence[type | nn.Module | Predicate]

#: What ``units=`` takes, for the messages that refuse something else.
ACCEPTED = ("units= takes None (the default units), paramfsm.by_size(min_bytes=...), a predicate "
            "(qualified_name, module) -> bool, or a list of module classes (nn.Module subclasses), "
            "modules of the model and predicates")


class UnmatchedUnits(UserWarning):
    """A ``units=`` entry matches no module of the model while other entries do, so it has no effect."""


class UnitModules(dict):
    """Qualified name -> module of every unit, as :func:`select_unit_modules` chose them for one model.

    ``paramfsm.shard`` checks ``units=`` before it changes anything and hands the
    choice on in this form, so the entries are matched (and warned about) once.
    ``reasons`` says why each is a unit and ``merged`` which small modules joined it
    (the default units only), for ``rt.describe_units()``.
    """

    def __init__(self, items, reasons: dict[str, str], merged: dict[str, list[str]] | None = None):
        super().__init__(items)
        self.reasons = reasons
        self.merged = merged or {}


def select_unit_modules(model: nn.Module, units: UnitsArg, min_unit_bytes: int | None = None) -> UnitModules:
    """Qualified name -> module for every unit module, in module order; the root is always a unit.

    ``units`` may be None (the blocks the model declares in ``_no_split_modules``,
    the ``torch.nn`` modules that read their children's parameters, and every other
    module owning parameters directly, each merged into its parent when it holds
    less than ``min_unit_bytes`` (None: ``$PARAMFSM_MIN_UNIT_BYTES``, else 64 KiB):
    :mod:`paramfsm.engine.storage.default_units`; ``min_unit_bytes`` plays no part
    otherwise), a :class:`by_size` policy, a
    predicate ``(qualified_name, module) -> bool``, one module class, or a list
    whose entries are module classes, module instances of the model and
    predicates (a module is a unit when any entry selects it). A list where no
    class or instance matches anything raises :class:`~paramfsm.errors.ArgumentError`
    (the whole model would be one unit, gathered whole); one such entry among
    matching ones warns :class:`UnmatchedUnits`. A predicate may select nothing:
    ``lambda name, module: False`` makes the whole model one unit on purpose.
    """
    if isinstance(units, UnitModules):
        return units
    named = list(model.named_modules(remove_duplicate=True))
    if units is None:
        reasons, merged = choose(named, default_units.min_unit_bytes(min_unit_bytes))
        return UnitModules(((name, m) for name, m in named if name in reasons), reasons, merged)
    if isinstance(units, by_size):
        chosen = units.select(model)
    elif callable(units) and not isinstance(units, (type, nn.Module)):
        chosen = {name for name, m in named if units(name, m)}
    else:
        entries = unit_entries(units)
        matched = [_selected(named, entry) for entry in entries]
        _check_matched(model, named, entries, matched)
        chosen = set().union(*matched)
    why = repr(units) if isinstance(units, by_size) else "units="
    reasons = {name: why if name else ROOT_REASON for name, _ in named if name in chosen or not name}
    return UnitModules(((name, m) for name, m in named if name in reasons), reasons)


def unit_entries(units) -> tuple:
    """The entries of a ``units=`` list (a lone module class is one entry); refuses any other type of entry."""
    if isinstance(units, type):
        units = (units,)
    if isinstance(units, str):
        raise ArgumentTypeError(f"units={units!r}: {ACCEPTED}, not names. To make the module named {units!r} "
                                f"one unit, pass units=lambda name, module: name == {units!r}")
    if isinstance(units, nn.Module):
        raise ArgumentTypeError(f"units={_describe(units)}: {ACCEPTED}; pass units=[module] to make this module "
                                "one unit, or units=list(module.children()) for one unit per child")
    try:
        entries = tuple(units)
    except TypeError:
        raise ArgumentTypeError(f"units={units!r}: {ACCEPTED}") from None
    if not entries:
        raise ArgumentError(f"units={units!r} names no module: pass units=None for the default units, or "
                            "units=lambda name, module: False to make the whole model one unit")
    for entry in entries:
        if isinstance(entry, str):
            raise ArgumentTypeError(f"units=: the entry {entry!r} is a name; {ACCEPTED}. To make the module named "
                                    f"{entry!r} one unit, use the entry lambda name, module: name == {entry!r}")
        if isinstance(entry, type) and not issubclass(entry, nn.Module):
            raise ArgumentTypeError(f"units=: the entry {entry.__qualname__} is a class but not a module class "
                                    f"(an nn.Module subclass); {ACCEPTED}")
        if not callable(entry):
            raise ArgumentTypeError(f"units=: the entry {entry!r} (of type {type(entry).__name__}) is none of these: "
                                    f"{ACCEPTED}")
    return entries


def _selected(named: list[tuple[str, nn.Module]], entry) -> set[str]:
    """Qualified names of the modules one ``units=`` entry selects."""
    if isinstance(entry, type):
        return {name for name, m in named if isinstance(m, entry)}
    if isinstance(entry, nn.Module):
        return {name for name, m in named if m is entry}
    return {name for name, m in named if entry(name, m)}


def _check_matched(model: nn.Module, named, entries: tuple, matched: list[set[str]]) -> None:
    """Refuse a list of which nothing matches; warn about each class or instance entry that matches nothing."""
    unmatched = [entry for entry, names in zip(entries, matched)
                 if not names and isinstance(entry, (type, nn.Module))]
    if not unmatched:
        return
    if not any(matched):
        present = sorted({type(m).__name__ for _, m in named if any(True for _ in m.parameters(recurse=False))})
        raise ArgumentError(
            f"units=[{', '.join(_describe(e) for e in entries)}] matches no module of the model "
            f"({type(model).__name__}): {'; '.join(_no_match(e) for e in unmatched)}. The whole model would be one "
            "unit, gathered whole, which saves no memory. What to do: name classes the model contains (those owning "
            f"parameters: {', '.join(present) or 'none'}), modules of this model itself, or a predicate "
            "(qualified_name, module) -> bool; units=None keeps the default units")
    for entry in unmatched:
        warn_at_caller(UnmatchedUnits(
            f"units=: {_no_match(entry)}, so that entry has no effect and the other entries choose the units. "
            "What to do: remove it, or name a class the model contains or one of its own modules"))


def _no_match(entry) -> str:
    """Why a class or module entry of ``units=`` selects nothing."""
    if isinstance(entry, type):
        return f"no module of the model is an instance of {entry.__qualname__}"
    return f"{_describe(entry)} is not one of the model's own modules (a copy, or another model's module, is not)"


def _describe(entry) -> str:
    """A ``units=`` entry as a message names it: a class by name, a module by its one-line repr or its class."""
    if isinstance(entry, type):
        return entry.__qualname__
    if isinstance(entry, nn.Module):
        text = repr(entry)
        return text if "\n" not in text and len(text) <= 80 else f"<a {type(entry).__name__} module>"
    return getattr(entry, "__qualname__", None) or repr(entry)


def owner_unit(param_name: str, unit_names: Iterable[str]) -> str:
    """The nearest enclosing unit module name of a qualified parameter name."""
    parts = param_name.split(".")[:-1]
    names = set(unit_names)
    while parts:
        candidate = ".".join(parts)
        if candidate in names:
            return candidate
        parts.pop()
    return ""


def check_partitionable(model: nn.Module) -> None:
    """Reject models paramfsm cannot partition, with a message that says what to do."""
    for name, p in model.named_parameters():
        if not p.is_floating_point():
            raise ParamFSMError(
                f"parameter '{name}' has dtype {p.dtype}; paramfsm partitions floating-point "
                "parameters only (register integer tensors as buffers)")


def make_shard(param: torch.Tensor, rank: int, world: int,
               device: torch.device | None = None) -> tuple[nn.Parameter, int]:
    """This rank's 1/world slice of the flattened, zero-padded parameter, as a leaf Parameter.

    Only the slice is copied (no full-size padded temporary). A parameter on the
    meta device has no values: its shard is allocated on ``device``, uninitialised
    (see :mod:`paramfsm.sharding.meta` for what guards it until values are set).
    """
    numel = param.numel()
    shard_numel = -(-numel // world)
    if param.is_meta:
        shard = torch.empty(shard_numel, dtype=param.dtype, device=device)
        shard[max(0, min(shard_numel, numel - rank * shard_numel)):].zero_()  # the padding
    else:
        lo, hi = min(rank * shard_numel, numel), min((rank + 1) * shard_numel, numel)
        shard = torch.empty(shard_numel, dtype=param.dtype, device=param.device)
        shard[: hi - lo].copy_(param.detach().reshape(-1)[lo:hi])
        shard[hi - lo:].zero_()
    return nn.Parameter(shard, requires_grad=param.requires_grad), shard_numel


def let_go(param: nn.Parameter, device: torch.device | None) -> None:
    """Drop the full values of a parameter whose shard is cut, so a model is never held twice.

    A meta parameter cannot take a real ``.data`` (the tensor types differ), so its
    contents are swapped for an empty parameter on ``device``, keeping its identity.
    """
    if param.is_meta:
        torch.utils.swap_tensors(param, nn.Parameter(torch.empty(0, dtype=param.dtype, device=device),
                                                     requires_grad=param.requires_grad))
    else:
        param.data = torch.empty(0, dtype=param.dtype, device=param.device)


def build_units(model: nn.Module, units: UnitsArg, rank: int, world: int, *, device: torch.device | None = None,
                release: bool = False) -> tuple[list[Unit], dict[int, ParamRecord]]:
    """Shard every parameter and group the records into units; returns (units, records by id(param)).

    ``release``: drop each full parameter as soon as its shard is cut
    (:func:`let_go`), so sharding a model never holds it plus all of its shards;
    a meta parameter is always released (its shard goes on ``device``).
    """
    check_partitionable(model)
    unit_modules = select_unit_modules(model, units)
    records: dict[int, ParamRecord] = {}
    members: dict[str, list[ParamRecord]] = {name: [] for name in unit_modules}
    for name, param in model.named_parameters(remove_duplicate=False):
        rec = records.get(id(param))
        if rec is None:
            shard, shard_numel = make_shard(param, rank, world, device)
            rec = records[id(param)] = ParamRecord(name, param, shard, shard_numel)
            if release or param.is_meta:
                let_go(param, device)
        elif name not in rec.names:
            rec.names = rec.names + (name,)
        owner = owner_unit(name, unit_modules)
        if rec not in members[owner]:
            members[owner].append(rec)
    built = []
    for name, module in unit_modules.items():
        if members[name] or not name:  # the root always: it may read others' parameters (on_demand)
            built.append(Unit(len(built), name, module, members[name], unit_modules.reasons[name],
                              unit_modules.merged.get(name, ())))
    for unit in built:
        for rec in unit.records:
            rec.units = rec.units + (unit,)
            if not rec.unit:
                rec.unit = unit.name
    return built, records


def units_within(model: nn.Module, units: list[Unit], modules) -> list[Unit]:
    """The units of ``modules`` and of every module below them (all units when ``modules`` is empty), and the
    units holding their parameters: a module merged into its parent's unit (the default units) is held
    through that unit."""
    wanted = {id(m) for m in modules}
    if not wanted:
        return list(units)
    params = {id(p) for m in modules for p in m.parameters()}
    return [unit for unit in units if any(id(m) in wanted for m in _path(model, unit.name))
            or any(id(rec.param) in params for rec in unit.records)]


def _path(model: nn.Module, unit_name: str):
    """The unit's module and every module above it."""
    yield model
    module = model
    for part in (unit_name.split(".") if unit_name and unit_name != ROOT else []):
        module = getattr(module, part)
        yield module
