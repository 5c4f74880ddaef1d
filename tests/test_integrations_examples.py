"""``examples/hf_trainer.py``: what it leaves behind, and where.

Its default output folder is one the checkout's ``.gitignore`` covers, so a
run from the checkout leaves no untracked files; a run (real torchrun, world
2, two steps) writes there and names the folder on its last line.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "examples" / "hf_trainer.py"


def load_example():
    spec = importlib.util.spec_from_file_location("hf_trainer_example", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def ignored(path: str) -> bool:
    """Whether git ignores ``path`` (relative to the checkout) under the checkout's own ``.gitignore``."""
    done = subprocess.run(["git", "-C", str(REPO), "check-ignore", "--no-index", "-q", path], capture_output=True)
    assert done.returncode in (0, 1), done.stderr
    return done.returncode == 0


@pytest.fixture(scope="module")
def git():
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("needs a git checkout")


def test_default_output_folders_are_ignored(git):
    pytest.importorskip("transformers")
    default = load_example().parse_args([]).out
    assert not os.path.isabs(default)
    assert ignored(os.path.join(default, "final", "model.safetensors")), default
    assert ignored("runs/lm/step-3/.metadata"), "the README's examples/train_lm.py --out runs/lm"


@pytest.mark.slow
def test_example_writes_under_its_output_folder_and_says_where(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(SCRIPT), "--steps", "2", "--batch", "2", "--seq", "8"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = tmp_path / "runs" / "hf-trainer"
    assert (out / "final" / "model.safetensors").is_file()
    assert f"checkpoints and the final model are in {out}" in done.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"], "nothing outside the output folder"
