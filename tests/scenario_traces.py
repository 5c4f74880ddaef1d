"""Traces of a small training step, produced by driving :func:`paramfsm.core.fsm.step` directly.

Two units, ``enc`` and ``dec``, each gathered as a bucket: a forward pass
(``dec`` prefetched while ``enc`` runs), a first backward that keeps its graph
(releases are deferred), and a second backward on the retained graph that
reuses ``dec`` without a gather and ends with a flush of ``enc``; without the
flush, ``enc`` leaks in DEFERRED_RELEASE. Used by the trace and
command-line tests.
"""

from __future__ import annotations

from paramfsm.core.fsm import Lifetime, StepContext, default_table, step
from paramfsm.core.trace import Trace

UNITS = {
    "enc": {"enc.weight": 4096, "enc.bias": 64},
    "dec": {"dec.weight": 8192},
}


def scenario_trace(rank: int = 0, *, leak: bool = False) -> Trace:
    """One forward and two backward passes; with ``leak`` the final flush is skipped."""
    table = default_table()
    trace = Trace(rank)
    ctx = StepContext(rank=rank, trace=trace)
    recs = {unit: [Lifetime(name, unit, nbytes) for name, nbytes in params.items()]
            for unit, params in UNITS.items()}

    def apply(unit: str, event: str, keep_graph: bool = False) -> None:
        for rec in recs[unit]:
            step(table, rec, event, ctx, keep_graph=keep_graph)

    ctx.step, ctx.graph_task = 0, -1
    apply("enc", "fetch")
    apply("dec", "prefetch")
    apply("enc", "arrive")
    apply("enc", "release")
    apply("dec", "arrive")
    apply("dec", "fetch")
    apply("dec", "release")

    ctx.graph_task = 1  # backward with retain_graph=True
    for unit in ("dec", "enc"):
        apply(unit, "fetch")
        apply(unit, "arrive")
        apply(unit, "grad_ready")
        apply(unit, "release", keep_graph=True)

    ctx.graph_task = 2  # second backward, on the retained graph, reaches only dec
    apply("dec", "fetch")
    apply("dec", "grad_ready")
    apply("dec", "release")
    if not leak:
        apply("enc", "flush")  # end of a non-retained backward
        apply("dec", "flush")
    return trace
