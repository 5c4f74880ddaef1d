"""The public names of DESIGN §4 and the README resolve where they are documented."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

import paramfsm

RUNTIME_METHODS = ("state", "states", "shard_parameters", "named_shard_parameters", "full_param", "full_grad",
                   "full_state_dict", "load_full_state_dict", "sharded_state_dict", "load_sharded_state_dict",
                   "clip_grad_norm_", "set_step", "backward", "flush", "reset", "gathered", "generate", "detach",
                   "close", "counters", "deferred_bytes")
#: ``paramfsm.shard``'s parameters and defaults as DESIGN §4 writes them.
SHARD_DEFAULTS = {"group": None, "units": None, "retain": "defer", "max_deferred_bytes": None, "prefetch": 1,
                  "trace": False, "spec": None}


@pytest.mark.parametrize("name", paramfsm.__all__)
def test_package_names_resolve(name):
    assert getattr(paramfsm, name) is not None


def test_runtime_offers_the_documented_methods():
    assert [name for name in RUNTIME_METHODS if not hasattr(paramfsm.Runtime, name)] == []


def test_shard_keeps_its_documented_parameters():
    params = inspect.signature(paramfsm.shard).parameters
    assert list(params)[:len(SHARD_DEFAULTS) + 1] == ["model", *SHARD_DEFAULTS]
    assert {name: params[name].default for name in SHARD_DEFAULTS} == SHARD_DEFAULTS


def test_verification_lives_in_paramfsm_verify_and_testing_re_exports_it():
    import paramfsm.testing
    import paramfsm.verify

    assert paramfsm.verify.Subject is paramfsm.testing.Subject
    assert paramfsm.verify.verify_model is paramfsm.testing.verify_model
    assert paramfsm.verify.VerificationFailed is paramfsm.testing.VerificationFailed
    assert paramfsm.verify.verify_model.__module__ == "paramfsm.verify.search"


@pytest.mark.parametrize("module", ["paramfsm.verify.faults", "paramfsm.testing.subjects", "paramfsm.verify.command",
                                    "paramfsm.testing.mutants"])
def test_documented_modules_import(module):
    assert importlib.import_module(module) is not None


def test_the_fault_catalogue_has_one_name():
    from paramfsm.verify import faults

    assert faults.CATALOGUE and set(faults.FAULTS) == {fault.name for fault in faults.CATALOGUE}
    with faults.activate(faults.CATALOGUE[0].name) as fault:
        assert fault is faults.CATALOGUE[0]


def test_the_readme_counts_the_canonical_patterns_verify_runs_first():
    """``--examples N`` runs N programs after the canonical patterns: the README's arithmetic holds."""
    from paramfsm.verify.programs import CANONICAL

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text(encoding="utf-8")
    said = re.search(r"the catalogued bugs, (\d+) of them\) always run first, so `--examples 1` runs (\d+) "
                     r"programs and\s+`--examples 50` runs (\d+)", readme)
    assert said, "the README no longer says how many canonical patterns run first"
    n = len(CANONICAL)
    assert tuple(map(int, said.groups())) == (n, n + 1, n + 50)
