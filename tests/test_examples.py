"""``examples/train_lm.py`` under real torchrun at world 2: it trains, checkpoints, and resumes exactly."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "examples" / "train_lm.py"
COMMON = ["--save-every", "3", "--depth", "2", "--dim", "32", "--seq", "16", "--batch", "4"]


def _torchrun(*args: str, out: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             str(SCRIPT), *COMMON, "--out", str(out), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _losses(proc: subprocess.Popen) -> dict[int, float]:
    output = proc.communicate(timeout=240)[0]
    assert proc.returncode == 0, output[-3000:]
    return {int(step): float(loss) for step, loss in re.findall(r"^step (\d+)/\d+ loss ([\d.]+)", output, re.M)}


@pytest.mark.slow
def test_train_lm_resumes_where_it_stopped(tmp_path):
    straight = _torchrun("--steps", "6", out=tmp_path / "straight")
    first = _torchrun("--steps", "3", out=tmp_path / "resumed")
    whole, head = _losses(straight), _losses(first)
    assert sorted(whole) == [1, 2, 3, 4, 5, 6] and whole[6] < whole[1], whole
    assert (tmp_path / "resumed" / "step-3" / ".metadata").is_file()
    tail = _losses(_torchrun("--steps", "6", "--resume", out=tmp_path / "resumed"))
    assert sorted(tail) == [4, 5, 6], "the resumed run must start after its checkpoint"
    for step in (1, 2, 3):
        assert head[step] == whole[step], (step, head, whole)
    for step in (4, 5, 6):
        assert abs(tail[step] - whole[step]) < 1e-4, f"step {step}: resumed {tail[step]}, straight {whole[step]}"
