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


def test_the_extras_bring_what_their_features_import():
    extras = {name: _names(reqs) for name, reqs in PROJECT["project"]["optional-dependencies"].items()}
    imports = _third_party_imports()
    core = _names(PROJECT["project"]["dependencies"])
    hf = {DISTRIBUTIONS.get(module, module) for module, files in imports.items()
          if any(f.startswith("paramfsm/integrations/") for f in files)} - core
    assert "transformers" in hf
    assert hf | {"accelerate"} <= extras["hf"]  # ShardedTrainer: transformers.Trainer needs accelerate
    assert "hypothesis" in extras["verify"] and "cupy-cuda13x" in extras["cuda"]
    assert "paramfsm[hf,verify]" in PROJECT["project"]["optional-dependencies"]["test"]  # the suite runs both


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
