"""The package's layers, read from its imports: core is pure, the engine never reaches up.

``make lint`` runs this file on its own; ``make test`` runs it with the rest.
Every ``import``/``from`` statement counts, including those inside functions,
so a lazy import cannot slip past the rule.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "paramfsm"
FACADE = {"runtime", "cli", "checkpoint", "full_state", "grad_norm", "integrations", "launch", "demo", "__main__"}
# Third-party modules the pure core may not touch: it must load without a process group or a GPU.
IMPURE = ("torch", "cupy")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every absolute module an import statement in ``path`` names, with its line."""
    tree = ast.parse(path.read_text(), filename=str(path))
    module = _module_name(path)
    # The package a relative import starts from: the module itself for an __init__.py.
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found += [(node.lineno, f"{base}.{alias.name}" if base == "paramfsm" else base)
                      for alias in node.names]
    return found


def _violations(layer: str, forbidden) -> list[str]:
    bad = []
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        for line, name in _imports(path):
            if forbidden(name):
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {name}")
    return bad


def _top(name: str) -> str | None:
    """``paramfsm.X...`` -> ``X``; anything else -> None."""
    parts = name.split(".")
    return parts[1] if parts[0] == "paramfsm" and len(parts) > 1 else None


def core_forbids(name: str) -> bool:
    top = _top(name)
    if name.split(".")[0] in IMPURE:
        return True
    return top is not None and top not in ("core", "errors")


def engine_forbids(name: str) -> bool:
    top = _top(name)
    return top is not None and (top == "testing" or top in FACADE)


@pytest.mark.parametrize("layer, forbidden", [("core", core_forbids), ("engine", engine_forbids)])
def test_layer_imports_only_downwards(layer, forbidden):
    assert _violations(layer, forbidden) == []


def test_the_check_sees_violations(tmp_path, monkeypatch):
    """The rule itself must be able to fail: plant each kind of bad import and see it reported."""
    fake = tmp_path / "paramfsm"
    for layer, line in [("core", "import torch.distributed as dist"),
                        ("core", "from paramfsm.engine import hooks"),
                        ("engine", "from paramfsm.testing import faults"),
                        ("engine", "def f():\n    from paramfsm import runtime\n")]:
        (fake / layer).mkdir(parents=True, exist_ok=True)
        (fake / layer / "bad.py").write_text(line + "\n")
        monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
        forbidden = core_forbids if layer == "core" else engine_forbids
        assert len(_violations(layer, forbidden)) == 1, line
        (fake / layer / "bad.py").unlink()


def test_core_may_import_errors_and_itself():
    assert not core_forbids("paramfsm.errors")
    assert not core_forbids("paramfsm.core.spec")
    assert not core_forbids("attrs")
    assert not engine_forbids("paramfsm.core.fsm")
    assert not engine_forbids("paramfsm.engine.kernels")
