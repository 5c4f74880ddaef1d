"""Running a reproduction script: :func:`run_reproduction` under torchrun, :func:`run_saved` on a rank pool.

A script :func:`paramfsm.verify.reproduction.render` writes ends in ``run_reproduction(main, fault=FAULT)``:
it runs the script's ``main(rank, world)`` under the catalogued fault (if any), prints the failed check and
returns the exit status, and leaves no process group behind. :func:`run_saved` runs a saved script in a
:class:`~paramfsm.verify.launch.RankPool`'s group, as the suite runs ``tests/reproductions/``.
"""

from __future__ import annotations

import datetime
import gc
import io
import runpy
import sys
import traceback


def run_reproduction(main, *, fault: str | None = None, timeout_s: float = 60.0, stream=None) -> int:
    """Run a reproduction's ``main(rank, world)`` under ``fault``; return its exit status.

    0: every check passed, or every rank raised ``RankDesync`` after a loss
    that reads another output per rank (the accepted outcome; a line on
    ``stream`` says where). 1: a check failed or an op raised (the check's
    message goes to ``stream``, stderr by default). 2: plain torch itself
    cannot run an op on this model (not a paramfsm bug). Starts a gloo process
    group from the torchrun environment when none is initialised (and
    destroys it at the end).
    """
    import torch.distributed as dist

    from paramfsm.verify import faults, loop_helpers
    from paramfsm.verify.checker import Failed, Rejected
    from paramfsm.verify.rank_loss import Desynced

    stream = stream or sys.stderr
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    before = set(dist.distributed_c10d._world.pg_map)  # groups the reproduction did not make
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        with faults.activate(fault):
            main(rank, world)
    except Failed as exc:
        if exc.kind != "peer":
            print(f"rank {rank}: {exc.report()}", file=stream)
        return 1
    except Rejected as exc:
        print(f"rank {rank}: {exc} (a limit of the model, not a paramfsm bug)", file=stream)
        return 2
    except Desynced as exc:
        print(f"rank {rank}: stopped: {exc}", file=stream)
    except Exception as exc:  # noqa: BLE001 - setting up failed: report it like a check
        print(f"rank {rank}: setup check failed: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-6)}",
              file=stream)
        return 1
    finally:
        # A check that fails stops the script before it closes what it made (the other run in an offload
        # folder, its page-in threads and its group): that run is detached and the groups the script made are
        # destroyed here and collected, so a pool that runs many reproductions keeps no group's threads (see
        # [Note: a program leaves no process group behind] in paramfsm.verify.runner).
        loop_helpers.close_left_open()
        for group in [g for g in dist.distributed_c10d._world.pg_map if g not in before]:
            dist.destroy_process_group(group)
        if created:
            dist.destroy_process_group()
        gc.collect()
    return 0


def run_saved(rank: int, world: int, path: str) -> tuple[int, str]:
    """A :class:`~paramfsm.verify.launch.RankPool` job: run the saved reproduction at ``path``; return (status, output).

    The script's ``main`` runs in the pool's process group, under the script's
    ``FAULT`` (undone afterwards), so one pool can run many reproductions.
    """
    namespace = runpy.run_path(str(path), run_name="paramfsm_reproduction")
    stream = io.StringIO()
    status = run_reproduction(namespace["main"], fault=namespace.get("FAULT"), stream=stream)
    return status, stream.getvalue()
