"""A one-rank gloo group in the test process itself, for tests mutation testing must reach.

The multi-rank tests run their jobs on spawned ranks (``conftest.py``), which
``make mutate`` cannot see: mutmut only records and mutates what runs in the
pytest process. A world-1 group initialised here runs the same public API in
process. It uses a FileStore in a temporary directory (no port, no
environment variables) and is destroyed when the module's tests end, so
tests that need torch.distributed uninitialised, and the rank pools, are not
disturbed.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """torch.distributed initialised with world size 1 for the module's tests (rank 0).

    A one-rank group an earlier test left (``paramfsm.shard(..., group="single")``) is used as it is.
    """
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            pytest.skip("a process group of more than one rank is initialised in this process")
        yield
        return
    store = dist.FileStore(str(tmp_path_factory.mktemp("one-rank") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
