"""The least costly placement that fits a budget: what ``paramfsm.plan(..., budget=B)`` suggests when the
configuration asked for does not fit.

Each candidate is rehearsed like the plan itself (nothing is estimated). They are tried in the order of the
traffic they add per step: fewer gathers in flight first (``prefetch=0``: no bytes moved, less overlap), then
the optimizer state, the shard gradients and the shards moved to host memory, each of which reads and writes
its bytes once or twice a step. The first that fits is the least costly. Disk tiers move the same bytes as
host memory but slower, and the host's own budget is not known here, so they are not tried; a plan with
``offload=...`` given is searched over ``prefetch`` only.
"""

from __future__ import annotations

from typing import Callable

from paramfsm.planning.report import Plan, size


def candidates(options: dict) -> list[tuple[str, dict]]:
    """``(description, the options to add)`` in the order of the traffic they add."""
    from paramfsm.sharding.offload import Offload

    found = []
    if options.get("prefetch", 1) != 0:
        found.append(("prefetch=0", {"prefetch": 0}))
    if options.get("offload") is None:
        for description, offload in (
                ("offload=Offload(optimizer='cpu')", Offload(optimizer="cpu")),
                ("offload=Offload(optimizer='cpu', grads='cpu')", Offload(optimizer="cpu", grads="cpu")),
                ("offload=Offload(params='cpu', grads='cpu', optimizer='cpu')",
                 Offload(params="cpu", grads="cpu", optimizer="cpu"))):
            found.append((description, {"offload": offload}))
    return found


def traffic(result: Plan) -> int:
    """Bytes a rank moves per step: all-gathers received, reduce-scatters sent, tiers read and written."""
    return result.gathered_bytes + result.reduced_bytes + result.tier_bytes


def search(rehearse: Callable[[dict], Plan], options: dict, budget: int) -> dict:
    """The first candidate (:func:`candidates`) whose plan fits ``budget``, or the closest one.

    ``rehearse(extra_options)`` plans the configuration with ``extra_options`` added. Returns
    ``{"placement", "fits", "peak", "traffic", "over"}``.
    """
    best = None
    for description, change in candidates(options):
        result = rehearse(change)
        found = {"placement": description, "fits": result.peak <= budget, "peak": result.peak,
                 "traffic": traffic(result), "over": max(0, result.peak - budget)}
        if found["fits"]:
            return found
        if best is None or found["peak"] < best["peak"]:
            best = found
    return best or {"placement": None, "fits": False, "peak": None, "traffic": None, "over": None}


def describe(found: dict, base: Plan) -> str:
    """One line for the plan's notes."""
    if found["placement"] is None:
        return "No other placement to try."
    if found["fits"]:
        added = found["traffic"] - traffic(base)
        return (f"Fits with {found['placement']}: peak {size(found['peak'])}, moving {size(found['traffic'])} per "
                f"step and rank ({size(max(0, added))} more).")
    return (f"No placement tried fits: the closest, {found['placement']}, peaks at {size(found['peak'])}, "
            f"{size(found['over'])} over. More ranks, a smaller batch or disk tiers are left.")
