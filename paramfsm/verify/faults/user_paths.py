"""Catalogued bugs on paths users hit around the lifetimes: higher-order retain, tied state dicts, traces.

Each function returns the context manager that injects one bug for the
duration of the block (the catalogue entries in
:mod:`paramfsm.verify.faults` name each bug's source):

* :func:`retain_lost_in_higher_order`: ``penalty.backward(retain_graph=True)``
  through recorded gradients releases the units it fetches instead of
  deferring them (correct gradients, but the next backward gathers again).
* :func:`tied_aliases_compared_by_identity`: loading a full state dict whose
  tied keys hold equal values in distinct tensors is refused.
* :func:`snapshot_accepted_anywhere` and :func:`ring_window_forgets_idle`:
  bugs in what ``paramfsm trace check`` reads, so they are killed through
  ``trace check`` of a trace the bug makes or lets through (the ``scenario``
  functions below), not through verify.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import attrs

from paramfsm.sharding import full_state
from paramfsm.core import replay as replay_module
from paramfsm.core.fsm import Lifetime, StepContext, default_table, step
from paramfsm.core.trace import SNAPSHOT, Trace
from paramfsm.engine.events import graph_task as gt
from paramfsm.engine.events.events import PRE_BACKWARD, Event
from paramfsm.engine.events.higher_order import SecondOrderEntry
from paramfsm.errors import ParamFSMError
from paramfsm.verify.faults.patching import patched


@contextlib.contextmanager
def retain_lost_in_higher_order() -> Iterator[None]:
    def backward(ctx, *grads):
        task = gt.backward_task()
        for unit in ctx.units:
            ctx.emit(Event(PRE_BACKWARD, unit, task, False, call=unit))  # the bug: keep_graph dropped
        return (None, None, *grads)

    original = vars(SecondOrderEntry)["backward"]
    SecondOrderEntry.backward = staticmethod(backward)
    try:
        yield
    finally:
        SecondOrderEntry.backward = original


def tied_aliases_compared_by_identity():
    def make(original):
        def load_full_state_dict(rt, state_dict):
            first: dict = {}
            for key, value in rt.model.state_dict(keep_vars=True).items():
                if key in state_dict:
                    other = first.setdefault(id(value), key)
                    if state_dict[other] is not state_dict[key]:
                        raise ParamFSMError(f"state dict keys '{other}' and '{key}' name one tied parameter "
                                            "but hold different values; keep one of them")
            original(rt, state_dict)
        return load_full_state_dict
    return patched(full_state, "load_full_state_dict", make)


def snapshot_accepted_anywhere():
    def make(original):
        def replay(records, table):
            records, seen = list(records), set()
            for index, r in enumerate(records):
                key = (r.rank, r.param)
                if r.event == SNAPSHOT and key in seen:  # the bug: a snapshot restarts the parameter
                    records = [x for i, x in enumerate(records) if i >= index or (x.rank, x.param) != key]
                    return replay(records, table)
                seen.add(key)
            return original(records, table)
        return replay
    return patched(replay_module, "replay", make)


def ring_window_forgets_idle():
    def make(original):
        def _snapshot(self, window):
            kept, self.lifetimes = self.lifetimes, ()  # the bug: only parameters with records in the window
            try:
                return original(self, window)
            finally:
                self.lifetimes = kept
        return _snapshot
    return patched(Trace, "_snapshot", make)


def spliced_snapshot_scenario() -> list:
    """A parameter fetched and never released, with a snapshot spliced in after its records that says it
    rests NOT_AVAILABLE: the splice hides the holder. ``trace check`` must reject it."""
    table = default_table()
    trace = Trace(0, digest=table.digest)
    ctx = StepContext(0, trace)
    held = Lifetime("held", "head", 64)
    for event in ("fetch", "arrive", "release", "fetch", "arrive"):
        step(table, held, event, ctx)
    records = trace.records
    last = records[-1]
    return records + [attrs.evolve(last, seq=last.seq + 1, event=SNAPSHOT, src="NOT_AVAILABLE", dst="NOT_AVAILABLE",
                                   effects=(), holds=0)]


def scrolled_leak_trace() -> Trace:
    """A flight-recorder ring of 16 records whose leaked parameter ('leaked', fetched and never released)
    has its own records scrolled out by 40 steps of another parameter."""
    table = default_table()
    trace = Trace(0, limit=16, digest=table.digest)
    leaked, busy = Lifetime("leaked", "head", 64), Lifetime("busy", "body", 64)
    trace.lifetimes = (leaked, busy)
    ctx = StepContext(0, trace)
    for event in ("fetch", "arrive"):
        step(table, leaked, event, ctx)
    for i in range(40):
        ctx.step = i
        for event in ("fetch", "arrive", "release"):
            step(table, busy, event, ctx)
    return trace


def scrolled_leak_scenario() -> list:
    """The window of :func:`scrolled_leak_trace`: ``trace check`` (without --allow-open) must still find
    the leaked parameter gathered."""
    return scrolled_leak_trace().records
