"""The loops of issue #52 that the new ``verify`` drew against the engine before their fixes, run as saved.

Each script in ``tests/reproductions/`` is ``paramfsm verify``'s own reproduction from a run of this
verify on the engine before the fixes (where each exits 1), and exits 0 now: the verify checks, every op
against plain torch, in the configuration the program drew (the whole model one unit; units kept from
forward to backward under a deferral bound).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from paramfsm.verify.reproduction import run_saved

SAVED = Path(__file__).resolve().parent / "reproductions"


@pytest.mark.parametrize("script", ["merged_unit_interrupted_backward.py", "kept_unit_read_by_root.py"])
def test_a_loop_verify_found_on_the_old_engine_passes(ranks2, script):
    for status, output in ranks2.run(run_saved, str(SAVED / script), timeout=240):
        assert status == 0, output
