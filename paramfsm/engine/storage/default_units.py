"""The default unit choice: the blocks a user would wrap, with small modules merged into their parent.

Three rules, in this order:

1. **Declared blocks.** A model that names its blocks in ``_no_split_modules`` (every
   Hugging Face ``PreTrainedModel`` does, and Accelerate's FSDP auto-wrap wraps exactly
   those) gets each instance of those classes as one unit, everything inside it included.
2. **Modules that read their children's parameters** stay whole. ``nn.MultiheadAttention``
   passes ``out_proj.weight`` to ``F.multi_head_attention_forward`` itself instead of calling
   ``out_proj``; ``nn.TransformerEncoderLayer`` and ``nn.TransformerDecoderLayer`` read their
   attention's and linears' weights on their fast paths. Were their children units of their
   own, the parent's forward would find those parameters not gathered (paramfsm would gather
   them on demand, see :mod:`paramfsm.engine.schedule.on_demand`, at the cost of an extra
   collective each). ``nn.TransformerEncoder``, ``nn.TransformerDecoder`` and ``nn.Transformer``
   only read metadata of their layers' parameters, so their layers stay units of their own.
   Everywhere else, every module that owns parameters directly is a candidate (the embeddings,
   the head and the final norm of a language model among them).
3. **Small modules merge.** Bottom-up, a candidate whose parameters, together with those of
   its children that are not units, add up to less than ``min_unit_bytes`` is no unit: its
   parameters join the nearest enclosing unit (the root at the latest). A unit costs a fixed
   amount of Python per step and a collective launch, whatever its size; below
   :data:`MIN_UNIT_BYTES` that cost outweighs the memory a separate gather would save
   (``benchmarks/default_units.py`` measures it). Merging never splits a declared block or a
   module of rule 2: a small one joins its parent whole. A parameter tied between modules counts
   in each module that registers it, as each would gather it.

:func:`choose` returns each unit's reason too, for ``rt.describe_units()``.
"""

from __future__ import annotations

import os

from torch import nn

#: ``torch.nn`` modules whose forward reads parameters of their submodules.
READS_CHILDREN: tuple[type, ...] = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)

#: The default ``min_unit_bytes`` of ``paramfsm.shard`` (see ``benchmarks/default_units.py``).
MIN_UNIT_BYTES = 64 << 10
#: The environment variable that overrides :data:`MIN_UNIT_BYTES` where ``min_unit_bytes`` is not given.
MIN_UNIT_BYTES_ENV = "PARAMFSM_MIN_UNIT_BYTES"


def min_unit_bytes(value: int | None = None) -> int:
    """``value`` if given, else ``$PARAMFSM_MIN_UNIT_BYTES``, else :data:`MIN_UNIT_BYTES`.

    The variable lets a whole program (a test suite of small models, a comparison
    run) keep one unit per parameter-owning module (``0``) without touching each
    ``shard()`` call; it is read when ``shard()`` is called.
    """
    if value is not None:
        return value
    text = os.environ.get(MIN_UNIT_BYTES_ENV, "").strip()
    if not text:
        return MIN_UNIT_BYTES
    try:
        parsed = int(text)
    except ValueError:
        parsed = -1
    if parsed < 0:
        raise ValueError(f"{MIN_UNIT_BYTES_ENV}={text!r}: expected a number of bytes >= 0 (0: no module merges)")
    return parsed

#: The reasons :func:`choose` gives, as ``rt.describe_units()`` prints them.
DECLARED, WHOLE, PER_MODULE, ROOT_REASON = "_no_split_modules", "reads its children", "owns parameters", "root"


def owns_parameters(module: nn.Module) -> bool:
    """Whether ``module`` registers a parameter itself (a candidate of rule 2)."""
    return any(True for _ in module.parameters(recurse=False))


def declared_blocks(named: list[tuple[str, nn.Module]]) -> frozenset[str]:
    """Class names that some module of the model declares in ``_no_split_modules``."""
    names: set[str] = set()
    for _, module in named:
        declared = getattr(module, "_no_split_modules", None)
        if isinstance(declared, (list, tuple, set, frozenset)):
            names.update(n for n in declared if isinstance(n, str))
    return frozenset(names)


def choose(named: list[tuple[str, nn.Module]], min_bytes: int = MIN_UNIT_BYTES
           ) -> tuple[dict[str, str], dict[str, list[str]]]:
    """The default units among ``named`` (``model.named_modules()``, root first).

    Returns ``(reasons, merged)``: qualified name -> why it is a unit (the root ``""``
    always is), and qualified name -> the candidates merged into that unit because small.
    """
    blocks = declared_blocks(named)
    whole: list[str] = []
    reasons: dict[str, str] = {}
    for name, module in named:
        if any(_below(name, outer) for outer in whole):
            continue
        if type(module).__name__ in blocks:
            whole.append(name)
            reasons[name] = f"{DECLARED} ({type(module).__name__})"
        elif isinstance(module, READS_CHILDREN):
            whole.append(name)
            reasons[name] = f"{WHOLE} ({type(module).__name__})"
        elif owns_parameters(module):
            reasons[name] = PER_MODULE
    pending: dict[str, int] = {}  # bytes under a module that no unit below it owns
    small: dict[str, list[str]] = {}  # candidates below a module merged into whatever owns it
    for name, module in reversed(named):
        size = pending.pop(name, 0) + sum(p.numel() * p.element_size() for p in module.parameters(recurse=False))
        absorbed = small.pop(name, [])
        if name and name in reasons and size < min_bytes:
            del reasons[name]
            absorbed = [name] + absorbed
        elif name in reasons or not name:
            if absorbed:
                small[name] = absorbed
                absorbed = []
            size = 0
        if name:
            parent = name.rpartition(".")[0]
            pending[parent] = pending.get(parent, 0) + size
            small.setdefault(parent, []).extend(absorbed)
    merged = {name: sorted(small.pop(name, []), key=_order(named)) for name in reasons}
    merged[""] = sorted(small.get("", []), key=_order(named))
    reasons[""] = ROOT_REASON
    return reasons, {name: names for name, names in merged.items() if names}


def _order(named: list[tuple[str, nn.Module]]):
    """A sort key that puts qualified names in module order."""
    position = {name: i for i, (name, _) in enumerate(named)}
    return position.__getitem__


def _below(name: str, outer: str) -> bool:
    """Whether module ``name`` lies strictly inside module ``outer``."""
    return name != outer and (outer == "" or name.startswith(outer + "."))


def one_unit(module_name: str) -> str:
    """A ``units=`` predicate, as text, that makes ``module_name`` one unit owning everything below it
    and keeps one unit per parameter-owning module elsewhere (for messages that say how to merge units)."""
    if not module_name:
        return "lambda name, module: name == ''"
    return (f"lambda name, module: name == {module_name!r} or (not name.startswith({module_name + '.'!r}) "
            "and any(True for _ in module.parameters(recurse=False)))")


def describe(units) -> str:
    """A table of ``units`` (:class:`~paramfsm.engine.storage.units.Unit`): module, parameters, bytes and why.

    Bytes are the full (gathered) size of the unit's parameters, a tied one in every
    unit that holds it; the modules merged into a unit because small follow its reason.
    """
    rows = [("unit", "module", "params", "elements", "bytes", "why")]
    for unit in units:
        why = unit.reason or PER_MODULE
        if unit.merged:
            shown = ", ".join(unit.merged[:_SHOWN])
            more = f" and {len(unit.merged) - _SHOWN} more" if len(unit.merged) > _SHOWN else ""
            why += f"; merged into it because smaller than min_unit_bytes: {shown}{more}"
        rows.append((str(unit.index), unit.name, str(len(unit.records)),
                     f"{sum(r.numel for r in unit.records):,}", f"{unit.nbytes:,}", why))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[-1] for row in rows)


#: How many merged module names a row of :func:`describe` names before it counts the rest.
_SHOWN = 8
