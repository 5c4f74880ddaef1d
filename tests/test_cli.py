"""The ``paramfsm`` command line, run as ``python -m paramfsm`` in a subprocess like a user would.

Every subcommand is run on a good input and on the bad inputs a user will
hit (missing file, malformed JSON, malformed TOML, an invalid spec, an
illegal trace); errors must be one message on stderr with the documented
exit status, never a traceback. The command lines are started together by
one fixture, because each process pays for importing the package.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import attrs
import pytest
from scenario_traces import scenario_trace

from paramfsm import cli
from paramfsm.core.spec import DEFAULT_SPEC

REPO = Path(__file__).resolve().parent.parent
TRACE_LEN = len(scenario_trace())

#: name -> command line. All of them run at once (see the ``runs`` fixture), in one working folder.
COMMANDS = {
    "spec_check": ["spec", "check"],
    "spec_check_invalid": ["spec", "check", "bad_dst.toml"],
    "spec_check_missing": ["spec", "check", "absent.toml"],
    "spec_draw": ["spec", "draw"],
    "spec_draw_file": ["spec", "draw", str(DEFAULT_SPEC), "-o", "out/lifetime.mmd"],
    "check_clean": ["trace", "check", "good.jsonl", "--spec", str(DEFAULT_SPEC)],
    "check_tampered": ["trace", "check", "tampered.jsonl"],
    "check_malformed": ["trace", "check", "malformed.jsonl"],
    "summary_leak": ["trace", "summary", "leak.jsonl"],
    "export": ["trace", "export", "good.jsonl", "--perfetto", "perf/t.json"],
    "diff_differ": ["trace", "diff", "good.jsonl", "tampered.jsonl"],
    "unknown_command": ["bogus"],
    "debug": ["-vv", "spec", "check"],
}


def write_inputs(work: Path) -> None:
    """Specs and traces, good and bad, for the commands above."""
    text = DEFAULT_SPEC.read_text(encoding="utf-8")
    bad_dst = text.replace('event = "arrive"\ndst = "AVAILABLE"', 'event = "arrive"\ndst = "GATHERED"')
    assert bad_dst != text
    (work / "bad_dst.toml").write_text(bad_dst, encoding="utf-8")
    (work / "bad_syntax.toml").write_text("[machine\ninitial = 1\n", encoding="utf-8")
    (work / "empty.toml").write_text('[machine]\nname = "empty"\n', encoding="utf-8")
    scenario_trace().dump(work / "good.jsonl")
    scenario_trace(rank=1).dump(work / "rank1.jsonl")
    scenario_trace(rank=1, leak=True).dump(work / "leak.jsonl")
    records = scenario_trace().records
    records[5] = attrs.evolve(records[5], dst="DEFERRED_RELEASE")
    (work / "tampered.jsonl").write_text("".join(json.dumps(r.to_json()) + "\n" for r in records), encoding="utf-8")
    first = (work / "good.jsonl").read_text(encoding="utf-8").splitlines()[0]
    (work / "malformed.jsonl").write_text(first + "\n{not json\n", encoding="utf-8")


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("cli")
    write_inputs(work)
    return work


@pytest.fixture(scope="module")
def runs(work) -> dict[str, subprocess.CompletedProcess]:
    """Run every command line of COMMANDS as ``python -m paramfsm``, concurrently: each pays the import."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    procs = {name: subprocess.Popen([sys.executable, "-m", "paramfsm", *args], cwd=work, env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for name, args in COMMANDS.items()}
    done = {}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_no_traceback(runs, name):
    assert "Traceback" not in runs[name].stderr, runs[name].stderr


# -------------------------------------------------------------------- spec


def test_spec_check_shipped(runs):
    done = runs["spec_check"]
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("OK: ") and "4 states" in done.stdout and "14 events" in done.stdout
    assert str(DEFAULT_SPEC) in done.stdout and done.stderr == ""


def test_spec_check_invalid_spec_names_file_and_entry(runs):
    done = runs["spec_check_invalid"]
    assert done.returncode == 1 and done.stdout == ""
    assert "bad_dst.toml: transition #" in done.stderr and "unknown dst state 'GATHERED'" in done.stderr


def test_spec_check_missing_file_is_a_usage_error(runs):
    done = runs["spec_check_missing"]
    assert done.returncode == 2 and "no such file: absent.toml" in done.stderr


def test_spec_draw(runs, work):
    done = runs["spec_draw"]
    assert done.returncode == 0, done.stderr
    assert "stateDiagram-v2" in done.stdout and "DEFERRED_RELEASE --> AVAILABLE" in done.stdout
    done = runs["spec_draw_file"]
    assert done.returncode == 0, done.stderr
    drawn = (work / "out" / "lifetime.mmd").read_text(encoding="utf-8")
    assert drawn.strip() == runs["spec_draw"].stdout.strip()


# ------------------------------------------------------------------- trace


def test_trace_check_clean(runs):
    done = runs["check_clean"]
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"{TRACE_LEN} records replay cleanly")


def test_trace_check_names_first_illegal_record(runs):
    done = runs["check_tampered"]
    assert done.returncode == 1
    assert "record 5 (seq 5" in done.stderr and "DEFERRED_RELEASE" in done.stderr


def test_trace_check_malformed(runs):
    done = runs["check_malformed"]
    assert done.returncode == 1 and "malformed.jsonl:2: not a trace record" in done.stderr


def test_trace_summary_shows_leaks(runs):
    done = runs["summary_leak"]
    assert done.returncode == 0, done.stderr
    assert f"{TRACE_LEN - 2} records" in done.stdout and "gathers: 6" in done.stdout
    assert "leaks: 2" in done.stdout and "'enc.weight'" in done.stdout


def test_trace_export(runs, work):
    done = runs["export"]
    assert done.returncode == 0, done.stderr
    doc = json.loads((work / "perf" / "t.json").read_text(encoding="utf-8"))
    assert any(e["ph"] == "X" for e in doc["traceEvents"])


def test_trace_diff_names_divergence(runs):
    done = runs["diff_differ"]
    assert done.returncode == 1 and "record 5 differs in 'dst'" in done.stderr


def test_unknown_command_is_a_usage_error(runs):
    done = runs["unknown_command"]
    assert done.returncode == 2 and "invalid choice: 'bogus'" in done.stderr


def test_verbose_logs_to_stderr(runs):
    done = runs["debug"]
    assert done.returncode == 0 and "DEBUG paramfsm.cli" in done.stderr


# In process, through cli.main: more paths, without paying for a process each.


def run_main(capsys, *args) -> tuple[int, str, str]:
    status = cli.main(list(map(str, args)))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return status, out, err


@pytest.fixture
def in_work(work, monkeypatch):
    monkeypatch.chdir(work)
    return work


def test_main_malformed_toml(in_work, capsys):
    status, _, err = run_main(capsys, "spec", "check", "bad_syntax.toml")
    assert status == 1 and "bad_syntax.toml: toml: not valid TOML" in err


def test_main_trace_check_missing_file_and_invalid_spec(in_work, capsys):
    status, _, err = run_main(capsys, "trace", "check", "absent.jsonl")
    assert status == 2 and "no such file: absent.jsonl" in err
    status, _, err = run_main(capsys, "trace", "check", "good.jsonl", "--spec", "empty.toml")
    assert status == 1 and "invalid spec: empty.toml: states: missing" in err


def test_main_summary_of_clean_trace(in_work, capsys):
    status, out, _ = run_main(capsys, "trace", "summary", "good.jsonl")
    assert status == 0 and f"{TRACE_LEN} records" in out and "leaks: none" in out


def test_main_export_needs_an_output(in_work, capsys):
    status, _, err = run_main(capsys, "trace", "export", "good.jsonl")
    assert status == 2 and "--perfetto" in err


def test_main_diff_of_agreeing_ranks(in_work, capsys):
    status, out, _ = run_main(capsys, "trace", "diff", "good.jsonl", "rank1.jsonl")
    assert status == 0 and f"the traces agree ({TRACE_LEN} records)" in out


def test_main_usage(in_work, capsys):
    status, _, err = run_main(capsys)
    assert status == 2 and "required: COMMAND" in err
    status, out, _ = run_main(capsys, "--help")
    assert status == 0 and "spec" in out and "trace" in out
    status, _, err = run_main(capsys, "spec", "draw", "-o")
    assert status == 2 and "expected one argument" in err


# In process: the place where optional command groups plug in.

PLUGIN = '''
def add_parser(subparsers):
    parser = subparsers.add_parser("greet", help="a command from another module")
    parser.add_argument("name")
    parser.set_defaults(func=lambda args: print(f"hello {args.name}") or 3)
'''


def test_optional_command_group_is_registered(tmp_path, monkeypatch, capsys):
    (tmp_path / "greet_plugin.py").write_text(PLUGIN, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "OPTIONAL_COMMANDS", {"greet": "greet_plugin", "absent": "no_such_module_here"})
    assert cli.main(["greet", "world"]) == 3
    assert capsys.readouterr().out == "hello world\n"


def test_builtin_commands_do_not_import_optional_groups(tmp_path, monkeypatch):
    (tmp_path / "exploding_plugin.py").write_text("raise SystemError('imported')\n", encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "OPTIONAL_COMMANDS", {"explode": "exploding_plugin"})
    assert cli.main(["spec", "check"]) == 0
