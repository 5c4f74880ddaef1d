"""Strict mode: every live step is cross-checked against the spec's transitions Machine."""

from __future__ import annotations

import pytest

from paramfsm.core.fsm import Lifetime, StepContext, compile_table, step
from paramfsm.core.machine import CrossCheckedStep
from paramfsm.core.spec import State, load_spec
from paramfsm.errors import IllegalTransition


def test_cross_check_agrees_with_the_shipped_table():
    spec = load_spec()
    table = compile_table(spec)
    checked = CrossCheckedStep(spec, step)
    rec, ctx = Lifetime("w", "unit"), StepContext()
    for event, keep in [("fetch", False), ("arrive", False), ("release", True), ("fetch", False),
                        ("release", False)]:
        checked(table, rec, event, ctx, keep)
    assert rec.state is State.NOT_AVAILABLE and rec.holds == 0
    with pytest.raises(IllegalTransition):
        checked(table, rec, "release", ctx)


def test_cross_check_catches_a_corrupted_table():
    spec = load_spec()
    table = compile_table(spec)
    broken = table.cells[State.DEFERRED_RELEASE]["fetch"]
    table.cells[State.DEFERRED_RELEASE]["fetch"] = table.cells[State.DEFERRED_RELEASE]["flush"]
    assert broken is not table.cells[State.DEFERRED_RELEASE]["fetch"]
    checked = CrossCheckedStep(spec, step)
    rec, ctx = Lifetime("w", "unit"), StepContext()
    for event, keep in [("fetch", False), ("arrive", False), ("release", True)]:
        checked(table, rec, event, ctx, keep)
    with pytest.raises(AssertionError, match="Machine"):
        checked(table, rec, "fetch", ctx)
