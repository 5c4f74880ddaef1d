"""``examples/train_lm.py`` under real torchrun at world 2: it trains, checkpoints, and resumes exactly."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "examples" / "train_lm.py"
COMMON = ["--save-every", "3", "--depth", "2", "--dim", "32", "--seq", "16", "--batch", "4"]


def _torchrun(*args: str, out: Path, restarts: int = 0) -> subprocess.Popen:
    # [Note: restarts need their own store] torchrun shares its rendezvous store with the workers'
    # init_process_group; a restarted group can read the killed group's addresses from it and fail or
    # hang connecting (pytorch/pytorch#135712). TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives each group its own.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "--max-restarts", str(restarts), str(SCRIPT), *COMMON, "--out", str(out), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)


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


def _workers(agent: int) -> dict[int, int]:
    """LOCAL_RANK -> pid of the worker processes the torchrun agent ``agent`` runs now."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (entry / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == agent:
            for item in environ:
                if item.startswith(b"LOCAL_RANK="):
                    found[int(item.split(b"=", 1)[1])] = int(entry.name)
    return found


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="finds the workers through /proc")
def test_a_killed_rank_restarts_under_torchrun_and_training_continues_from_the_newest_checkpoint(tmp_path):
    """``torchrun --max-restarts 3 ... --resume auto``: rank 1 is killed mid-run; the group restarts from the
    newest complete checkpoint and ends with the losses of an uninterrupted run (same cadence, same data)."""
    steps = ["--steps", "12", "--resume", "auto"]
    whole = _losses(_torchrun(*steps, out=tmp_path / "straight"))
    run = _torchrun(*steps, out=tmp_path / "killed", restarts=3)
    watchdog = threading.Timer(240, os.killpg, (run.pid, signal.SIGKILL))  # a hung restart fails, never hangs
    watchdog.start()
    lines, killed = [], None
    try:
        for line in run.stdout:
            lines.append(line)
            if killed is None and line.startswith("step 5/12"):
                killed = _workers(run.pid).get(1)
                assert killed is not None, "no worker with LOCAL_RANK=1 under the agent"
                os.kill(killed, signal.SIGKILL)
        run.wait(timeout=30)
    finally:
        watchdog.cancel()
    output = "".join(lines)
    assert run.returncode == 0, output[-3000:]
    resumed = re.findall(r"^resumed from .*step-(\d+) at step (\d+)", output, re.M)
    assert killed is not None and resumed, output[-3000:]
    assert int(resumed[-1][1]) in (3, 6), resumed  # the newest complete checkpoint when rank 1 died
    losses = {}
    for step, loss in re.findall(r"^step (\d+)/\d+ loss ([\d.]+)", output, re.M):
        losses[int(step)] = float(loss)  # a step run again after the restart: its later line wins
    assert sorted(losses) == list(range(1, 13)), sorted(losses)
    for step in range(1, 13):
        assert abs(losses[step] - whole[step]) < 1e-4, f"step {step}: restarted {losses[step]}, straight {whole[step]}"
