"""``paramfsm verify`` from the command line: exit statuses, factory errors, progress, rejections, saved scripts.

Exit status 0: every program passed; 1: a lifetime bug; 2: a usage or factory
error, named in one line with the user's source line and never a traceback.
The factories of these tests are modules written to a temporary folder that
is the current directory, as a user runs the command.
"""

from __future__ import annotations

import importlib
import io
import os
import re
import subprocess
import sys
import textwrap
import types

import pytest

from paramfsm import cli
from paramfsm.verify.subject import import_root
from paramfsm.verify.command import ProgressLine, rejections
from paramfsm.verify.programs import CANONICAL

USER_MODEL = """\
import torch
import torch.nn.functional as F


def make_batch(generator, n):
    return torch.randn(n, 5, generator=generator), torch.randn(n, 3, generator=generator)


def make():
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3)), make_batch, F.mse_loss
"""


@pytest.fixture
def user_folder(tmp_path, monkeypatch):
    """A fresh folder as the current directory; sys.path and sys.modules are restored afterwards."""
    folder = tmp_path / "models"
    folder.mkdir()
    monkeypatch.chdir(folder)
    monkeypatch.setattr(sys, "path", list(sys.path))
    importlib.invalidate_caches()
    yield folder
    for name in [name for name, module in sys.modules.items()
                 if str(getattr(module, "__file__", "") or "").startswith(str(folder))]:
        del sys.modules[name]


def _write(folder, name: str, source: str) -> None:
    (folder / f"{name}.py").write_text(textwrap.dedent(source), encoding="utf-8")
    importlib.invalidate_caches()


# ------------------------------------------------------------------ usage and factory errors: status 2

BROKEN = {
    "syntax_error": ("def make(:\n    pass\n", "SyntaxError: ", 1),
    "raising_factory": ("import torch\n\n\ndef make():\n    raise RuntimeError('no GPU here')\n",
                        "RuntimeError: no GPU here", 5),
    "not_a_module": ("def make():\n    return object(), (lambda g, n: None), (lambda o, t: o)\n",
                     "TypeError: the model must be a torch.nn.Module, not object", 1),
    "wrong_tuple": ("import torch\n\n\ndef make():\n    return torch.nn.Linear(2, 2), None\n",
                    "not a 2-tuple", 4),
    "failing_forward": (USER_MODEL.replace("torch.nn.Linear(5, 7)", "torch.nn.Linear(4, 7)"),
                        "the model's forward: RuntimeError: ", None),
    "failing_import": ("import torch\nimport no_such_dependency_here\n",
                       "No module named 'no_such_dependency_here'", 2),
    "unsupported_module": (USER_MODEL.replace("torch.nn.Linear(5, 7)", "torch.nn.EmbeddingBag(5, 7, max_norm=1.0)"),
                           "the model cannot run under paramfsm: ParamFSMError: module '0' is "
                           "EmbeddingBag(max_norm=1.0)", None),
}


@pytest.mark.parametrize("name", list(BROKEN))
def test_a_broken_factory_is_named_in_one_line(user_folder, capsys, name):
    source, cause, line = BROKEN[name]
    _write(user_folder, name, source)
    assert cli.main(["verify", f"{name}:make"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err, err
    assert err.count("\n") == 1 and err.startswith(f"paramfsm: error: cannot use the verify factory {name}:make: "), err
    assert cause in err, err
    if line is not None:
        assert f"(at {user_folder / name}.py:{line})" in err, err


@pytest.mark.parametrize("argv, cause", [
    (["verify", "no_such_module:factory"], "ModuleNotFoundError: No module named 'no_such_module'"),
    (["verify", "no_colon_here"], "expected MODULE:FACTORY"),
    (["verify", "paramfsm.testing.subjects:no_such_factory"], "has no attribute 'no_such_factory'"),
    (["verify", "paramfsm.testing.subjects:mlp_regression", "--fault", "bogus"], "unknown fault 'bogus'"),
    (["verify", "paramfsm.testing.subjects:mlp_regression", "--world-size", "0"], "world_size=0"),
    (["verify", "paramfsm.testing.subjects:mlp_regression", "--examples", "0"], "examples=0"),
])
def test_usage_errors_exit_2_without_a_traceback(capsys, argv, cause):
    assert cli.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err and err.count("\n") == 1, err
    assert cause in err, err


# ------------------------------------------------------------------ progress

def _progress(done, shrinking=False):
    return types.SimpleNamespace(done=done, planned=20, rejected=2, seconds=3.0, shrinking=shrinking, smallest=4)


def test_progress_lines_are_rate_limited():
    quiet, chatty = io.StringIO(), io.StringIO()
    slow, every = ProgressLine(10.0, quiet), ProgressLine(0.0, chatty)
    for done in range(1, 6):
        slow(_progress(done))
        every(_progress(done))
    every(_progress(6, shrinking=True))
    assert quiet.getvalue() == "", "a short run prints no progress"
    lines = chatty.getvalue().splitlines()
    assert lines[0] == "verify: 1/20 programs, 2 rejected, 3s" and len(lines) == 6
    assert lines[-1].startswith("verify: shrinking a failure, 6 programs run, the smallest has 4 ops")
    off = io.StringIO()
    ProgressLine(-1.0, off)(_progress(1))
    assert off.getvalue() == ""


# ------------------------------------------------------------------ model limits are not bugs: status 0

@pytest.mark.slow
def test_programs_plain_torch_cannot_run_are_rejected_not_reported(capsys):
    """A model without double backward: its gradient-penalty programs are rejected, the rest pass."""
    assert cli.main(["verify", "paramfsm.testing.subjects:once_differentiable_mlp", "--examples", "4",
                     "--progress", "0"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("OK: ") and out.count("\n") == 1, out
    match = re.search(r"; (\d+) programs? rejected: plain torch cannot run (?:them|it) on this model: "
                      r"Penalty op: RuntimeError: trying to differentiate twice .*once_differentiable \((\d+)\)", out)
    assert match and match.group(1) == match.group(2) and int(match.group(1)) >= 1, out
    assert "Subject(create_graph=False)" in out
    assert re.search(r"^verify: \d+/\d+ programs, 1 rejected, \d+s$", err, re.M), err
    total = len(CANONICAL) + 4
    assert re.search(rf"^verify: \d+/{total} programs", err, re.M), "--examples 4: 4 drawn after the canonical"
    assert "Traceback" not in err


@pytest.mark.slow
def test_a_passing_verify_prints_nothing_but_its_result(capfd, tmp_path, monkeypatch):
    """Its canonical programs end in accepted outcomes (every rank raising RankDesync, every rank refusing a
    write inside forward), whose flight-recorder dumps verify removes: no notice names one of them."""
    monkeypatch.setenv("PARAMFSM_TRACE_DIR", str(tmp_path))  # read when a rank pool starts
    assert cli.main(["verify", "paramfsm.testing.subjects:mlp_regression", "--examples", "1",
                     "--progress", "-1"]) == 0
    out, err = capfd.readouterr()
    assert out.startswith("OK: ") and out.count("\n") == 1, out
    assert err == "", err
    assert not list(tmp_path.iterdir())


def test_the_rejection_summary_counts_by_reason():
    text = rejections({"Penalty op: RuntimeError: no double backward": 3, "Forward op: ValueError: eval": 1})
    assert text == ("4 programs rejected: plain torch cannot run them on this model: "
                    "Penalty op: RuntimeError: no double backward (3); Forward op: ValueError: eval (1) "
                    "(Subject(checkpoint=False) draws no activation checkpointing, Subject(blocks=()) no "
                    "per-block reentrant checkpointing; "
                    "Subject(create_graph=False) draws no gradient penalties)")
    assert rejections({"Loss op: KeyError: 'x'": 1}).startswith("1 program rejected: plain torch cannot run it ")


# ------------------------------------------------------------------ a bug: status 1, and a script that reproduces it

@pytest.mark.slow
def test_a_saved_reproduction_fails_where_it_is_saved_and_passes_on_fixed_code(user_folder, tmp_path, capsys):
    """verify -o saves a script that imports the factory from where verify found it and runs verify's checks."""
    _write(user_folder, "user_model", USER_MODEL)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    saved = elsewhere / "repro.py"
    assert cli.main(["verify", "user_model:make", "--examples", "4", "--no-shrink",
                     "--fault", "grads_summed_not_averaged", "-o", str(saved)]) == 1
    out, err = capsys.readouterr()
    assert out == saved.read_text(encoding="utf-8") and "# <- fails here" in out
    # A progress line may come first: the command prints one when a program runs longer than 10 s.
    assert re.search(r"^paramfsm: error: reference check failed at op", err, re.M) and "Traceback" not in err, err
    assert f"the reproduction is in {saved}" in err
    assert import_root("user_model:make") == str(user_folder)
    assert f"sys.path.insert(0, {str(user_folder)!r})" in out
    fixed = elsewhere / "fixed.py"
    fixed.write_text(re.sub(r"^FAULT = .*$", "FAULT = None", out, flags=re.M), encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # the scripts' own sys.path line must find user_model
    runs = {path: subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(path)],
        cwd=elsewhere, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for path in (saved, fixed)}
    outputs = {path: proc.communicate(timeout=240)[0] for path, proc in runs.items()}
    assert runs[fixed].returncode == 0, outputs[fixed][-3000:]
    assert runs[saved].returncode != 0, outputs[saved][-3000:]
    assert re.search(r"rank \d: reference check failed at op \d+: the gradient of '\S+' differs from the reference",
                     outputs[saved]), outputs[saved][-3000:]
