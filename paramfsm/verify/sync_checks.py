"""The checks of gradient accumulation (``rt.no_sync``) and ``reshard_after_forward``, after one op.

Like :mod:`paramfsm.verify.checks`, each function returns a list of problems
and none of them communicates.

[Note: comparing gradients while some are kept]
Under ``rt.no_sync()`` (or with gradient sync switched off) each rank keeps
the full gradient of its own micro-batches, summed, and the shard gradient
stands still until the sum is reduce-scattered. The reference simply
accumulates, so its gradient is the rank-averaged sum, which no single rank
holds yet; a rank that produced no gradient for a parameter (an expert its
tokens never reached) keeps nothing for it while another rank does, so no
rank can tell alone which gradients are pending. While a backward with sync
off has kept gradients, verify therefore compares the parameters, the
states, the communication and the trace as usual and leaves the gradients
out; once the program synchronises (a backward with sync on,
``rt.sync_gradients()``) or zeroes them, nothing may still be kept
(:func:`synchronised`) and every gradient is compared with plain torch again,
so a kept micro-batch dropped, summed twice or never synchronised shows as a
gradient that differs.
"""

from __future__ import annotations

from typing import Mapping


def kept_names(rt) -> frozenset[str]:
    """The parameters whose gradient this rank keeps unsynchronised (lost ones included)."""
    unsynced = rt.unsynced
    return frozenset(rec.name for rec in unsynced.pending()) if unsynced else frozenset()


def synchronised(kept: frozenset[str], accumulating: bool, why: str) -> list[str]:
    """Nothing is kept once the program synchronised or zeroed its gradients (``accumulating`` is False)."""
    if accumulating or not kept:
        return []
    return [f"'{name}' still holds an unsynchronised gradient after {why}: its shard gradient lacks the kept "
            "micro-batches" for name in sorted(kept)]


def kept_without_sync(op_kind: str, syncing: bool, before: Mapping, after: Mapping) -> list[str]:
    """A backward with gradient sync off keeps its gradients: it must not reduce-scatter anything."""
    reduces = after["reduce_scatters"] - before["reduce_scatters"]
    if syncing or op_kind not in ("Backward", "Penalty") or not reduces:
        return []
    return [f"{reduces} reduce-scatter(s) in a {op_kind} op with gradient sync off (rt.no_sync() or "
            "rt.set_requires_gradient_sync(False)): its gradients must stay on this rank"]


def graphs_of(rt) -> dict:
    """Unit -> its live graph count, for the units ``reshard_after_forward`` keeps (taken before a forward)."""
    return {unit: unit.live_graphs for unit in sorted(rt.scheduler.holds.keep_after_forward, key=lambda u: u.index)}


def kept_after_forward(rt, before: Mapping) -> list[str]:
    """After a forward: every kept unit whose forward recorded a graph is still held for its backward.

    ``before``: :func:`graphs_of` taken before the forward; a unit whose live
    graph count grew ran a forward that recorded a graph.
    """
    held = set(rt.scheduler.holds.kept.values())
    return [f"unit '{unit.name}' is kept after forward (reshard_after_forward) but its forward's hold was "
            "released: its backward gathers it again"
            for unit, count in before.items() if unit.live_graphs > count and unit not in held]


def nothing_kept(rt, what: str) -> list[str]:
    """After a forward that records no graph (no_grad, an eval no_grad forward, one inside rt.gathered):
    no unit is held for a backward, since none can come and a new forward released the older holds."""
    return [f"unit '{unit.name}' is still held for a backward after {what}, which records no graph: its "
            "parameters leak until the next forward"
            for unit in dict.fromkeys(rt.scheduler.holds.kept.values())]
