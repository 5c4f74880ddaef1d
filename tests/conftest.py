"""Shared fixtures: pools of gloo ranks reused across tests (spawning torch processes is slow)."""

from __future__ import annotations

import pytest

from paramfsm.launch import RankPool


@pytest.fixture(scope="session")
def ranks2():
    """Two gloo ranks on 127.0.0.1, shared by every test of the run."""
    with RankPool(2, timeout=180) as pool:
        yield pool


@pytest.fixture(scope="session")
def ranks3():
    """Three gloo ranks on 127.0.0.1."""
    with RankPool(3, timeout=180) as pool:
        yield pool


@pytest.fixture(scope="session")
def ranks1():
    """One gloo rank (world size 1), e.g. to reload a checkpoint saved on more ranks."""
    with RankPool(1, timeout=180) as pool:
        yield pool
