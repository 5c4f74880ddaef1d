"""``ShardedTrainer`` names each optimizer step with ``rt.set_step(state.global_step)``.

A rank that skips a whole step (its ``training_step`` returns early, as an
override that drops a bad batch would, and it computes no gradient norm for
that step) must raise ``RankDesync`` on every rank at its next collective,
naming both ranks' steps. Without the step numbers the ranks count forwards,
pair rank 0's step 1 with rank 1's step 2 silently, and the run ends in a
``CollectiveTimeout`` when rank 0 runs the step rank 1 never will.

The Trainer's own collectives are kept out of the way, since paramfsm's
rank-order check does not see them: no loss gathered for logging inside the
run, and no token count gathered across ranks (``average_tokens_across_devices``).
"""

from __future__ import annotations

import tempfile

import pytest
import torch

import paramfsm
from paramfsm.errors import RankDesync

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (transformers[torch])")

from paramfsm.integrations import hf  # noqa: E402 - after the skips
from test_hf_trainer import PER_RANK, arguments, build, dataset, torchrun_env  # noqa: E402

SKIPPED = 1  # the optimizer step rank 1 skips


class SkippingTrainer(hf.ShardedTrainer):
    """Rank 1 drops step SKIPPED: no forward, no backward, no gradient norm."""

    def skips(self) -> bool:
        return self.runtime.rank == 1 and self.state.global_step == SKIPPED

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self.skips():
            return torch.zeros(())
        return super().training_step(model, inputs, num_items_in_batch)

    def _get_grad_norm(self, model, grad_norm=None):
        return 0.0 if self.skips() else super()._get_grad_norm(model, grad_norm)


def skipping_job(rank, world):
    with torchrun_env(rank, world), tempfile.TemporaryDirectory() as out:
        model = build()
        rt = paramfsm.shard(model, collective_timeout=20)  # without step numbers: fail in 20 s, not hang
        args = arguments(out, PER_RANK, save_strategy="no", logging_steps=100, max_grad_norm=0.0,
                         average_tokens_across_devices=False)
        trainer = SkippingTrainer(model=model, args=args, train_dataset=dataset(), runtime=rt)
        try:
            trainer.train()
        except RankDesync as exc:
            rt.reset()
            rt.detach()
            return exc.rank, exc.step, str(exc)
        rt.detach()
        return None


def test_a_rank_skipping_a_trainer_step_raises_rank_desync(ranks2):
    results = ranks2.run(skipping_job, timeout=90)
    assert all(r is not None for r in results), "a rank that skipped a step was paired silently"
    for rank, (err_rank, step, message) in enumerate(results):
        assert err_rank == rank, message
        assert step == (SKIPPED if rank == 0 else SKIPPED + 1), message
        assert f"at step {SKIPPED}" in message and f"at step {SKIPPED + 1}" in message, message
