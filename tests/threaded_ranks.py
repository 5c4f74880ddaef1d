"""Several ranks in the test process: one thread each, in torch's threaded process group.

It is the group ``torch.testing._internal.distributed`` runs its own multi-rank tests on. Tests that
``make mutate`` must see (it mutates the test process's modules, not a spawned rank's) run their
collectives here.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.multi_threaded_pg import _install_threaded_pg, _uninstall_threaded_pg


def on_ranks(world: int, job):
    """``job(rank)`` on ``world`` ranks, one thread each in a threaded process group: (results, errors)."""
    results, errors = [None] * world, [None] * world
    store = dist.HashStore()

    def body(rank):
        dist.init_process_group("threaded", rank=rank, world_size=world, store=store)
        try:
            results[rank] = job(rank)
        except Exception as exc:  # noqa: BLE001 - the test inspects every rank's error
            errors[rank] = exc
        finally:
            dist.destroy_process_group()

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    try:
        threads = [threading.Thread(target=body, args=(rank,), daemon=True) for rank in range(world)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=10)
        assert not any(thread.is_alive() for thread in threads), "a rank is blocked"
    finally:
        _uninstall_threaded_pg()
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
    return results, errors
