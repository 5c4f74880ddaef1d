"""The residency machine (``[residency]`` in the shipped spec): validated, compiled, traced, replayed.

The property test drives one offloaded value through random event sequences
with a model of its two copies (the working copy and the tier copy, each a
version number) and checks what the spec promises: a value is never read
from an older copy, and no write is lost by a page-out.
"""

from __future__ import annotations

import copy
import json
import tomllib

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paramfsm.core.fsm import Placement, StepContext, compile_table, default_table, residency_table, step
from paramfsm.core.machine import draw_mermaid
from paramfsm.core.replay import final_states, replay
from paramfsm.core.spec import (DEFAULT_SPEC, RESIDENCY, RESIDENCY_EFFECTS, Residency, load_residency_spec,
                                parse_spec)
from paramfsm.core.trace import Trace
from paramfsm.errors import IllegalTransition, SpecError

SHIPPED = tomllib.loads(DEFAULT_SPEC.read_text(encoding="utf-8"))
EVENTS = ("page_in", "need", "read", "write", "write_back", "page_out", "renew")


def residency_raw(edit=None) -> dict:
    raw = copy.deepcopy(SHIPPED["residency"])
    if edit is not None:
        edit(raw)
    return raw


def test_shipped_residency_machine_validates():
    spec = load_residency_spec()
    assert spec.initial == "DIRTY" and spec.kind is RESIDENCY
    assert set(spec.states) == {s.name for s in Residency}
    assert set(spec.events) == set(EVENTS)
    assert all(set(r.effects) <= RESIDENCY_EFFECTS for r in spec.rules)
    assert all(r.entry.startswith("residency.") for r in spec.rules)


@pytest.mark.parametrize("edit, entry, reason", [
    (lambda raw: raw["states"].pop("PAGED_OUT"), "residency.states", "missing states"),
    (lambda raw: raw["transition"][0].update(effects=["free"]), "residency.transition #1", "unknown effect 'free'"),
    (lambda raw: raw["transition"][0].update(when=["unheld"]), "residency.transition #1", "unknown guard"),
    (lambda raw: raw["transition"][0].update(holds="+1"), "residency.transition #1", "counts no holders"),
    (lambda raw: raw["states"]["DIRTY"].update(holds="any"), "residency.states.DIRTY", "counts no holders"),
    (lambda raw: raw["states"]["DIRTY"].update(invariants=["data_full"]), "residency.states.DIRTY",
     "unknown invariant"),
    (lambda raw: raw["ignore"].pop(0), "residency.(DIRTY, page_in)", "not total"),
    (lambda raw: raw.update(extra={}), "residency.extra", "unknown top-level table"),
])
def test_broken_residency_machines_are_named(edit, entry, reason, tmp_path):
    with pytest.raises(SpecError) as info:
        parse_spec(residency_raw(edit), file=str(tmp_path / "s.toml"), kind=RESIDENCY)
    assert info.value.entry.startswith(entry), info.value.entry
    assert reason in info.value.reason, str(info.value)


def test_a_spec_without_residency_still_loads_its_lifetime(tmp_path):
    raw = copy.deepcopy(SHIPPED)
    del raw["residency"]
    assert parse_spec(raw, file="x").initial == "NOT_AVAILABLE"
    path = tmp_path / "s.toml"
    path.write_text(DEFAULT_SPEC.read_text(encoding="utf-8").split("\n[residency.machine]")[0], encoding="utf-8")
    with pytest.raises(SpecError, match=r"missing \[residency\] table"):
        load_residency_spec(path)


def test_residency_table_is_total_and_draws():
    table = residency_table()
    assert table.digest != default_table().digest
    for state in Residency:
        assert set(table.cells[state]) == set(EVENTS)
    assert "PAGED_OUT --> PAGING_IN" in draw_mermaid(load_residency_spec())


def test_reading_a_paged_out_value_is_named():
    p = Placement("layer.weight", "layer", "optim", 64)
    ctx = StepContext(rank=1)
    table = residency_table()
    assert step(table, p, "page_out", ctx) == ("write_tier", "drop_resident")
    with pytest.raises(IllegalTransition) as info:
        step(table, p, "read", ctx)
    message = str(info.value)
    for part in ("layer.weight", "'layer'", "PAGED_OUT", "'read'", "rank 1", "optim",
                 "page-in was skipped"):
        assert part in message, message
    assert p.state is Residency.PAGED_OUT


class Copies:
    """A model of one value's two copies: versions of the working copy (None: dropped) and tier copy."""

    def __init__(self):
        self.working, self.tier, self.latest, self.reading = 1, 0, 1, False

    def run(self, effects) -> None:
        for effect in effects:
            if effect == "write_tier":
                assert self.working is not None
                self.tier = self.working
            elif effect == "drop_resident":
                self.working = None
            elif effect == "start_read":
                assert not self.reading
                self.reading = True
            elif effect == "finish_read":
                assert self.reading
                self.reading, self.working = False, self.tier


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(EVENTS), max_size=40))
def test_no_value_is_read_stale_and_no_write_is_lost(events):
    table, trace = residency_table(), Trace(limit=None)
    ctx = StepContext(trace=trace)
    p, copies = Placement("w", "u", "shard", 8), Copies()
    for event in events:
        try:
            effects = step(table, p, event, ctx)
        except IllegalTransition:
            assert event in ("read", "write") and p.state in (Residency.PAGED_OUT, Residency.PAGING_IN)
            assert copies.working is None or copies.reading
            continue
        copies.run(effects)
        if event == "need":
            assert copies.working == copies.latest  # resident, and never an older copy
        if event in ("write", "renew"):  # renew: a new value, only in working memory
            copies.latest += 1
            copies.working = copies.latest
        if p.state is Residency.RESIDENT:
            assert copies.tier == copies.working == copies.latest
        if p.state is Residency.PAGED_OUT:
            assert copies.working is None and copies.tier == copies.latest  # nothing was lost
    assert replay(trace.records, default_table()) is None
    assert final_states(trace.records) == {}  # residency records never read as lifetime leaks


def test_tampered_residency_record_is_caught():
    trace = Trace(limit=None)
    ctx = StepContext(trace=trace)
    p = Placement("w", "u", "shard", 8)
    for event in ("page_out", "page_in", "need"):
        step(residency_table(), p, event, ctx)
    records = trace.records
    assert all(r.machine == "residency" and r.kind == "shard" for r in records)
    skipped = [records[0], attrs.evolve(records[2], src="PAGED_OUT", effects=("finish_read",))]
    error = replay(skipped, default_table())
    assert error is not None and "the spec goes to RESIDENT" in error.reason


def test_residency_records_round_trip_and_draw(tmp_path):
    trace = Trace(limit=None)
    ctx = StepContext(trace=trace)
    p = Placement("w", "u", "optim", 8)
    for event in ("page_out", "need", "write"):
        step(residency_table(), p, event, ctx)
    loaded = Trace.load(trace.dump(tmp_path / "t.jsonl"))
    assert loaded.records == trace.records and replay(loaded.records, default_table()) is None
    streamed = Trace(path=tmp_path / "s.jsonl")
    ctx.trace = streamed
    q = Placement("w", "u", "optim", 8)
    for event in ("page_out", "need"):
        step(residency_table(), q, event, ctx)
    streamed.close()
    assert [r.kind for r in Trace.load(tmp_path / "s.jsonl").records] == ["optim", "optim"]
    doc = json.loads(trace.to_perfetto(tmp_path / "p.json").read_text(encoding="utf-8"))
    names = {e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert names == {"w [u] optim residency"}
    assert {e["cat"] for e in doc["traceEvents"] if e["ph"] == "X"} == {"residency"}


def test_compile_table_takes_either_machine():
    assert set(compile_table(load_residency_spec()).cells) == set(Residency)
