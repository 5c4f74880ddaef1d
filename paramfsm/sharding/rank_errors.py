"""One rank's error raised on every rank: an outcome agreed before anyone enters the next collective.

[Note: an error one rank meets]
Much of what can fail in paramfsm fails on one rank only: that rank's disk is
full or its folder unwritable, its checkpoint file is missing, a user's
function raises on its data. Raised there alone, the error leaves every other
rank waiting in its next collective for ``collective_timeout`` (600 s by
default), or worse, carrying on with a model the failed rank no longer
shares. So an operation that can fail on some ranks and not others ends with
:func:`agree` over the group: one all-gather of each rank's error (None when
it has none), and every rank raises when any rank failed, the failing rank
its own exception, the others the same class of error naming that rank. The
block that may fail must make no collective call of its own, or the ranks'
calls would pair wrongly.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
import torch.distributed as dist

from paramfsm import errors
from paramfsm.errors import ParamFSMError


def agree(group, error: str | None) -> tuple[int, str] | None:
    """Each rank's error over ``group`` (None: none); the lowest failing rank (global) and its message.

    One all-reduce of a flag when no rank failed (a run of agreements, one per module of an
    ``init_weights``, costs little); the messages are all-gathered only when some rank did.
    """
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    if world == 1:
        return None if error is None else (dist.get_rank() if dist.is_initialized() else 0, error)
    device = (torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl"
              else torch.device("cpu"))
    flag = torch.tensor([0 if error is None else 1], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if not int(flag.item()):
        return None
    found: list = [None] * world
    dist.all_gather_object(found, error, group=group)
    for index, message in enumerate(found):
        if message is not None:
            return (dist.get_global_rank(group, index) if group is not None else index), message
    return None


def groups_of(rt) -> list:
    """The process groups a runtime's ranks span: its shard group, and a hybrid mesh's replicate group."""
    return spanned(rt.group, rt.replicate_group)


def spanned(group, replicate_group) -> list:
    """The shard ``group``, and ``replicate_group`` unless None (a hybrid mesh)."""
    return [group] + ([replicate_group] if replicate_group is not None else [])


@contextlib.contextmanager
def agreed(groups, what: str, after: str = "") -> Iterator[None]:
    """Run the block (which makes no collective call) on every rank; if it raises on any rank, every rank raises.

    ``groups``: a process group, or several (a hybrid mesh's shard and replicate groups), agreed in turn. The
    failing rank raises its own exception; every other rank raises the same paramfsm error class (a
    :class:`~paramfsm.errors.ParamFSMError` for any other exception) naming ``what``, the rank and its message.
    ``after``: what the failure left behind and what to do, told on every rank (a note on the failing rank's own).
    """
    own, error = None, None
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - agreed, then raised again below
        own = exc
        kind = type(exc).__name__ if isinstance(exc, ParamFSMError) else "ParamFSMError"
        rank = dist.get_rank() if dist.is_initialized() else 0
        error = f"{kind}\n{rank}\n{type(exc).__name__}: {exc}"
    for group in groups if isinstance(groups, (list, tuple)) else [groups]:
        found = agree(group, error)
        error = found[1] if found is not None else error
    if own is not None:
        if after:
            own.add_note(f"paramfsm: {after}")
        raise own
    if error is not None:
        kind, rank, text = error.split("\n", 2)
        cls = getattr(errors, kind, ParamFSMError)
        raise cls(f"{what} failed on rank {rank}, so every rank stops here: {text}" + (f" {after}" if after else ""))
