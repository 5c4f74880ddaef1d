"""The scheduler's concerns are components that own their state, not mixins sharing one namespace.

Read from the source of ``paramfsm/engine/schedule/``: no class there derives
from another class of the engine (the old ``Scheduler(BackwardHandlers, ...)``
shape), and no class reads or writes a data attribute that another class of
the room assigns, through one of its own references (``self.<ref>.<attr>``).
Components ask each other through methods; the plain records they share
(``TaskState``, ``PassState``, ``Plan``, an offloaded value's ``Paged``) are exempt. Each rule is shown to
catch a planted violation.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOM = Path(__file__).resolve().parent.parent / "paramfsm" / "engine" / "schedule"
#: Plain records whose fields their holders read directly.
RECORDS = {"TaskState", "PassState", "Plan", "Paged"}


def _classes(sources: dict[str, str]) -> dict[str, ast.ClassDef]:
    found = {}
    for text in sources.values():
        for node in ast.parse(text).body:
            if isinstance(node, ast.ClassDef):
                found[node.name] = node
    return found


def _assigned(cls: ast.ClassDef) -> set[str]:
    """The data attributes a class assigns to itself (``self.x = ...``, ``self.x += ...``, ``__slots__``)."""
    names = set()
    for node in ast.walk(cls):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                    names.add(sub.attr)
    return names


def _methods(cls: ast.ClassDef) -> set[str]:
    return {node.name for node in cls.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def mixins(sources: dict[str, str]) -> list[str]:
    """Classes of the room that derive from another class of the room."""
    classes = _classes(sources)
    return [f"{name}({base.id})" for name, cls in classes.items() for base in cls.bases
            if isinstance(base, ast.Name) and base.id in classes]


def foreign_reads(sources: dict[str, str]) -> list[str]:
    """``self.<ref>.<attr>`` where ``attr`` is a data attribute of another component, not a method of it."""
    classes = _classes(sources)
    owners: dict[str, set[str]] = {}
    for name, cls in classes.items():
        if name in RECORDS:
            continue
        for attr in _assigned(cls) - _methods(cls):
            owners.setdefault(attr, set()).add(name)
    bad = []
    for name, cls in classes.items():
        own = _assigned(cls)
        for node in ast.walk(cls):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                    and isinstance(node.value.value, ast.Name) and node.value.value.id == "self"
                    and node.value.attr in own and node.attr in owners and name not in owners[node.attr]):
                bad.append(f"{name}: self.{node.value.attr}.{node.attr} (owned by {', '.join(sorted(owners[node.attr]))})")
    return bad


def _room() -> dict[str, str]:
    return {path.name: path.read_text() for path in sorted(ROOM.glob("*.py"))}


def test_no_component_is_a_mixin():
    assert mixins(_room()) == []


def test_no_component_touches_another_components_attributes():
    assert foreign_reads(_room()) == []


def test_the_rules_see_violations():
    planted = {
        "a.py": "class Deferral:\n    def __init__(self):\n        self.bytes = 0\n",
        "b.py": ("class Tasks:\n    def __init__(self, deferral):\n        self._deferral = deferral\n"
                 "    def f(self):\n        return self._deferral.bytes\n"),
        "c.py": "class Scheduler(Deferral):\n    pass\n",
    }
    assert mixins(planted) == ["Scheduler(Deferral)"]
    assert foreign_reads(planted) == ["Tasks: self._deferral.bytes (owned by Deferral)"]
    planted["b.py"] = planted["b.py"].replace("self._deferral.bytes", "self._deferral.size()")
    assert foreign_reads(planted) == []


def test_each_component_owns_what_it_is_documented_to_own():
    """The attribute lists the closing notes quote, read from the source (a rename shows up here)."""
    classes = _classes(_room())
    owned = {name: _assigned(classes[name]) for name in
             ("Prefetch", "Deferral", "ForwardHolds", "GraphTasks", "GradRouting", "OnDemand", "LeakAudit")}
    assert {"fwd_plan", "bwd_plan", "forward", "forward_open", "_batch"} <= owned["Prefetch"]
    assert {"deferred", "bytes", "peak_bytes", "allowed", "bound"} <= owned["Deferral"]
    assert {"keep_after_forward", "kept", "outside"} <= owned["ForwardHolds"]
    assert {"tasks", "tasks_begun"} <= owned["GraphTasks"]
    assert {"sync", "staged_grads", "grad_plans", "grad_nodes", "zero_filled"} <= owned["GradRouting"]
    assert {"forwards", "warned"} <= owned["OnDemand"]
    assert {"last"} <= owned["LeakAudit"]
