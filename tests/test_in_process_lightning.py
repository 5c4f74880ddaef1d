"""``paramfsm.integrations.lightning.ParamFSMStrategy`` on one rank, in the test process (``one_rank``).

The fits of ``tests/test_integrations_lightning.py`` (two gloo ranks) run here
with ``devices=1`` on a world-1 group, against plain Lightning over the same
batches, so ``make mutate`` sees the strategy: clipping, accumulation,
bf16-mixed, a resume from a sharded checkpoint and the step each batch names.
"""

from __future__ import annotations

import os

import pytest

L = pytest.importorskip("lightning.pytorch")

from one_rank import one_rank  # noqa: E402,F401 - the fixture
from test_integrations_lightning import (  # noqa: E402 - the module and fits both files run
    BATCHES, PER_RANK, WORLD, Regressor, loaders, resume_job, sharded_fit, steps_job, trainer,
)

#: Batches one rank takes in an epoch: all of them (the data holds BATCHES global batches of WORLD ranks).
STEPS = BATCHES * WORLD


def _plain_fit(root, epochs, accum, precision):
    """Plain Lightning on one device over what one rank takes: the same batches in the same order (Lightning
    shuffles a strategy's training data, also on one rank)."""
    module = Regressor()
    train, val = loaders(PER_RANK, one_process=True)
    trainer(root, epochs, accum, precision, devices=1).fit(module, train, val)
    params = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return params, [float(loss) for loss in module.train_losses], module.val_losses


@pytest.mark.parametrize("accum, precision, min_unit_bytes", [
    (1, "32-true", 0), (2, "32-true", 1 << 16), (1, "bf16-mixed", 0),
], ids=["fp32", "fp32-accumulate-one-unit", "bf16-mixed"])
def test_a_fit_on_one_rank_matches_plain_lightning(one_rank, tmp_path, accum, precision, min_unit_bytes):
    want, want_losses, want_val = _plain_fit(os.path.join(tmp_path, "plain"), 2, accum, precision)
    got, got_losses, got_val, units = sharded_fit(0, 1, os.path.join(tmp_path, "sharded"), 2, accum, precision,
                                                  shard_options={"min_unit_bytes": min_unit_bytes})
    tol = 2e-2 if precision == "bf16-mixed" else 1e-5
    assert sorted(got) == sorted(want)
    assert units == (4 if min_unit_bytes == 0 else 1)
    assert max((got[k] - want[k]).abs().max().item() for k in want) < tol
    assert len(got_losses) == len(want_losses) == 2 * STEPS
    assert max(abs(a - b) for a, b in zip(got_losses, want_losses)) < tol
    assert len(got_val) == len(want_val) == 2 and max(abs(a - b) for a, b in zip(got_val, want_val)) < tol


def test_a_fit_resumed_from_a_checkpoint_ends_where_the_straight_fit_ends(one_rank, tmp_path):
    out = resume_job(0, 1, str(tmp_path))
    assert out["worst"] < 1e-6, out
    assert "meta.pt" in out["listing"] and ".metadata" in out["listing"], out
    assert out["losses"] == STEPS and out["val"] == 1, out


def test_each_batch_names_its_step_and_accumulation_reduces_once_per_step(one_rank, tmp_path):
    out = steps_job(0, 1, str(tmp_path))
    # 2 epochs of STEPS batches, 2 per optimizer step
    assert out["named"] == list(range(STEPS)), out
    assert out["global_step"] == STEPS, out
    assert len(out["reduced"]) == out["params"] and set(out["reduced"].values()) == {STEPS}, out
