"""Shared fixtures: pools of gloo ranks reused across tests (spawning torch processes is slow)."""

from __future__ import annotations

import os
import tempfile

import pytest

from paramfsm.verify.launch import RankPool

# Flight-recorder dumps of tests that fail on purpose go here, not into the checkout; rank pools
# inherit the variable. A test that reads dumps points it at its own directory.
os.environ.setdefault("PARAMFSM_TRACE_DIR", tempfile.mkdtemp(prefix="paramfsm-dumps-"))
# The suite's models are a few KB, and under the default min_unit_bytes (64 KiB) each would be one
# unit, so nothing would run between units: keep one unit per parameter-owning module (and each
# declared block) everywhere. The tests of the default itself (tests/test_default_units_*.py) clear
# it in-process and pass min_unit_bytes to ranks; rank pools inherit the variable.
os.environ["PARAMFSM_MIN_UNIT_BYTES"] = "0"
#: The ranks' environment, fixed here: a pool starts at its first use, and a test that patches the environment
#: (the default-unit tests clear the variable above) must not decide what every later test's ranks see.
SUITE_ENVIRON = dict(os.environ)


@pytest.fixture(scope="session")
def suite_ranks2():
    """Two gloo ranks on 127.0.0.1, shared by every test of the run."""
    with RankPool(2, timeout=180, environ=SUITE_ENVIRON) as pool:
        yield pool


@pytest.fixture(scope="session")
def ranks2(suite_ranks2):
    """The two shared ranks. A test module may override ``ranks2`` (the pattern tests run each test under two
    unit choices: ``patterns_common.ranks2``); overrides request ``suite_ranks2``, so a parametrized override
    never keys (and restarts) the shared pool by its parameter."""
    return suite_ranks2


@pytest.fixture(scope="session")
def in_process2():
    """Two gloo ranks that are threads of the test process (``gloo_ranks.py``): the same ``run`` as a pool,
    where ``make mutate`` sees what the ranks run. A test module opts in by overriding ``ranks2`` with it."""
    from gloo_ranks import InProcessRanks

    return InProcessRanks(2)


@pytest.fixture(scope="session")
def ranks3():
    """Three gloo ranks on 127.0.0.1."""
    with RankPool(3, timeout=180, environ=SUITE_ENVIRON) as pool:
        yield pool


@pytest.fixture(scope="session")
def ranks1():
    """One gloo rank (world size 1), e.g. to reload a checkpoint saved on more ranks."""
    with RankPool(1, timeout=180, environ=SUITE_ENVIRON) as pool:
        yield pool


@pytest.fixture(scope="session")
def ranks4():
    """Four gloo ranks (the most the suite spawns): a 2 x 2 device mesh for hybrid sharding."""
    with RankPool(4, timeout=180, environ=SUITE_ENVIRON) as pool:
        yield pool


def pytest_sessionfinish(session, exitstatus):
    """Leave no default process group behind (``paramfsm.shard(group="single")`` makes one and keeps it).

    ``make mutate`` runs the selected tests once in its own process, then forks that process for every
    mutant; a group inherited across a fork has lost its threads, so the first collective of every mutant's
    tests would never return and each mutant would count as a timeout, caught or not.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
