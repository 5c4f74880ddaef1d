"""The default unit choice: every module that owns parameters directly, except inside the
``torch.nn`` modules whose forward reads their children's parameters, which are one unit each.

``nn.MultiheadAttention`` passes ``out_proj.weight`` to ``F.multi_head_attention_forward``
itself instead of calling ``out_proj``; ``nn.TransformerEncoderLayer`` and
``nn.TransformerDecoderLayer`` read their attention's and linears' weights on their fast paths.
Were their children units of their own, the parent's forward would find those parameters
not gathered (paramfsm would gather them on demand, see :mod:`paramfsm.engine.schedule.on_demand`, at
the cost of an extra collective each). As one unit, the whole module is gathered in one
collective, which is what a user would choose by hand. ``nn.TransformerEncoder``,
``nn.TransformerDecoder`` and ``nn.Transformer`` only read metadata of their layers' parameters
(to decide against their inference fast path), so their layers stay units of their own and a
deep stack is still gathered one layer at a time.
"""

from __future__ import annotations

from torch import nn

#: ``torch.nn`` modules whose forward reads parameters of their submodules.
READS_CHILDREN: tuple[type, ...] = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


def owns_parameters(module: nn.Module) -> bool:
    """Whether ``module`` registers a parameter itself (the default unit rule)."""
    return any(True for _ in module.parameters(recurse=False))


def default_unit_names(named: list[tuple[str, nn.Module]]) -> set[str]:
    """Qualified names of the default units among ``named`` (``model.named_modules()``)."""
    whole = [name for name, m in named if isinstance(m, READS_CHILDREN)]
    chosen = {name for name, m in named if owns_parameters(m)} | set(whole)
    return {name for name in chosen if not any(_below(name, outer) for outer in whole)}


def _below(name: str, outer: str) -> bool:
    """Whether module ``name`` lies strictly inside module ``outer``."""
    return name != outer and (outer == "" or name.startswith(outer + "."))


def one_unit(module_name: str) -> str:
    """A ``units=`` predicate, as text, that makes ``module_name`` one unit owning everything below it
    and keeps the default units elsewhere (for messages that say how to merge units)."""
    if not module_name:
        return "lambda name, module: name == ''"
    return (f"lambda name, module: name == {module_name!r} or (not name.startswith({module_name + '.'!r}) "
            "and any(True for _ in module.parameters(recurse=False)))")
