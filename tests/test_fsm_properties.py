"""Properties of the compiled lifetime table, checked against facts this test keeps itself.

The stateful test drives many parameters with legal and illegal events and
random extended state (keep_graph, retained). It does not ask the spec what
should happen: :class:`Facts` tracks, from the semantics in DESIGN §3, how
many holders a parameter has and whether its gather was started, arrived,
or deferred, and every step is checked against those facts. The
differential test holds the compiled table against the ``transitions``
Machine built from the same spec through an independent path.

The table is obtained through ``fsm.compile_table`` when this module is
imported, so a fault injected there (a wrong destination, a dropped effect)
is what these tests see.
"""

from __future__ import annotations

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, rule
from transitions import MachineError

from paramfsm.core import fsm
from paramfsm.core.machine import build_machine
from paramfsm.core.spec import EFFECTS, State, load_spec
from paramfsm.core.trace import Trace
from paramfsm.core.replay import replay
from paramfsm.errors import IllegalTransition

SPEC = load_spec()
TABLE = fsm.compile_table(SPEC)
EVENTS = sorted(SPEC.events)
UNITS = ("embed", "block0", "block1")
RANK = 3

NA, INFLIGHT, AVAILABLE, DEFERRED = State.NOT_AVAILABLE, State.INFLIGHT, State.AVAILABLE, State.DEFERRED_RELEASE

#: Events a well-behaved training loop sends in each state (DESIGN §3), to reach deep states often.
LIFECYCLE = {
    NA: ("fetch", "prefetch"),
    INFLIGHT: ("arrive", "fetch", "abandon", "shard_written"),
    AVAILABLE: ("release", "release", "fetch", "grad_ready", "grad_kept", "abandon", "written_back", "shard_written"),
    DEFERRED: ("fetch", "flush", "graph_freed", "grad_ready", "grad_kept", "grad_sync", "shard_written"),
}


@attrs.define
class Facts:
    """What the design says about one parameter, tracked from the effects it was told to run."""

    holds: int = 0
    gathered: bool = False  # a gather was started and its memory is not freed yet
    pending: bool = False  # that gather has not been unpacked (or discarded) yet
    deferred: bool = False  # kept for a retained graph
    unsynced: bool = False  # a gradient kept under no_sync waits for its one reduce-scatter

    @property
    def full(self) -> bool:
        return self.gathered and not self.pending

    def illegal(self, event: str) -> bool:
        """Events the design forbids: using data that is not there, releasing without a holder."""
        if event not in SPEC.events:
            return True
        if event == "release":
            return self.holds == 0 or not self.full
        if event in ("grad_ready", "grad_kept"):
            return not self.full
        if event == "arrive":
            return not self.pending
        if event == "demand":  # an empty parameter's guard asks, or a kept one's watcher: never a deferred copy
            return self.full and self.deferred
        if event == "shard_written":  # a held copy would go stale under its holder
            return self.holds > 0 and self.gathered
        if event == "written_back":  # only a gathered, non-deferred copy is written back
            return not self.full or self.deferred
        return False

    def run(self, effects: tuple[str, ...]) -> None:
        """Apply effects in order, asserting each one makes sense for the data present."""
        for effect in effects:
            assert effect in EFFECTS, f"effect {effect!r} is not one the executor knows"
            if effect == "start_gather":
                assert not self.gathered, "start_gather issued twice without a free in between"
                self.gathered = self.pending = True
            elif effect == "unpack":
                assert self.pending, "unpack without a gather in flight"
                self.pending = False
            elif effect == "discard_gather":
                assert self.pending, "discard_gather without a gather in flight"
                self.pending = False
            elif effect == "free":
                assert self.gathered and not self.pending, "free without full data (or with a gather in flight)"
                self.gathered = False
            elif effect == "defer":
                assert self.full and not self.deferred, "defer without full data"
                self.deferred = True
            elif effect == "undefer":
                assert self.deferred, "undefer of a parameter that was not deferred"
                self.deferred = False
            elif effect == "reduce_grad":
                assert self.full, "reduce_grad without the full parameter"
                self.unsynced = False  # the kept gradient is folded into this reduce-scatter
            elif effect == "keep_grad":
                assert self.full, "keep_grad without the full parameter"
                self.unsynced = True
            elif effect == "sync_grad":
                self.unsynced = False
            elif effect == "write_back":
                assert self.full and not self.deferred, "write_back without a gathered copy"

    def agrees_with(self, rec: fsm.Lifetime) -> None:
        """The record's state and holds must be what these facts imply."""
        assert rec.holds == self.holds >= 0, (rec.holds, self.holds)
        expected = {
            NA: (False, False, False),
            INFLIGHT: (True, True, False),
            AVAILABLE: (True, False, False),
            DEFERRED: (True, False, True),
        }[rec.state]
        assert (self.gathered, self.pending, self.deferred) == expected, (rec.state, self)
        if rec.state in (NA, DEFERRED):
            assert rec.holds == 0, f"{rec.name} has {rec.holds} holders in {rec.state.name}"


class LifetimeMachine(RuleBasedStateMachine):
    """Many parameters in several units, each event checked against :class:`Facts`."""

    params = Bundle("params")

    def __init__(self):
        super().__init__()
        self.trace = Trace(RANK)
        self.ctx = fsm.StepContext(rank=RANK, trace=self.trace)
        self.facts: dict[str, Facts] = {}
        self.records: dict[str, fsm.Lifetime] = {}

    @initialize(target=params, unit=st.sampled_from(UNITS))
    def first_param(self, unit):
        return self._new(unit)

    @rule(target=params, unit=st.sampled_from(UNITS))
    def new_param(self, unit):
        return self._new(unit)

    def _new(self, unit: str) -> fsm.Lifetime:
        rec = fsm.Lifetime(f"{unit}.p{len(self.records)}", unit, nbytes=4 * (len(self.records) + 1))
        self.records[rec.name] = rec
        self.facts[rec.name] = Facts()
        return rec

    @rule(rec=params, event=st.sampled_from(EVENTS + ["bogus"]), keep_graph=st.booleans(), retained=st.booleans())
    def any_event(self, rec, event, keep_graph, retained):
        self._apply(rec, event, keep_graph, retained)

    @rule(rec=params, data=st.data(), keep_graph=st.booleans(), retained=st.booleans())
    def lifecycle_event(self, rec, data, keep_graph, retained):
        self._apply(rec, data.draw(st.sampled_from(LIFECYCLE[rec.state]), label="event"), keep_graph, retained)

    @rule(unit=st.sampled_from(UNITS), event=st.sampled_from(EVENTS), keep_graph=st.booleans(),
          retained=st.booleans(), graph_task=st.integers(-1, 3))
    def unit_event(self, unit, event, keep_graph, retained, graph_task):
        """What the scheduler does: one event to every parameter of a unit."""
        self.ctx.graph_task = graph_task
        for rec in [r for r in self.records.values() if r.unit == unit]:
            self._apply(rec, event, keep_graph, retained)

    def _apply(self, rec: fsm.Lifetime, event: str, keep_graph: bool, retained: bool) -> None:
        facts = self.facts[rec.name]
        src, holds = rec.state, rec.holds
        n_records = len(self.trace)
        expect_illegal = facts.illegal(event)
        try:
            effects = fsm.step(TABLE, rec, event, self.ctx, keep_graph=keep_graph, retained=retained)
        except IllegalTransition as err:
            assert expect_illegal, f"{event} in {src.name} with holds={holds} was rejected: {err}"
            assert (rec.state, rec.holds, len(self.trace)) == (src, holds, n_records), "rejected event changed state"
            assert (err.param, err.unit, err.state, err.event, err.rank) == (rec.name, rec.unit, src.name, event, RANK)
            for fact in (f"'{rec.name}'", f"'{rec.unit}'", src.name, f"'{event}'", f"rank {RANK}"):
                assert fact in str(err), f"{fact} missing from: {err}"
            return
        assert not expect_illegal, f"{event} in {src.name} with holds={holds} was accepted"
        assert isinstance(effects, tuple) and set(effects) <= EFFECTS, effects
        if len(self.trace) == n_records:  # an ignore row
            assert effects == () and (rec.state, rec.holds) == (src, holds), "an ignored event changed something"
            assert event not in ("fetch", "demand", "release", "arrive", "grad_ready", "grad_kept", "grad_sync",
                                 "written_back"), \
                f"{event} in {src.name} was ignored"
        else:
            last = self.trace.records[-1]
            assert (last.param, last.unit, last.event, last.src, last.dst, last.effects, last.holds) == (
                rec.name, rec.unit, event, src.name, rec.state.name, effects, holds)
            self._check_design(rec, event, src, holds, effects, keep_graph, retained)
            facts.holds = {"fetch": holds + 1, "demand": holds + 1, "release": holds - 1, "reset": 0}.get(event, holds)
            facts.run(effects)
        facts.agrees_with(rec)

    @staticmethod
    def _check_design(rec, event, src, holds, effects, keep_graph, retained) -> None:
        """Destinations DESIGN §3 fixes, for the transitions the spec accepted."""
        dst = rec.state
        if event == "fetch" and src is DEFERRED:
            assert dst is AVAILABLE and "start_gather" not in effects, "fetch from DEFERRED_RELEASE must reuse"
        if event in ("fetch", "demand") and src is NA:
            assert dst is INFLIGHT and "start_gather" in effects, f"a first {event} must gather"
        if event == "release" and src is AVAILABLE and holds == 1:
            assert dst is (DEFERRED if keep_graph else NA), f"last release with keep_graph={keep_graph} -> {dst}"
        if event == "release" and holds >= 2:
            assert dst is AVAILABLE, "a shared parameter stays gathered until its last holder releases"
        if event in ("flush", "reset") or (event == "graph_freed" and not retained):
            assert dst is NA, f"{event} must leave {rec.name} NOT_AVAILABLE"
        if event == "demand" and src is AVAILABLE:
            assert dst is AVAILABLE and effects == (), "a read of a kept parameter gathers nothing"
        if event == "arrive":
            assert dst is AVAILABLE and effects == ("unpack",)
        if event == "shard_written":
            assert dst is NA, "after a shard write no full copy gathered before it may stay"
        if event == "written_back":
            assert dst is AVAILABLE and effects == ("write_back",), "a write-back keeps the held copy"
        if event in ("grad_ready", "grad_kept", "grad_sync"):
            want = {"grad_ready": "reduce_grad", "grad_kept": "keep_grad", "grad_sync": "sync_grad"}[event]
            assert dst is src and effects == (want,), f"{event} must only move the gradient ({effects})"

    @invariant()
    def every_parameter_agrees(self):
        for name, rec in self.records.items():
            self.facts[name].agrees_with(rec)

    @invariant()
    def trace_replays(self):
        error = replay(self.trace.records, TABLE)
        assert error is None, str(error)


LifetimeMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow],
)
TestLifetimes = LifetimeMachine.TestCase


# ---------------------------------------------------------------- differential

def any_or_lifecycle_event(state: State):
    """Half the time an event a training loop would send in ``state``, else any event."""
    return st.one_of(st.sampled_from(LIFECYCLE[state]), st.sampled_from(EVENTS))


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.data())
def test_compiled_table_agrees_with_transitions_machine(data):
    machine, model = build_machine(SPEC)
    rec, ctx = fsm.Lifetime("block0.weight", "block0"), fsm.StepContext(rank=RANK)
    for i in range(data.draw(st.integers(0, 60), label="events")):
        event, keep_graph, retained = data.draw(
            st.tuples(any_or_lifecycle_event(rec.state), st.booleans(), st.booleans()), label=f"event {i}")
        model.keep_graph, model.retained = keep_graph, retained
        try:
            effects, compiled_error = fsm.step(TABLE, rec, event, ctx, keep_graph, retained), False
        except IllegalTransition:
            effects, compiled_error = None, True
        try:
            model.trigger(event)
            machine_error = False
        except MachineError:
            machine_error = True
        where = f"event {i} ({event}, keep_graph={keep_graph}, retained={retained})"
        assert compiled_error == machine_error, f"{where}: compiled raised {compiled_error}, Machine {machine_error}"
        assert (rec.state.name, rec.holds) == (model.state, model.holds), where
        if not compiled_error:
            assert effects == tuple(model.effects), f"{where}: {effects} vs {model.effects}"


def test_unknown_event_is_illegal_and_changes_nothing():
    rec, ctx = fsm.Lifetime("block0.weight", "block0"), fsm.StepContext(rank=RANK)
    fsm.step(TABLE, rec, "fetch", ctx)
    try:
        fsm.step(TABLE, rec, "gather", ctx)
    except IllegalTransition as err:
        assert "no event 'gather'" in str(err) and (rec.state, rec.holds) == (INFLIGHT, 1)
    else:
        raise AssertionError("an unknown event was accepted")
