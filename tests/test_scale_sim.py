"""``benchmarks/scale_sim.py`` at a small world: the fake group runs the runtime, and the bytes per step
match ZeRO-3's formula (3 x parameter bytes x (N-1)/N)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_scale_simulation_matches_the_zero3_formula():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(REPO / "benchmarks" / "scale_sim.py"), "--worlds", "8", "--steps", "1",
                           "--check"], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    row = next(line for line in done.stdout.splitlines() if re.match(r"\s+8\s", line))
    ratio = float(row.split()[7])
    assert 1.0 <= ratio <= 1.1, row
