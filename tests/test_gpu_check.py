"""``make gpu-check`` on a machine without a GPU: a clean refusal, and the parts that need no device."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from paramfsm.testing import gpu_check

REPO = Path(__file__).resolve().parent.parent

SAMPLE = """\
case              op               method          ms      GB/s  vs copy
small(1000)       unpack_gathered  kernel       0.050     640.0     0.90
small(1000)       unpack_gathered  naive        4.000       8.0     0.01
large(8, 64.0M)   unpack_gathered  kernel       0.080    3300.0     0.85
large(8, 64.0M)   unpack_gathered  copy         0.068    3900.0     1.00
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_refuses_cleanly_without_a_gpu():
    done = subprocess.run([sys.executable, "-m", "paramfsm.testing.gpu_check"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1 and "no CUDA device" in lines[0], done.stdout
    assert "Traceback" not in done.stderr


def test_reads_the_benchmark_table():
    rows = gpu_check.parse_gather_scatter(SAMPLE)
    assert rows[("small", "unpack_gathered", "naive")] == (4.0, 0.01)
    assert rows[("large", "unpack_gathered", "kernel")] == (0.08, 0.85)
    assert len(rows) == 4


def test_installs_the_extras_from_pyproject():
    assert gpu_check.requirement("cupy").startswith("cupy-cuda")
    assert gpu_check.requirement("hypothesis").startswith("hypothesis")
    assert gpu_check.requirement("transitions").startswith("transitions")


def test_a_failed_row_fails_the_check_and_a_platform_limit_does_not():
    table = gpu_check.Table()
    table.add("a", True, "fine")
    table.add("b", None, "gloo cannot do this")
    assert table.ok
    table.add("c", False, "wrong values")
    assert not table.ok
