"""The package's layers, read from its imports: core is pure, the engine never reaches up, verify is a product.

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
    """The engine builds on the core alone: no facade module, no verify/, no testing/."""
    top = _top(name)
    return top is not None and top not in ("core", "engine", "errors")


def verify_forbids(name: str) -> bool:
    """verify/ is a product: it builds on the facade and the layers below it, never on our own test kit."""
    return _top(name) == "testing"


def _room(name: str) -> str | None:
    """``paramfsm.engine.R...`` -> ``R`` (one of :data:`ROOMS`); anything else -> None."""
    parts = name.split(".")
    return parts[2] if parts[:2] == ["paramfsm", "engine"] and len(parts) > 2 else None


#: The engine's rooms and the rooms each may import besides itself (the core and errors always).
#: The schedule steps the FSM and drives the rest; effects run what it asks on the storage; events only
#: emit (see paramfsm/engine/__init__.py).
ROOMS = {"events": (), "schedule": ("events", "effects", "storage"), "effects": ("storage",), "storage": ()}


def room_forbids(room: str):
    """The rule of one engine room: the engine's own rule, plus only the rooms :data:`ROOMS` allows."""
    allowed = (room, *ROOMS[room])

    def forbids(name: str) -> bool:
        if engine_forbids(name):
            return True
        if _top(name) != "engine":
            return False
        return _room(name) not in allowed
    return forbids


def planning_forbids(name: str) -> bool:
    """planning/ rehearses the runtime as training runs it: the facade and below, never a product built on it."""
    return _top(name) in ("verify", "testing", "checkpoint", "integrations")


def optim_forbids(name: str) -> bool:
    """sharding/ and optim/ are what shard() does and what a step needs: checkpoints, integrations, plans,
    verify and the test kit are built on them, never the reverse."""
    return _top(name) in ("checkpoint", "integrations", "planning", "verify", "testing")


def sharding_forbids(name: str) -> bool:
    """sharding/ stands below optim/ (whose step reads full tensors and refuses unsynced gradients through it)
    and below the facade that wires the two (``paramfsm.shard`` installs the optimizer's step hook)."""
    return optim_forbids(name) or _top(name) in ("optim", "runtime")


#: What the top level holds: what users import or run. Everything else is in a folder of its concern.
TOP_LEVEL = {"__init__.py", "__main__.py", "amp.py", "cli.py", "errors.py", "runtime.py"}

FORBIDS = {"core": core_forbids, "engine": engine_forbids, "verify": verify_forbids, "planning": planning_forbids,
           "sharding": sharding_forbids, "optim": optim_forbids,
           **{f"engine/{room}": room_forbids(room) for room in ROOMS}}


@pytest.mark.parametrize("layer", sorted(FORBIDS))
def test_layer_imports_only_downwards(layer):
    assert _violations(layer, FORBIDS[layer]) == []


def test_every_engine_module_is_in_a_room():
    loose = [path.name for path in (PACKAGE / "engine").glob("*.py") if path.name != "__init__.py"]
    assert loose == [], "modules of paramfsm/engine/ belong in one of its rooms: " + ", ".join(ROOMS)


def test_the_top_level_holds_only_what_users_import_or_run():
    modules = {path.name for path in PACKAGE.glob("*.py")}
    assert modules == TOP_LEVEL, f"move {sorted(modules - TOP_LEVEL)} into the folder of its concern"


def test_the_check_sees_violations(tmp_path, monkeypatch):
    """The rule itself must be able to fail: plant each kind of bad import and see it reported."""
    fake = tmp_path / "paramfsm"
    for layer, line in [("core", "import torch.distributed as dist"),
                        ("core", "from paramfsm.engine import hooks"),
                        ("core", "from paramfsm.verify import engine"),
                        ("core", "import paramfsm.testing.models"),
                        ("engine", "from paramfsm.testing import reference"),
                        ("engine", "from paramfsm.verify import faults"),
                        ("engine", "def f():\n    from paramfsm import runtime\n"),
                        ("verify", "from paramfsm.testing import models"),
                        ("verify", "def f():\n    import paramfsm.testing.subjects\n"),
                        ("planning", "from paramfsm.verify import runner"),
                        ("planning", "def f():\n    import paramfsm.checkpoint\n"),
                        ("sharding", "from paramfsm.checkpoint import saving"),
                        ("sharding", "def f():\n    import paramfsm.integrations.hf\n"),
                        ("sharding", "from paramfsm.verify import runner"),
                        ("sharding", "from paramfsm import optim"),
                        ("sharding", "def f():\n    from paramfsm.optim import grad_norm\n"),
                        ("sharding", "from paramfsm.runtime import Runtime"),
                        ("optim", "from paramfsm import checkpoint"),
                        ("optim", "def f():\n    from paramfsm.planning import measure\n"),
                        ("engine/events", "from paramfsm.engine.schedule.plan import PassState"),
                        ("engine/events", "from paramfsm.engine.storage import partitioned"),
                        ("engine/effects", "from paramfsm.engine.schedule import grad_order"),
                        ("engine/effects", "def f():\n    from paramfsm.engine.events import hooks\n"),
                        ("engine/storage", "from paramfsm.engine.schedule.on_demand import gather"),
                        ("engine/storage", "import paramfsm.engine.effects.kernels"),
                        ("engine/storage", "from paramfsm.engine.events import hooks"),
                        ("engine/schedule", "from paramfsm import runtime"),
                        ("engine/schedule", "from paramfsm.engine import nowhere")]:
        (fake / layer).mkdir(parents=True, exist_ok=True)
        (fake / layer / "bad.py").write_text(line + "\n")
        monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake)
        assert len(_violations(layer, FORBIDS[layer])) == 1, line
        (fake / layer / "bad.py").unlink()


def test_core_may_import_errors_and_itself():
    assert not core_forbids("paramfsm.errors")
    assert not core_forbids("paramfsm.core.spec")
    assert not core_forbids("attrs")
    assert not engine_forbids("paramfsm.core.fsm")
    assert not engine_forbids("paramfsm.engine.effects.kernels")


def test_rooms_may_import_what_they_stand_on():
    assert not room_forbids("schedule")("paramfsm.engine.effects.executor")
    assert not room_forbids("schedule")("paramfsm.engine.events.events")
    assert not room_forbids("effects")("paramfsm.engine.storage.units")
    assert not room_forbids("storage")("paramfsm.core.fsm")
    assert not room_forbids("events")("paramfsm.engine.events.graph_task")


def test_verify_may_import_the_facade_and_below():
    for name in ("paramfsm.runtime", "paramfsm.verify.launch", "paramfsm.engine.storage.units", "paramfsm.core.trace",
                 "paramfsm.verify.faults", "hypothesis"):
        assert not verify_forbids(name), name


def _imported_names(path: Path) -> list[tuple[str, str]]:
    """``(module, name)`` for every ``from module import name`` in ``path`` (``(module, "")`` for ``import``)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            found += [(node.module, alias.name) for alias in node.names]
    return found


def _cycle(layer: str) -> list[str]:
    """One import circle among the modules of ``layer`` (lazy imports count), or []."""
    paths = {_module_name(path): path for path in sorted((PACKAGE / layer).rglob("*.py"))}
    # ``from paramfsm.core import replay`` imports the module paramfsm.core.replay.
    graph = {module: {f"{name}.{alias}" if f"{name}.{alias}" in paths else name
                      for name, alias in _imported_names(path)}
             for module, path in paths.items()}
    for start in graph:
        stack, seen = [(start, [start])], set()
        while stack:
            module, chain = stack.pop()
            for name in graph.get(module, ()):
                if name == start:
                    return chain + [start]
                if name in graph and name not in seen:
                    seen.add(name)
                    stack.append((name, chain + [name]))
    return []


def test_core_has_no_import_circle():
    assert _cycle("core") == []


def test_the_circle_check_sees_a_circle(tmp_path, monkeypatch):
    fake = tmp_path / "paramfsm" / "core"
    fake.mkdir(parents=True)
    (fake / "a.py").write_text("from paramfsm.core.b import x\n")
    (fake / "b.py").write_text("def f():\n    from paramfsm.core import a\n")
    monkeypatch.setattr(sys.modules[__name__], "PACKAGE", fake.parent)
    assert _cycle("core") in (["paramfsm.core.a", "paramfsm.core.b", "paramfsm.core.a"],
                              ["paramfsm.core.b", "paramfsm.core.a", "paramfsm.core.b"])
