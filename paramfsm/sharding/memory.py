"""``rt.memory()``: the bytes this rank's runtime holds right now, by kind.

What a lifetime runtime trades is memory against communication (retained
graphs deferring releases, ``reshard_after_forward=False``, ``rt.no_sync()``),
so what each choice holds is reported rather than left to guess. The figures
are tensor bytes the runtime owns, counted from the parameters' states and
buffers, not the allocator's view: a parameter of a one-rank world is a view
of its shard and adds nothing.
"""

from __future__ import annotations

import sys

from paramfsm.core.spec import State
from paramfsm.engine.storage import paged

#: The kinds, in the order they are reported.
KINDS = ("shards", "shard_grads", "gathered", "inflight", "deferred", "unsynced_grads")


def memory(rt) -> dict[str, int]:
    """Bytes held now, by kind.

    ``shards``: this rank's shards (the optimizer's parameters); ``shard_grads``:
    their gradients; ``gathered``: full parameters AVAILABLE (held by a forward,
    a backward, ``rt.gathered``, a forward kept for its backward by
    ``reshard_after_forward=False``, or an arrived prefetch); ``inflight``:
    full parameters whose all-gather is in flight; ``deferred``: full
    parameters kept in DEFERRED_RELEASE for a retained graph's next backward;
    ``unsynced_grads``: full gradients kept under ``rt.no_sync()``.

    Under offload (``paramfsm.shard(..., offload=...)``) ``shards`` counts only
    the shards resident in working memory and ``shard_grads`` only the shard
    gradients resident there, and three more kinds report the tiers:
    ``tier_cpu`` and ``tier_disk``, the bytes each tier holds (shards, shard
    gradients and optimizer state), and ``offload_resident``, the bytes of
    offloaded values now in working memory.

    After ``rt.reset_peak_memory()``, ``peak_<phase>`` gives each phase's
    peak total since that reset (``init``, ``forward``, ``backward``,
    ``step``, ``checkpoint``: the phases of ``paramfsm.plan``, counted the
    same way; ``rt.peak_memory()`` splits them by kind).
    """
    held = dict.fromkeys(KINDS, 0)
    by_state = {State.AVAILABLE: "gathered", State.INFLIGHT: "inflight", State.DEFERRED_RELEASE: "deferred"}
    for rec in rt._by_id.values():
        shard = rec.shard
        if not paged.is_paged_out(shard):
            held["shards"] += shard.numel() * shard.element_size()
        grad = shard.grad
        if grad is not None and not paged.is_paged_out(grad):
            held["shard_grads"] += grad.numel() * grad.element_size()
        kind = by_state.get(rec.state)
        if kind is not None and rec.local_view is None:
            data = rec.param.data
            size = data.numel() * data.element_size()
            held[kind] += size if size else rec.numel * rec.compute_dtype.itemsize
    held["unsynced_grads"] = rt.unsynced.nbytes
    plan = getattr(rt, "offload", None)
    if plan is not None:
        held.update(plan.memory())
    saves = sys.modules.get("paramfsm.checkpoint.background")
    if saves is not None and saves.pending(rt) is not None:
        held["checkpoint_staging"] = saves.staging_bytes(rt)
    tracker = rt.scheduler.peaks
    if tracker is not None:
        held.update({f"peak_{phase}": peak["total"] for phase, peak in tracker.peaks().items()})
    return held


def peaks(rt) -> dict:
    """``rt.peak_memory()``: each phase's peak since the last reset, with its kinds, unit and event."""
    tracker = rt.scheduler.peaks
    if tracker is None:
        from paramfsm.errors import ParamFSMError

        raise ParamFSMError("rt.peak_memory(): no peaks are counted yet. What to do: call rt.reset_peak_memory() "
                            "first (the count starts there: it costs a sample per transition)")
    return tracker.peaks()


def phase(rt, name: str) -> None:
    """Mark the phase that begins (a checkpoint save) when ``rt``'s peaks are counted."""
    tracker = rt.scheduler.peaks
    if tracker is not None:
        tracker.phase(name)


def describe(held: dict[str, int]) -> str:
    """One line: ``shards 1.0 MiB, shard_grads 0 B, ...`` (and the tiers', under offload)."""
    return ", ".join(f"{kind} {_size(value)}" for kind, value in held.items())


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
