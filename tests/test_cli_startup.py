"""What the ``paramfsm`` command costs to start and how it ends when its reader goes away.

* ``--help``, ``spec`` and ``trace`` never import torch (seconds of import on
  a cold machine): each runs as ``python -X importtime -m paramfsm ...``,
  whose stderr names every module imported.
* Output into a closed pipe (``paramfsm trace summary T.jsonl | head``) ends
  with status 141 and nothing on stderr, not a ``BrokenPipeError`` traceback
  (``--help`` with 0: argparse drops a failed write of its help itself).
  The pipe's read end is closed before the command starts, so every write
  fails, whatever the timing.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from scenario_traces import scenario_trace

from paramfsm import cli
from paramfsm.core.spec import DEFAULT_SPEC

REPO = Path(__file__).resolve().parent.parent
ENV = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))

#: Command lines that must start without torch, run together (each process pays for its own imports).
LIGHT = {
    "help": ["--help"],
    "no_command": [],
    "typo": ["bogus"],
    "spec_check": ["spec", "check"],
    "spec_draw": ["spec", "draw", str(DEFAULT_SPEC)],
    "trace_check": ["trace", "check", "good.jsonl"],
    "trace_summary": ["trace", "summary", "good.jsonl"],
    "trace_export": ["trace", "export", "good.jsonl", "--perfetto", "t.json"],
    "trace_diff": ["trace", "diff", "good.jsonl", "rank1.jsonl"],
}
#: Command lines whose output goes to a pipe nobody reads.
PIPED = {
    "help": ["--help"],
    "spec_draw": ["spec", "draw"],
    "trace_summary": ["trace", "summary", "good.jsonl"],
    "trace_check": ["trace", "check", "good.jsonl"],
}
IMPORTED = re.compile(r"^import time:.*\|\s*(\S+)$", re.MULTILINE)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("cli-startup")
    scenario_trace().dump(work / "good.jsonl")
    scenario_trace(rank=1).dump(work / "rank1.jsonl")
    return work


@pytest.fixture(scope="module")
def imports(work) -> dict[str, tuple[int, set[str]]]:
    """name -> (exit status, modules imported) for every command line of LIGHT."""
    procs = {name: subprocess.Popen([sys.executable, "-X", "importtime", "-m", "paramfsm", *args], cwd=work,
                                    env=ENV, text=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for name, args in LIGHT.items()}
    done = {}
    for name, proc in procs.items():
        _, err = proc.communicate(timeout=300)
        done[name] = (proc.returncode, set(IMPORTED.findall(err)))
    return done


@pytest.mark.parametrize("name", sorted(LIGHT))
def test_command_does_not_import_torch(imports, name):
    status, modules = imports[name]
    assert status == {"help": 0, "no_command": 2, "typo": 2}.get(name, 0)
    assert "paramfsm.cli" in modules, "the import log was not read"
    assert not {"torch", "numpy", "hypothesis", "paramfsm.verify"} & modules, sorted(modules)


def test_help_lists_verify_without_importing_it(capsys):
    before = set(sys.modules)
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "verify" in out and cli.OPTIONAL_HELP["verify"].split()[0] in out
    assert "paramfsm.verify.command" not in set(sys.modules) - before


def test_verify_help_still_imports_the_command(capsys):
    assert cli.main(["verify", "--help"]) == 0
    assert "--world-size" in capsys.readouterr().out


def test_missing_optional_module_is_not_listed(monkeypatch, capsys):
    monkeypatch.setattr(cli, "OPTIONAL_COMMANDS", {"absent": "paramfsm.no_such_module"})
    assert cli.main(["--help"]) == 0
    assert "absent" not in capsys.readouterr().out
    assert not cli._module_exists("paramfsm.no_such_package.command")
    assert cli._module_exists("paramfsm.verify.command")


@pytest.mark.parametrize("name", sorted(PIPED))
def test_closed_pipe_ends_quietly(work, name):
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([sys.executable, "-m", "paramfsm", *PIPED[name]], cwd=work, env=ENV, text=True,
                              stdout=write_end, stderr=subprocess.PIPE, timeout=300)
    finally:
        os.close(write_end)
    assert done.stderr == ""
    assert done.returncode == (0 if name == "help" else cli.CLOSED_PIPE)
