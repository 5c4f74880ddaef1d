"""What the package declares matches what its code needs; the checkout reads the one copy of the spec.

The built wheel itself is checked by ``.ci/check_wheel.py`` (``make check-wheel``; CI runs it after
``make test``): it builds, installs and uses the wheel away from the checkout, in about two minutes.
These are the fast halves that need no build.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from fnmatch import fnmatch
from pathlib import Path

import paramfsm
from paramfsm.core.spec import DEFAULT_SPEC, shipped_spec

REPO = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
#: Import name -> the distribution that provides it, where the two differ.
DISTRIBUTIONS = {"cupy": "cupy-cuda13x"}


def _names(requirements: list[str]) -> set[str]:
    """Distribution names of requirement strings, normalised (``paramfsm[hf]`` itself left out)."""
    names = {re.match(r"[A-Za-z0-9._-]+", req).group(0).lower().replace("_", "-") for req in requirements}
    return names - {"paramfsm"}


def _third_party_imports() -> dict[str, list[str]]:
    """Top-level module -> the files under paramfsm/ that import it, for every module not in the standard library."""
    found: dict[str, list[str]] = {}
    for path in sorted((REPO / "paramfsm").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top != "paramfsm" and top not in sys.stdlib_module_names:
                    found.setdefault(top, []).append(str(path.relative_to(REPO)))
    return found


def test_the_checkout_reads_the_spec_in_specs():
    """No second copy shadows ``specs/`` (a wheel's copy is made at build time, outside the source tree)."""
    assert DEFAULT_SPEC == shipped_spec()
    assert DEFAULT_SPEC.samefile(REPO / "specs" / "param_lifetime.toml")
    assert not (REPO / "paramfsm" / "specs").exists()


def test_every_third_party_import_is_a_declared_requirement():
    declared = _names(PROJECT["project"]["dependencies"])
    for requirements in PROJECT["project"]["optional-dependencies"].values():
        declared |= _names(requirements)
    undeclared = {module: files for module, files in _third_party_imports().items()
                  if DISTRIBUTIONS.get(module, module).lower() not in declared}
    assert undeclared == {}


def _extra(name: str) -> set[str]:
    """The distributions an extra brings, its ``paramfsm[...]`` references followed."""
    requirements = PROJECT["project"]["optional-dependencies"][name]
    brought = _names(requirements)
    for req in requirements:
        if req.startswith("paramfsm["):
            for inner in req[len("paramfsm["):-1].split(","):
                brought |= _extra(inner.strip())
    return brought


def test_each_integration_is_brought_by_the_extra_of_its_name():
    """``paramfsm/integrations/<name>.py`` imports only what ``paramfsm[<name>]`` installs (helpers: ``hf``)."""
    extras = PROJECT["project"]["optional-dependencies"]
    core = _names(PROJECT["project"]["dependencies"])
    needs: dict[str, set[str]] = {}
    for module, files in _third_party_imports().items():
        for f in files:
            if f.startswith("paramfsm/integrations/") and not f.endswith("__init__.py"):
                stem = Path(f).stem
                needs.setdefault(stem if stem in extras else "hf", set()).add(DISTRIBUTIONS.get(module, module))
    assert {"hf", "accelerate", "lightning"} <= needs.keys()
    missing = {extra: wanted - core - _extra(extra) for extra, wanted in needs.items()}
    assert all(not gap for gap in missing.values()), missing
    assert "accelerate" in _extra("hf")  # ShardedTrainer: transformers.Trainer needs accelerate
    assert "hypothesis" in _extra("verify") and "cupy-cuda13x" in _extra("cuda")
    brought_by_test = _extra("test")
    assert all(_extra(name) <= brought_by_test for name in extras if name != "cuda")  # the suite runs them all


def test_the_version_has_one_source():
    assert "version" not in PROJECT["project"] and "version" in PROJECT["project"]["dynamic"]
    assert PROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "paramfsm.__version__"}
    assert re.fullmatch(r"\d+\.\d+\.\d+", paramfsm.__version__)


def test_every_data_file_in_the_package_is_declared_package_data():
    """A file under paramfsm/ that is not Python ships only if package-data names it."""
    package_data = PROJECT["tool"]["setuptools"]["package-data"]
    data = [path for path in (REPO / "paramfsm").rglob("*")
            if path.is_file() and path.suffix not in (".py", ".pyc") and "__pycache__" not in path.parts]
    assert data, "pack.cu, at least"
    for path in data:
        package = ".".join(path.parent.relative_to(REPO).parts)
        assert any(fnmatch(path.name, pattern) for pattern in package_data.get(package, ())), path
