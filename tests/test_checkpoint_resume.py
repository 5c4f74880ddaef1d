"""``examples/train_lm.py --resume`` at world 1 (one process, no torchrun): what it says and what it refuses.

``tests/test_examples.py`` checks, under torchrun at world 2, that a resumed
run continues exactly; these check the cases around it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from paramfsm.verify.launch import free_port

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "examples" / "train_lm.py"
SMALL = ["--depth", "1", "--dim", "16", "--seq", "8", "--batch", "2", "--accum", "1", "--save-every", "1"]


def _run(out: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, str(SCRIPT), *SMALL, "--out", str(out), *args], capture_output=True,
                          text=True, timeout=300, env=env)


def _steps(done: subprocess.CompletedProcess) -> list[int]:
    return [int(n) for n in re.findall(r"^step (\d+)/\d+ loss", done.stdout, re.M)]


@pytest.mark.slow
def test_resume_says_when_there_is_nothing_to_resume_and_refuses_fewer_steps(tmp_path):
    out = tmp_path / "run"
    first = _run(out, "--steps", "2", "--resume")
    assert first.returncode == 0, first.stderr[-3000:]
    assert f"nothing to resume in {out} (no complete checkpoint): starting from step 0" in first.stdout
    assert _steps(first) == [1, 2]
    (out / ".step-3.staging-0").mkdir()  # an unfinished save: never resumed from
    refused = _run(out, "--steps", "1", "--resume", "auto")
    assert refused.returncode != 0 and _steps(refused) == []
    assert (f"--steps 1 is below the step of the checkpoint to resume ({out / 'step-2'}, step 2): pass --steps "
            "above 2 to train on from it") in refused.stderr, refused.stderr[-2000:]
    resumed = _run(out, "--steps", "3", "--resume", "auto", "--keep-last", "2", "--async-save")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {out / 'step-2'} at step 2: training to step 3" in resumed.stdout
    assert _steps(resumed) == [3]
    assert sorted(p.name for p in out.glob("step-*")) == ["step-2", "step-3"], "keep_last=2 keeps the newest two"
