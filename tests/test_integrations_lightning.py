"""``paramfsm.integrations.lightning.ParamFSMStrategy`` on 2 gloo ranks against plain Lightning on 1 process.

One ``LightningModule`` (:class:`Regressor`, built in ``configure_model``, so
on the meta device under the strategy) is fit twice: with
``Trainer(devices=2, strategy=ParamFSMStrategy())``, each rank taking its half
of every global batch through Lightning's distributed sampler, and with a
plain ``Trainer(devices=1)`` over the global batch. Final parameters, the
global training losses and the validation losses between epochs must agree,
with gradient clipping by norm, with and without gradient accumulation, in
float32 and bf16-mixed. A fit stopped after one epoch and resumed with
``ckpt_path=`` ends where the straight fit ends, and each batch names its
optimizer step (``rt.set_step``).
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from torch import nn

from paramfsm.errors import ParamFSMError

L = pytest.importorskip("lightning.pytorch")

from paramfsm.integrations.lightning import ParamFSMStrategy  # noqa: E402 - after the skip

DIM, PER_RANK, WORLD, BATCHES = 8, 2, 2, 4
CLIP = 0.5
#: every rank's share of one global batch, as Lightning's DistributedSampler (shuffle=False) deals it
SAMPLES = BATCHES * PER_RANK * WORLD


class Regressor(L.LightningModule):
    """A small MLP with a parameter of the module's own (its root unit), built in ``configure_model``."""

    def __init__(self):
        super().__init__()
        self.net = None
        self.train_losses: list[torch.Tensor] = []
        self.val_losses: list[float] = []

    def configure_model(self):
        if self.net is not None:
            return
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))
        self.gain = nn.Parameter(torch.empty(1))
        self.reset_parameters()

    def reset_parameters(self):
        with torch.no_grad():
            self.gain.fill_(1.5)

    def forward(self, x):
        return self.net(x) * self.gain

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.train_losses.append(loss.detach().float())
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def on_validation_epoch_end(self):
        self.val_losses.append(float(self.trainer.callback_metrics["val_loss"]))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2, weight_decay=0.1)


class DistributedOrder(torch.utils.data.Sampler):
    """The order in which Lightning's DistributedSampler (``shuffle=True``, seed 0: Lightning always shuffles
    training data on several ranks) deals epoch ``e``'s samples, for the one-process run: global batch ``k``
    holds exactly the samples of every rank's batch ``k``."""

    def __init__(self, n):
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=torch.Generator().manual_seed(self.epoch)).tolist())

    def __len__(self):
        return self.n


def loaders(batch_size, one_process=False):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, DIM, generator=gen)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True).sin())
    vx = torch.randn(SAMPLES // 2, DIM, generator=gen)
    val = torch.utils.data.TensorDataset(vx, vx.sum(dim=1, keepdim=True).sin())
    order = DistributedOrder(SAMPLES) if one_process else None
    return (torch.utils.data.DataLoader(data, batch_size=batch_size, sampler=order),
            torch.utils.data.DataLoader(val, batch_size=batch_size, shuffle=False))


@contextlib.contextmanager
def launched(rank, world):
    """The variables torchrun sets, so Lightning joins the processes (and process group) that exist."""
    wanted = {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": world, "NODE_RANK": 0}
    saved = {key: os.environ.get(key) for key in wanted}
    os.environ.update({key: str(value) for key, value in wanted.items()})
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def trainer(root, epochs, accum, precision, **kwargs):
    return L.Trainer(accelerator="cpu", max_epochs=epochs, accumulate_grad_batches=accum, precision=precision,
                     gradient_clip_val=CLIP, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=root, **kwargs)


def plain_fit(root, epochs, accum, precision):
    """Plain Lightning on this process over the global batch."""
    module = Regressor()
    train, val = loaders(PER_RANK * WORLD, one_process=True)
    trainer(root, epochs, accum, precision, devices=1).fit(module, train, val)
    params = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return params, [float(loss) for loss in module.train_losses], module.val_losses


def sharded_fit(rank, world, root, epochs, accum, precision, *, ckpt_path=None, save=None, **strategy_kwargs):
    module = Regressor()
    strategy = ParamFSMStrategy(**strategy_kwargs)
    train, val = loaders(PER_RANK)
    with launched(rank, world):
        fit = trainer(root, epochs, accum, precision, devices=world, strategy=strategy)
        fit.fit(module, train, val, ckpt_path=ckpt_path)
        if save is not None:
            fit.save_checkpoint(save)
    rt = strategy.runtime
    params = rt.full_state_dict()
    losses = torch.stack(module.train_losses) if module.train_losses else torch.zeros(0)
    torch.distributed.all_reduce(losses)
    units = len(rt.units)
    rt.close()
    return params, [float(loss) / world for loss in losses], module.val_losses, units


def compare_job(rank, world, root, accum, precision, min_unit_bytes):
    want, want_losses, want_val = plain_fit(os.path.join(root, f"plain-{rank}"), 2, accum, precision)
    got, got_losses, got_val, units = sharded_fit(rank, world, os.path.join(root, "sharded"), 2, accum, precision,
                                                  shard_options={"min_unit_bytes": min_unit_bytes})
    tol = 2e-2 if precision == "bf16-mixed" else 1e-5
    worst = max((got[k] - want[k]).abs().max().item() for k in want)
    return {"worst": worst, "tol": tol, "keys": sorted(got) == sorted(want), "units": units,
            "losses": (got_losses, want_losses), "val": (got_val, want_val)}


@pytest.mark.slow
@pytest.mark.parametrize("accum, precision, min_unit_bytes", [
    (1, "32-true", 0), (2, "32-true", 0), (2, "32-true", 1 << 16), (1, "bf16-mixed", 0),
], ids=["fp32", "fp32-accumulate", "fp32-one-unit", "bf16-mixed"])
def test_a_fit_on_two_ranks_matches_plain_lightning_over_the_global_batch(ranks2, tmp_path, accum, precision,
                                                                          min_unit_bytes):
    for out in ranks2.run(compare_job, str(tmp_path), accum, precision, min_unit_bytes):
        assert out["keys"], out
        # per-module units (the root holding only `gain`), or the whole model as the root unit
        assert out["units"] == (4 if min_unit_bytes == 0 else 1), out
        assert out["worst"] < out["tol"], out
        got, want = out["losses"]
        assert len(got) == len(want) == 2 * BATCHES, out
        assert max(abs(a - b) for a, b in zip(got, want)) < out["tol"], out
        got, want = out["val"]
        assert len(got) == len(want) == 2 and max(abs(a - b) for a, b in zip(got, want)) < out["tol"], out


def resume_job(rank, world, root):
    straight, *_ = sharded_fit(rank, world, os.path.join(root, "straight"), 2, 2, "32-true")
    folder = os.path.join(root, "epoch-1.ckpt")
    sharded_fit(rank, world, os.path.join(root, "first"), 1, 2, "32-true", save=folder)
    listing = sorted(os.listdir(folder))
    resumed, losses, val, _ = sharded_fit(rank, world, os.path.join(root, "resumed"), 2, 2, "32-true",
                                          ckpt_path=folder)
    worst = max((resumed[k] - straight[k]).abs().max().item() for k in straight)
    return {"worst": worst, "listing": listing, "losses": len(losses), "val": len(val)}


@pytest.mark.slow  # over 5 s on two cores: make test-slow
def test_a_fit_resumed_from_a_checkpoint_ends_where_the_straight_fit_ends(ranks2, tmp_path):
    for out in ranks2.run(resume_job, str(tmp_path)):
        assert out["worst"] < 1e-6, out
        assert "meta.pt" in out["listing"] and ".metadata" in out["listing"], out
        # the resumed fit ran only the second epoch
        assert out["losses"] == BATCHES and out["val"] == 1, out


def steps_job(rank, world, root):
    module = Regressor()
    strategy = ParamFSMStrategy(shard_options={"trace": True})
    train, val = loaders(PER_RANK)
    with launched(rank, world):
        fit = trainer(root, 2, 2, "32-true", devices=world, strategy=strategy)
        fit.fit(module, train, val)
    rt = strategy.runtime
    named = []
    for r in rt.trace.records:
        if r.graph_task == -1 and r.event == "fetch" and (not named or named[-1] != r.step):
            named.append(r.step)
    reduced: dict[str, int] = {}
    for r in rt.trace.records:
        if "reduce_grad" in r.effects:
            reduced[r.param] = reduced.get(r.param, 0) + 1
    global_step = fit.global_step
    params = len(list(module.parameters()))
    rt.close()
    return {"named": named, "global_step": global_step, "reduced": reduced, "params": params}


def test_each_batch_names_its_step_and_accumulation_reduces_once_per_step(ranks2, tmp_path):
    # 2 epochs of 4 batches, 2 per optimizer step: the forwards of steps 0..3, each validation
    # forward under the last step named (see [Note: step numbers from the place in the data])
    for out in ranks2.run(steps_job, str(tmp_path)):
        assert out["named"] == [0, 1, 2, 3], out
        assert out["global_step"] == 4, out
        # accumulate_grad_batches=2: the first micro-batch of each step runs under rt.no_sync(), so every
        # parameter's gradient is reduce-scattered once per optimizer step, not once per micro-batch
        assert len(out["reduced"]) == out["params"] and set(out["reduced"].values()) == {4}, out


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-true", "16-true"])
def test_precisions_that_would_diverge_are_refused_with_the_fix(precision, tmp_path):
    from lightning.pytorch.plugins.precision import MixedPrecision

    strategy = ParamFSMStrategy()
    if precision == "16-mixed":  # on a CPU, Lightning itself turns the string into bf16-mixed
        setting = {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]}
    else:
        setting = {"precision": precision}
    L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, default_root_dir=tmp_path, **setting)
    with pytest.raises(ParamFSMError, match=f"precision='{precision}'.*bf16-mixed"):
        strategy._check_precision()


def test_a_device_in_shard_options_is_refused():
    with pytest.raises(ParamFSMError, match="own device"):
        ParamFSMStrategy(shard_options={"device": "cpu"})
