"""The loops of issue #53 as ``paramfsm verify`` reproductions: each exits 1 on the engine before the fixes.

Each script in ``tests/reproductions/`` is ``paramfsm verify``'s own reproduction of one of the canonical loops
#53 added (rendered from the program), run against plain torch op by op. On the engine this issue started from
each one fails (a whole-parameter optimizer refused; an offloaded step's hooks once per unit; a gradient zeroed
in place in a bounded tier read back from the tier; torch's clipping over shards by each rank's partial norm; a
refused ``shard()`` leaving the model's parameters empty; a write inside forward dropped, on the engine before
``WriteToGathered``; an eval forward of compiled blocks between backward and step raising
``InternalTorchDynamoError(NotGathered)``; a frozen batch norm under bf16 raising torch's dtype error), and now
each exits 0 (the write: every rank refuses it, the accepted outcome).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from paramfsm.verify.reproduction import run_saved

SAVED = Path(__file__).resolve().parent / "reproductions"
LOOPS = ["whole_parameter_optimizer.py", "step_hooks_under_offload.py", "zero_grad_in_bounded_tier.py",
         "plain_clip_over_shards.py", "refused_shard_then_training.py", "write_in_forward.py",
         pytest.param("compiled_eval_between_steps.py", marks=pytest.mark.slow), "batch_norm_under_bf16.py"]


@pytest.mark.parametrize("script", LOOPS)
def test_a_loop_verify_reports_on_the_old_engine_passes(ranks2, script):
    for status, output in ranks2.run(run_saved, str(SAVED / script), timeout=240):
        assert status == 0, output
