"""``paramfsm.integrations.lightning.ParamFSMStrategy`` on one rank, in the test process (``one_rank``).

The fits of ``tests/test_integrations_lightning.py`` (two gloo ranks) run here
with ``devices=1`` on a world-1 group, against plain Lightning over the same
batches, so ``make mutate`` sees the strategy: clipping, accumulation,
bf16-mixed, a resume from a sharded checkpoint and the step each batch names.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from paramfsm.errors import ParamFSMError

L = pytest.importorskip("lightning.pytorch")

from one_rank import one_rank  # noqa: E402,F401 - the fixture
from paramfsm.integrations.lightning import ParamFSMStrategy  # noqa: E402 - after the skip
from test_integrations_lightning import (  # noqa: E402 - the module and fits both files run
    BATCHES, DIM, PER_RANK, WORLD, Regressor, loaders, resume_job, sharded_fit, steps_job, trainer,
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


class Eager(Regressor):
    """The same module built in ``__init__`` (on the CPU), not in ``configure_model``."""

    def __init__(self, half: bool = False):
        super().__init__()
        if not half:
            Regressor.configure_model(self)
        else:  # one layer now, the rest in configure_model: refused, naming both
            self.first = nn.Linear(DIM, DIM)

    def configure_model(self):
        if getattr(self, "first", None) is not None and self.net is None:
            Regressor.configure_model(self)

    def forward(self, x):
        return super().forward(self.first(x) if getattr(self, "first", None) is not None else x)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0])


def _strategy_trainer(root, strategy, **kwargs):
    return trainer(root, 1, 1, "32-true", devices=1, strategy=strategy, **kwargs)


def test_a_module_built_in_init_is_sharded_where_it_is_and_tests_and_predicts_as_plain(one_rank, tmp_path):
    plain, ours = Eager(), Eager()
    train, val = loaders(PER_RANK, one_process=True)
    trainer(tmp_path / "p", 1, 1, "32-true", devices=1).fit(plain, train, val)
    strategy = ParamFSMStrategy()
    fit = _strategy_trainer(tmp_path / "s", strategy)
    fit.fit(ours, *loaders(PER_RANK))
    assert strategy.runtime.model is ours and not any(p.is_meta for p in ours.parameters())
    (want,) = trainer(tmp_path / "p", 1, 1, "32-true", devices=1).test(plain, val, verbose=False)
    (got,) = fit.test(ours, val, verbose=False)
    assert got["test_loss"] == pytest.approx(want["test_loss"], rel=1e-5)
    predicted = torch.cat(fit.predict(ours, val))
    with torch.no_grad():
        expected = plain(torch.cat([x for x, _ in val]))
    assert torch.allclose(predicted, expected, atol=1e-5)
    strategy.runtime.close()


def test_a_module_built_half_in_init_and_half_in_configure_model_is_refused(one_rank, tmp_path):
    strategy = ParamFSMStrategy()
    with pytest.raises(ParamFSMError) as caught:
        _strategy_trainer(tmp_path, strategy).fit(Eager(half=True), *loaders(PER_RANK))
    assert str(caught.value) == (
        "ParamFSMStrategy (rank 0): 'gain' of Eager was built in configure_model (on the meta device) but "
        "'first.weight' was built in __init__ (on cpu), so neither way of sharding fits both. What to do: build "
        "every layer in configure_model, or every layer in __init__")


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-true", "16-true"])
def test_precisions_that_would_diverge_are_refused_with_the_whole_fix(precision, tmp_path):
    from lightning.pytorch.plugins.precision import MixedPrecision

    strategy = ParamFSMStrategy()
    if precision == "16-mixed":
        setting = {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]}
    else:
        setting = {"precision": precision}
    L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, default_root_dir=tmp_path, **setting)
    with pytest.raises(ParamFSMError) as caught:
        strategy._check_precision()
    why = ("Lightning's GradScaler would decide on each rank alone whether to skip a step, so the shards would "
           "diverge. " if precision == "16-mixed" else "It converts the module itself. ")
    assert str(caught.value) == (
        f"ParamFSMStrategy (rank 0): precision={precision!r} is not supported. {why}What to do: use "
        "precision='bf16-mixed' or '32-true', or shard in low precision with "
        "ParamFSMStrategy(shard_options={'param_dtype': torch.bfloat16})")


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_precisions_that_work_clip_by_the_global_norm(precision, tmp_path):
    strategy = ParamFSMStrategy()
    L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, default_root_dir=tmp_path,
              precision=precision)
    strategy._check_precision()
    assert strategy.precision_plugin.clip_grad_by_norm == strategy._clip_grad_by_norm


def test_the_strategy_is_one_process_per_device_over_the_whole_data(tmp_path):
    strategy = ParamFSMStrategy(process_group_backend="gloo", shard_options={"prefetch": 2})
    L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, default_root_dir=tmp_path)
    assert ParamFSMStrategy.strategy_name == "paramfsm" and strategy.is_distributed
    assert strategy.num_processes == 1 and strategy.num_nodes == 1
    assert strategy.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}
    assert strategy.root_device == torch.device("cpu") and strategy.shard_options == {"prefetch": 2}
    assert strategy.runtime is None and strategy.restore_checkpoint_after_setup
    assert not strategy.lightning_restore_optimizer
    with pytest.raises(ParamFSMError) as caught:
        ParamFSMStrategy(shard_options={"device": "cpu"})
    assert str(caught.value) == ("ParamFSMStrategy(shard_options={'device': ...}): the strategy shards onto its own "
                                 "device (Trainer(accelerator=..., devices=...)); drop 'device'")


def test_checkpoints_it_cannot_write_or_read_are_refused(one_rank, tmp_path):
    strategy = ParamFSMStrategy()
    fit = _strategy_trainer(tmp_path, strategy)
    fit.fit(Regressor(), *loaders(PER_RANK))
    with pytest.raises(ParamFSMError) as refused:
        strategy.save_checkpoint({}, tmp_path / "ck", storage_options={})
    assert str(refused.value) == ("ParamFSMStrategy.save_checkpoint(storage_options=...) is not supported: the shards "
                                  "are written by paramfsm.checkpoint, not by a CheckpointIO")
    (tmp_path / "plain").mkdir()
    with pytest.raises(ParamFSMError) as caught:
        strategy.load_checkpoint(tmp_path / "plain")
    assert str(caught.value) == (f"ckpt_path='{tmp_path / 'plain'}' (rank 0) has no meta.pt: it was not saved by "
                                 "ParamFSMStrategy. What to do: resume from a folder its save_checkpoint wrote")
    strategy.optimizers = strategy.optimizers * 2
    with pytest.raises(ParamFSMError, match=r"checkpoints one optimizer over the model; configure_optimizers "
                                            r"returned 2 \(rank 0\)"):
        fit.save_checkpoint(tmp_path / "two")
    strategy.runtime.close()


def _named_steps(root, loader, accum, module=None):
    """The steps a fit named on the forwards of its training batches (the trace's first fetch of each)."""
    module = module if module is not None else Regressor()
    strategy = ParamFSMStrategy(shard_options={"trace": True})
    trainer(root, 1, accum, "32-true", devices=1, strategy=strategy).fit(module, loader)
    named = []
    for r in strategy.runtime.trace.records:
        if r.graph_task == -1 and r.event == "fetch" and (not named or named[-1] != r.step):
            named.append(r.step)
    strategy.runtime.close()
    return named


def test_without_accumulation_every_batch_is_a_step(one_rank, tmp_path):
    train, _ = loaders(PER_RANK)
    assert _named_steps(tmp_path, train, 1) == list(range(STEPS))


class Stream(torch.utils.data.IterableDataset):
    """Batches with no length: their place is the count of batches taken."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __iter__(self):
        return iter(self.dataset)


def test_a_loader_without_a_length_names_steps_by_the_batches_taken(one_rank, tmp_path):
    train, _ = loaders(PER_RANK)
    stream = torch.utils.data.DataLoader(Stream(train.dataset), batch_size=PER_RANK)
    assert _named_steps(tmp_path, stream, 2) == list(range(STEPS // 2))


def test_an_instance_forward_is_put_back_after_every_step_and_runs_inside_it(one_rank, tmp_path):
    module = Regressor()
    module.configure_model()
    calls = []
    plain = module.forward

    def own(*args, **kwargs):  # stored on the instance, as torch.compile(module.forward) would be
        calls.append(1)
        return plain(*args, **kwargs)
    module.forward = own
    train, _ = loaders(PER_RANK)
    _named_steps(tmp_path, train, 1, module)
    assert module.__dict__.get("forward") is own
    assert len(calls) == STEPS  # the step's self(x) ran the instance's forward
