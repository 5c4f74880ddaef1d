"""The shipped spec validates and means what DESIGN §2-3 says; every class of broken spec is named.

Broken specs are made from the shipped one: by editing its text (for TOML
syntax and a missing key) or its parsed TOML dict (for everything else), so
each fixture differs from a valid spec in exactly one place.
"""

from __future__ import annotations

import copy
import tomllib

import pytest

from paramfsm.core.fsm import compile_table
from paramfsm.core.spec import DEFAULT_SPEC, EFFECTS, GUARDS, State, extended_states, load_spec, parse_spec
from paramfsm.errors import SpecError

SHIPPED_TEXT = DEFAULT_SPEC.read_text(encoding="utf-8")
SHIPPED = tomllib.loads(SHIPPED_TEXT)


def row_index(raw: dict, kind: str, src: str, event: str, when: list[str] | None = None) -> int:
    """Position (0-based) of the row of ``kind`` for (src, event) with exactly these guards."""
    for i, row in enumerate(raw[kind]):
        events = row["event"] if isinstance(row["event"], list) else [row["event"]]
        if row["src"] == src and event in events and (when is None or row.get("when", []) == when):
            return i
    raise LookupError(f"no {kind} row for ({src}, {event}, {when})")


def broken_dict(edit) -> dict:
    raw = copy.deepcopy(SHIPPED)
    edit(raw)
    return raw


def expect_spec_error(raw: dict, tmp_path, entry: str, *reason_parts: str) -> SpecError:
    """Validate ``raw`` as if read from a file in tmp_path; the error must name the file and ``entry``."""
    file = str(tmp_path / "broken.toml")
    with pytest.raises(SpecError) as info:
        parse_spec(raw, file=file)
    err = info.value
    message = str(err)
    assert err.file == file and message.startswith(file), message
    assert entry in err.entry and entry in message, message
    if not entry.startswith("("):  # a row's entry may name its (state, event) after it
        assert err.entry == entry or err.entry.startswith(entry + " ("), (err.entry, entry)
    for part in reason_parts:
        assert part in err.reason, message
    return err


def test_shipped_spec_validates():
    spec = load_spec()
    assert spec.initial == "NOT_AVAILABLE"
    assert set(spec.states) == {s.name for s in State}
    assert {"fetch", "prefetch", "arrive", "release", "grad_ready", "flush"} <= set(spec.events)
    assert all(set(r.effects) <= EFFECTS for r in spec.rules)
    assert all(name in GUARDS for r in spec.rules for name, _ in r.when)


# ------------------------------------------------------------- broken specs


def test_bad_toml_names_file(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text(SHIPPED_TEXT + "\n[[transition\n", encoding="utf-8")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert info.value.file == str(path) and info.value.entry == "toml"
    assert str(path) in str(info.value) and "not valid TOML" in str(info.value)


def test_missing_file_names_file(tmp_path):
    with pytest.raises(SpecError, match="no such file") as info:
        load_spec(tmp_path / "absent.toml")
    assert info.value.file == str(tmp_path / "absent.toml")


def test_missing_initial_state(tmp_path):
    path = tmp_path / "no_initial.toml"
    text = SHIPPED_TEXT.replace('initial = "NOT_AVAILABLE"\n', "")
    assert text != SHIPPED_TEXT
    path.write_text(text, encoding="utf-8")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert info.value.entry == "machine.initial"
    assert str(path) in str(info.value) and "initial state None" in str(info.value)


def test_unknown_state_declared(tmp_path):
    raw = broken_dict(lambda r: r["states"].__setitem__("PARTIAL", {"doc": "half", "holds": "any"}))
    expect_spec_error(raw, tmp_path, "states.PARTIAL", "unknown state")


def test_unknown_state_in_src(tmp_path):
    raw = broken_dict(lambda r: r["error"][0].__setitem__("src", "GATHERED"))
    expect_spec_error(raw, tmp_path, "error #1", "unknown state 'GATHERED'")


def test_unknown_event(tmp_path):
    i = row_index(SHIPPED, "transition", "INFLIGHT", "arrive")
    raw = broken_dict(lambda r: r["transition"][i].__setitem__("event", "arrived"))
    expect_spec_error(raw, tmp_path, f"transition #{i + 1}", "unknown event 'arrived'")


def test_unknown_guard(tmp_path):
    i = row_index(SHIPPED, "transition", "AVAILABLE", "release", ["shared_hold"])
    raw = broken_dict(lambda r: r["transition"][i].__setitem__("when", ["many_holds"]))
    expect_spec_error(raw, tmp_path, f"transition #{i + 1}", "unknown guard 'many_holds'")


def test_unknown_negated_guard(tmp_path):
    i = row_index(SHIPPED, "ignore", "INFLIGHT", "abandon", ["!unheld"])
    raw = broken_dict(lambda r: r["ignore"][i].__setitem__("when", ["!held"]))
    expect_spec_error(raw, tmp_path, f"ignore #{i + 1}", "unknown guard 'held'")


def test_unknown_effect(tmp_path):
    i = row_index(SHIPPED, "transition", "NOT_AVAILABLE", "fetch")
    raw = broken_dict(lambda r: r["transition"][i].__setitem__("effects", ["all_gather"]))
    expect_spec_error(raw, tmp_path, f"transition #{i + 1}", "unknown effect 'all_gather'")


def test_unknown_dst(tmp_path):
    i = row_index(SHIPPED, "transition", "INFLIGHT", "arrive")
    raw = broken_dict(lambda r: r["transition"][i].__setitem__("dst", "GATHERED"))
    expect_spec_error(raw, tmp_path, f"transition #{i + 1}", "unknown dst state 'GATHERED'")


@pytest.mark.parametrize("kind", ["ignore", "error"])
def test_missing_reason(tmp_path, kind):
    raw = broken_dict(lambda r: r[kind][0].pop("reason"))
    expect_spec_error(raw, tmp_path, f"{kind} #1", f"an {kind} row needs a reason")


def test_unreachable_state(tmp_path):
    # The only way into DEFERRED_RELEASE is a last release in a keep-graph backward.
    i = row_index(SHIPPED, "transition", "AVAILABLE", "release", ["last_hold", "keep_graph"])

    def edit(raw):
        raw["transition"][i].update(dst="NOT_AVAILABLE", effects=["free"])

    expect_spec_error(broken_dict(edit), tmp_path, "states.DEFERRED_RELEASE", "unreachable")


def test_overlapping_guards(tmp_path):
    i = row_index(SHIPPED, "ignore", "INFLIGHT", "abandon", ["!unheld"])
    raw = broken_dict(lambda r: r["ignore"][i].pop("when"))
    err = expect_spec_error(raw, tmp_path, "(INFLIGHT, abandon)", "guards overlap")
    assert "holds=0" in err.reason


def test_table_not_total(tmp_path):
    i = row_index(SHIPPED, "error", "NOT_AVAILABLE", "release")
    raw = broken_dict(lambda r: r["error"].pop(i))
    expect_spec_error(raw, tmp_path, "(NOT_AVAILABLE, release)", "not total", "holds=0")


def test_guard_gap_is_not_total(tmp_path):
    i = row_index(SHIPPED, "ignore", "DEFERRED_RELEASE", "graph_freed", ["retained"])
    raw = broken_dict(lambda r: r["ignore"].pop(i))
    expect_spec_error(raw, tmp_path, "(DEFERRED_RELEASE, graph_freed)", "not total", "retained=True")


def test_holds_going_negative(tmp_path):
    i = row_index(SHIPPED, "transition", "AVAILABLE", "abandon", ["unheld"])
    raw = broken_dict(lambda r: r["transition"][i].__setitem__("holds", "-1"))
    expect_spec_error(raw, tmp_path, f"transition #{i + 1}", "holds would go negative")


def test_holders_in_zero_hold_state(tmp_path):
    # Deferring without dropping the last hold would leave a holder in DEFERRED_RELEASE.
    i = row_index(SHIPPED, "transition", "AVAILABLE", "release", ["last_hold", "keep_graph"])
    raw = broken_dict(lambda r: r["transition"][i].pop("holds"))
    expect_spec_error(raw, tmp_path, f"transition #{i + 1}", "DEFERRED_RELEASE allows no holders")


def test_bad_hold_update(tmp_path):
    i = row_index(SHIPPED, "transition", "NOT_AVAILABLE", "fetch")
    raw = broken_dict(lambda r: r["transition"][i].__setitem__("holds", "+2"))
    expect_spec_error(raw, tmp_path, f"transition #{i + 1}", "holds must be one of")


# -------------------------------------------------- the spec means the design


@pytest.fixture(scope="module")
def table():
    return compile_table(load_spec())


def outcomes(table, state: State, event: str, **fixed):
    """Every outcome of (state, event) over the extended states the state allows, filtered by ``fixed``."""
    spec_state = table.spec.states[state.name]
    for holds, keep_graph, retained in extended_states(spec_state):
        ext = {"holds": holds, "keep_graph": keep_graph, "retained": retained}
        if all(ext[k] == v for k, v in fixed.items()):
            yield ext, table.outcome(state, event, holds, keep_graph, retained)


def test_first_fetch_gathers(table):
    for _, out in outcomes(table, State.NOT_AVAILABLE, "fetch"):
        assert (out.kind, out.dst, out.hold) == ("transition", State.INFLIGHT, 1)
        assert "start_gather" in out.effects


def test_fetch_from_deferred_reuses_without_communication(table):
    for _, out in outcomes(table, State.DEFERRED_RELEASE, "fetch"):
        assert (out.kind, out.dst, out.hold) == ("transition", State.AVAILABLE, 1)
        assert "start_gather" not in out.effects


def test_last_release_in_keep_graph_backward_defers(table):
    for _, out in outcomes(table, State.AVAILABLE, "release", holds=1, keep_graph=True):
        assert (out.kind, out.dst) == ("transition", State.DEFERRED_RELEASE)
        assert "free" not in out.effects


def test_last_release_otherwise_frees(table):
    for _, out in outcomes(table, State.AVAILABLE, "release", holds=1, keep_graph=False):
        assert (out.kind, out.dst) == ("transition", State.NOT_AVAILABLE)
        assert "free" in out.effects


def test_shared_release_keeps_the_parameter(table):
    for _, out in outcomes(table, State.AVAILABLE, "release", holds=2):
        assert (out.kind, out.dst, out.hold, out.effects) == ("transition", State.AVAILABLE, -1, ())


def test_flush_frees_deferred(table):
    for _, out in outcomes(table, State.DEFERRED_RELEASE, "flush"):
        assert (out.kind, out.dst) == ("transition", State.NOT_AVAILABLE)
        assert "free" in out.effects


def test_graph_freed_flushes_only_unretained(table):
    for ext, out in outcomes(table, State.DEFERRED_RELEASE, "graph_freed"):
        if ext["retained"]:
            assert out.kind == "ignore"
        else:
            assert (out.kind, out.dst) == ("transition", State.NOT_AVAILABLE)
            assert "free" in out.effects


def test_arrive_unpacks(table):
    for _, out in outcomes(table, State.INFLIGHT, "arrive"):
        assert (out.kind, out.dst, out.effects) == ("transition", State.AVAILABLE, ("unpack",))


def test_use_before_gather_is_an_error(table):
    for state in (State.NOT_AVAILABLE, State.INFLIGHT):
        for event in ("release", "grad_ready"):
            assert {out.kind for _, out in outcomes(table, state, event)} == {"error"}


def test_reset_drops_everything(table):
    for state in State:
        for _, out in outcomes(table, state, "reset"):
            if state is State.NOT_AVAILABLE:
                assert out.kind == "ignore"
            else:
                assert (out.kind, out.dst) == ("transition", State.NOT_AVAILABLE)


def test_every_row_that_enters_not_available_frees(table):
    for state in State:
        for event in table.spec.events:
            for _, out in outcomes(table, state, event):
                if out.kind == "transition" and out.dst is State.NOT_AVAILABLE and state is not State.NOT_AVAILABLE:
                    assert "free" in out.effects, out


@pytest.mark.parametrize("where, edit, message", [
    ("transition #1", lambda r: r["transition"][0].__setitem__("when", "unheld"), "when must be a list of names"),
    ("transition #1", lambda r: r["transition"][0].__setitem__("when", [1]), "when must be a list of names"),
    ("transition #1", lambda r: r["transition"][0].__setitem__("effects", "free"), "effects must be a list of names"),
    ("states.INFLIGHT", lambda r: r["states"]["INFLIGHT"].__setitem__("invariants", "data_empty"),
     "invariants must be a list of names"),
    ("ignore #2", lambda r: r["ignore"].__setitem__(1, "nothing"), "array of tables"),
    ("machine.initial", lambda r: r["machine"].__setitem__("initial", ["NOT_AVAILABLE"]), "unknown initial state"),
])
def test_misshapen_values_are_named(tmp_path, where, edit, message):
    expect_spec_error(broken_dict(edit), tmp_path, where, message)


def test_unreadable_file_is_a_spec_error(tmp_path):
    with pytest.raises(SpecError, match="cannot read") as info:
        load_spec(tmp_path)  # a folder
    assert info.value.file == str(tmp_path) and info.value.entry == "file"
    assert info.value.reason.startswith("cannot read: ") and info.value.reason != "cannot read: "


def test_load_errors_name_file_entry_and_reason(tmp_path):
    with pytest.raises(SpecError) as info:
        load_spec(tmp_path / "absent.toml")
    assert (info.value.entry, info.value.reason) == ("file", "no such file")
    binary = tmp_path / "binary.toml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(SpecError) as info:
        load_spec(binary)
    assert info.value.file == str(binary) and info.value.entry == "file"
    assert info.value.reason.startswith("not UTF-8 text: ") and "decode" in info.value.reason


@pytest.mark.parametrize("where, edit, message", [
    ("machine", lambda r: r.__delitem__("machine"), "missing or empty [machine] table"),
    ("events", lambda r: r.__setitem__("events", {}), "missing or empty [events] table"),
    ("transition", lambda r: r.__setitem__("transition", {"src": "X"}), "use [[transition]] (an array of tables)"),
    ("transition #1", lambda r: r["transition"][0].__setitem__("colour", "red"),
     "unknown key 'colour'; allowed: ['dst', 'effects', 'event', 'holds', 'reason', 'src', 'when']"),
    ("transition #1", lambda r: r["transition"][0].__setitem__("src", []),
     "src must be a name or a non-empty list of names"),
    ("transition #1", lambda r: r["transition"][0].__setitem__("event", 3),
     "event must be a name or a non-empty list of names"),
])
def test_structural_errors_are_named_exactly(tmp_path, where, edit, message):
    err = expect_spec_error(broken_dict(edit), tmp_path, where)
    assert err.reason == message, err.reason


def test_a_reason_travels_into_the_compiled_table(tmp_path):
    table = compile_table(load_spec())
    outcome = table.outcome(State.NOT_AVAILABLE, "arrive", 0, False, False)
    assert outcome.kind == "error" and outcome.reason and outcome.reason != "XXXX"
    assert outcome.entry.startswith("error #") and "(NOT_AVAILABLE, arrive)" in outcome.entry


def test_a_wildcard_source_covers_every_state():
    spec = load_spec()
    wildcard = [r for r in spec.rules if r.event == "reset"]
    assert {r.src for r in wildcard} == {s.name for s in State}


def test_parsed_spec_keeps_names_docs_and_defaults():
    spec = parse_spec(SHIPPED, file="f.toml")
    assert spec.name == "param_lifetime" and spec.file == "f.toml"
    assert spec.states["NOT_AVAILABLE"].doc == SHIPPED["states"]["NOT_AVAILABLE"]["doc"] != ""
    assert spec.states["DEFERRED_RELEASE"].holds_zero and not spec.states["AVAILABLE"].holds_zero
    assert spec.events["fetch"] == SHIPPED["events"]["fetch"] != ""

    def strip(r):
        del r["machine"]["name"]
        del r["states"]["AVAILABLE"]["doc"]
        del r["states"]["AVAILABLE"]["holds"]
        del r["states"]["AVAILABLE"]["invariants"]
    bare = parse_spec(broken_dict(strip), file="f.toml")
    assert bare.name == "param_lifetime"
    available = bare.states["AVAILABLE"]
    assert (available.doc, available.holds_zero, available.invariants) == ("", False, ())


@pytest.mark.parametrize("where, edit, message", [
    ("extras", lambda r: r.__setitem__("extras", {"a": 1}),
     "unknown top-level table; expected machine, states, events, transition, ignore, error, residency"),
    ("states", lambda r: r["states"].__delitem__("INFLIGHT"), "missing states ['INFLIGHT']"),
    ("states.INFLIGHT", lambda r: r["states"].__setitem__("INFLIGHT", "gathering"), "must be a table"),
    ("states.INFLIGHT", lambda r: r["states"]["INFLIGHT"].__setitem__("holds", "some"),
     "holds must be 'zero' or 'any', not 'some'"),
    ("states.INFLIGHT", lambda r: r["states"]["INFLIGHT"].__setitem__("invariants", ["shiny"]),
     "unknown invariant 'shiny'; known: ['data_empty', 'data_full', 'no_handle', 'pending_handle', "
     "'retained_graph_live', 'shard_intact']"),
])
def test_state_table_errors_are_named_exactly(tmp_path, where, edit, message):
    err = expect_spec_error(broken_dict(edit), tmp_path, where)
    assert err.reason == message, err.reason


def test_not_total_names_the_many_holders_class(tmp_path):
    i = row_index(SHIPPED, "transition", "AVAILABLE", "release", ["shared_hold"])
    raw = broken_dict(lambda r: r["transition"].pop(i))
    err = expect_spec_error(raw, tmp_path, "(AVAILABLE, release)", "not total")
    assert "holds=>=2, keep_graph=False, retained=False" in err.reason


def test_overlap_names_the_other_row(tmp_path):
    i = row_index(SHIPPED, "ignore", "INFLIGHT", "abandon", ["!unheld"])
    raw = broken_dict(lambda r: r["ignore"][i].pop("when"))
    err = expect_spec_error(raw, tmp_path, "(INFLIGHT, abandon)", "guards overlap")
    named = err.reason.split("guards overlap with ")[1].split(" for ")[0]
    assert named.split(" (")[0] != err.entry.split(" (")[0], (named, err.entry)


def test_a_wildcard_source_expands_to_every_state():
    def one_reset(r):
        for kind in ("transition", "ignore", "error"):
            for row in r[kind]:
                if isinstance(row["event"], list):
                    row["event"] = [e for e in row["event"] if e != "reset"]
            r[kind] = [row for row in r[kind] if row["event"] not in ("reset", [])]
        r["transition"].append({"src": "*", "event": "reset", "dst": "NOT_AVAILABLE", "holds": "0",
                                "effects": ["discard_gather", "free"]})
    spec = parse_spec(broken_dict(one_reset))
    assert {r.src for r in spec.rules if r.event == "reset"} == {s.name for s in State}


def test_a_missing_row_kind_is_a_spec_error_not_a_crash(tmp_path):
    expect_spec_error(broken_dict(lambda r: r.__delitem__("ignore")), tmp_path, "(", "not total")


def test_unreadable_file_reason_is_the_os_message(tmp_path):
    with pytest.raises(SpecError) as info:
        load_spec(tmp_path)
    assert info.value.reason == "cannot read: Is a directory"


def test_a_named_machine_and_the_default_file_label(tmp_path):
    spec = parse_spec(broken_dict(lambda r: r["machine"].__setitem__("name", "custom")))
    assert (spec.name, spec.file) == ("custom", "<spec>")
    err = expect_spec_error(broken_dict(lambda r: r.__delitem__("states")), tmp_path, "states")
    assert err.reason == "missing or empty [states] table"


# ------------------------------------------------------------------ fields of the wrong type, nesting


def _set_row(kind: str, key: str, value):
    return lambda r: r[kind][0].__setitem__(key, value)


@pytest.mark.parametrize("where, edit, message", [
    ("transition #1", _set_row("transition", "dst", ["AVAILABLE"]), "dst must be one state name"),
    ("transition #1", _set_row("transition", "dst", {"state": "AVAILABLE"}), "dst must be one state name"),
    ("transition #1", _set_row("transition", "dst", 3), "dst must be one state name"),
    ("transition #1", _set_row("transition", "effects", {"a": "free"}), "effects must be a list of names"),
    ("transition #1", _set_row("transition", "effects", [["free"]]), "effects must be a list of names"),
    ("transition #1", _set_row("transition", "holds", ["+1"]), "holds must be one of"),
    ("transition #1", _set_row("transition", "holds", 1), "holds must be one of"),
    ("transition #1", _set_row("transition", "when", {"unheld": True}), "when must be a list of names"),
    ("transition #1", _set_row("transition", "src", {"NOT_AVAILABLE": 1}), "src must be a name"),
    ("transition #1", _set_row("transition", "event", [["fetch"]]), "event must be a name"),
    ("transition #1", _set_row("transition", "reason", ["because"]), "reason must be a string, not list"),
    ("error #1", _set_row("error", "reason", {"why": "no"}), "reason must be a string, not dict"),
    ("states.INFLIGHT", lambda r: r["states"]["INFLIGHT"].__setitem__("holds", ["zero"]), "holds must be 'zero'"),
    ("states.INFLIGHT", lambda r: r["states"]["INFLIGHT"].__setitem__("doc", ["text"]), "doc must be a string"),
    ("states.INFLIGHT", lambda r: r["states"]["INFLIGHT"].__setitem__("invariants", [{"a": 1}]),
     "invariants must be a list of names"),
    ("events.fetch", lambda r: r["events"].__setitem__("fetch", {"doc": "x"}), "description must be a string"),
    ("events", lambda r: r.__setitem__("events", ["fetch"]), "missing or empty [events] table"),
    ("machine.name", lambda r: r["machine"].__setitem__("name", 7), "the machine's name must be a string, not int"),
    ("machine.initial", lambda r: r["machine"].__setitem__("initial", {"s": 1}), "unknown initial state"),
    ("machine", lambda r: r.__setitem__("machine", ["NOT_AVAILABLE"]), "missing or empty [machine] table"),
    ("ignore", lambda r: r.__setitem__("ignore", "none"), "array of tables"),
])
def test_a_field_of_the_wrong_type_is_a_spec_error(tmp_path, where, edit, message):
    expect_spec_error(broken_dict(edit), tmp_path, where, message)


def test_a_document_that_is_not_a_table_is_a_spec_error(tmp_path):
    expect_spec_error(["machine"], tmp_path, "toml", "not list")


def _nested_list(depth: int):
    value = "AVAILABLE"
    for _ in range(depth):
        value = [value]
    return value


def test_a_deeply_nested_value_is_quoted_briefly(tmp_path):
    for key in ("dst", "holds"):
        err = expect_spec_error(broken_dict(_set_row("transition", key, _nested_list(5000))), tmp_path,
                                "transition #1", "must be")
        assert len(str(err)) < 400, str(err)


@pytest.mark.parametrize("value", ["[" * 5000 + "]" * 5000, "{a = " * 5000 + "1" + "}" * 5000])
def test_deeply_nested_toml_is_a_spec_error(tmp_path, value):
    path = tmp_path / "deep.toml"
    path.write_text(SHIPPED_TEXT.replace('name = "param_lifetime"', f"name = {value}", 1), encoding="utf-8")
    with pytest.raises(SpecError) as info:
        load_spec(path)
    assert (info.value.file, info.value.entry) == (str(path), "toml")
    assert "nested too deeply" in info.value.reason


@pytest.mark.parametrize("old, new, message", [
    ('event = "arrive"\ndst = "AVAILABLE"', 'event = "arrive"\ndst = ["AVAILABLE"]', "dst must be one state name"),
    ('name = "param_lifetime"', "name = " + "[" * 5000 + "]" * 5000, "nested too deeply"),
    ('name = "param_lifetime"', "name = " + "{a = " * 3000 + "1" + "}" * 3000, "nested too deeply"),
])
def test_spec_check_names_a_misshapen_spec_in_one_line(tmp_path, capsys, old, new, message):
    from paramfsm import cli

    assert old in SHIPPED_TEXT
    path = tmp_path / "misshapen.toml"
    path.write_text(SHIPPED_TEXT.replace(old, new, 1), encoding="utf-8")
    for command in ("check", "draw"):
        assert cli.main(["spec", command, str(path)]) == 1
        out, err = capsys.readouterr()
        assert out == "" and "Traceback" not in err, err
        assert err.count("\n") == 1 and err.startswith(f"paramfsm: error: invalid spec: {path}: "), err
        assert message in err, err
