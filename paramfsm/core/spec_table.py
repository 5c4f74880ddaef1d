"""Whole-table checks of a spec machine: total, unambiguous, holders never negative, every state reachable.

:mod:`paramfsm.core.spec` parses a machine row by row; these checks need every
row at once. Guards see the extended state ``(holds, keep_graph, retained)``,
of which there are twelve classes (``holds`` matters only as 0, 1 or "2 or
more"), so the checks enumerate them rather than argue.

This module imports neither ``torch`` nor ``cupy``.
"""

from __future__ import annotations

import itertools
from typing import Iterator


def extended_states(state) -> Iterator[tuple[int, bool, bool]]:
    """Every class of extended state a parameter in ``state`` can be in (holds 2 stands for >= 2)."""
    holds_values = (0,) if state.holds_zero else (0, 1, 2)
    return itertools.product(holds_values, (False, True), (False, True))


def check_table(spec, fail) -> None:
    """Exactly one row must match every (state, event, extended state): total and unambiguous."""
    for state in spec.states.values():
        for event in spec.events:
            rows = spec.rules_for(state.name, event)
            for ext in extended_states(state):
                hits = [r for r in rows if r.matches(*ext)]
                holds, keep_graph, retained = ext
                where = f"holds={'>=2' if holds == 2 else holds}, keep_graph={keep_graph}, retained={retained}"
                if not hits:
                    raise fail(
                        f"({state.name}, {event})",
                        f"table is not total: no row covers {where}; add a transition, ignore or error row",
                    )
                if len(hits) > 1:
                    raise fail(
                        hits[1].entry,
                        f"guards overlap with {hits[0].entry} for {where}; make the guards exclusive",
                    )
                after = holds_after(hits[0], holds)
                if hits[0].kind == "transition" and after < 0:
                    raise fail(hits[0].entry, f"holds would go negative for {where}")
                dst = spec.states.get(hits[0].dst) if hits[0].dst else None
                if dst is not None and dst.holds_zero and after != 0:
                    raise fail(hits[0].entry, f"{dst.name} allows no holders but holds would be {after} for {where}")


def holds_after(rule, holds: int) -> int:
    return {None: holds, "+1": holds + 1, "-1": holds - 1, "0": 0}[rule.holds]


def check_reachable(spec, fail) -> None:
    seen, frontier = {spec.initial}, [spec.initial]
    while frontier:
        src = frontier.pop()
        for rule in spec.rules:
            if rule.kind == "transition" and rule.src == src and rule.dst not in seen:
                seen.add(rule.dst)
                frontier.append(rule.dst)
    for name in spec.states:
        if name not in seen:
            raise fail(f"states.{name}", f"unreachable from the initial state {spec.initial}")
