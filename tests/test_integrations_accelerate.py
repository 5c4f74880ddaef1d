"""``paramfsm.integrations.accelerate.Accelerator`` on 2 gloo ranks against plain Accelerate on 1 process.

One Accelerate training script (:func:`script`) runs twice: with paramfsm's
Accelerator on 2 ranks, each taking every other batch of the prepared data
loader (Accelerate's sharding of the loader), and with ``accelerate.Accelerator``
on one process over the global batch (twice the batch size). Global losses
(``gather_for_metrics``), the clipped gradient norms and the final parameters
must agree, without and with gradient accumulation (one reduce-scatter per
optimizer step). A run stopped at ``save_state`` and resumed with
``load_state`` ends where the straight run ends; ``save_model`` writes what a
plain model loads; a rank that skips a batch raises ``RankDesync`` on every rank.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile

import pytest
import torch
from torch import nn

from paramfsm.errors import RankDesync

accelerate = pytest.importorskip("accelerate")

from paramfsm.integrations import accelerate as sharded  # noqa: E402 - after the skip

DIM, PER_RANK, WORLD, STEPS = 8, 2, 2, 4
MAX_NORM = 0.5


@contextlib.contextmanager
def launched(rank, world):
    """The variables ``accelerate launch`` (torchrun) sets, and a fresh Accelerate process state."""
    from accelerate.state import AcceleratorState

    wanted = {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": world}
    saved = {key: os.environ.get(key) for key in wanted}
    os.environ.update({key: str(value) for key, value in wanted.items()})
    AcceleratorState._reset_state(True)
    try:
        yield
    finally:
        AcceleratorState._reset_state(True)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def data(accum):
    samples = STEPS * accum * PER_RANK * WORLD
    x = torch.randn(samples, DIM, generator=torch.Generator().manual_seed(1))
    return torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True).sin())


def script(accelerator, accum, batch_size, *, stop_after=None, resume=None, save=None, skip=None, norm_type=2.0):
    """An ordinary Accelerate training loop; returns what the comparison needs."""
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.ConstantLR(opt, factor=1.0, total_iters=1)  # prepared, changes nothing
    loader = torch.utils.data.DataLoader(data(accum), batch_size=batch_size, shuffle=False)
    model, opt, loader, scheduler = accelerator.prepare(model, opt, loader, scheduler)
    batches = loader
    if resume is not None:
        accelerator.load_state(resume)
        batches = accelerator.skip_first_batches(loader, stop_after * accum)
    losses, norms = [], []
    model.train()
    for index, (x, y) in enumerate(batches):
        if skip is not None and skip(index):
            continue
        with accelerator.accumulate(model):
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            losses.append(accelerator.gather_for_metrics(loss.detach()[None]).mean().item())
            if accelerator.sync_gradients:
                norms.append(float(accelerator.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type=norm_type)))
            opt.step()
            scheduler.step()
            opt.zero_grad()
        if stop_after is not None and resume is None and len(norms) == stop_after:
            accelerator.save_state(save)
            break
    state = accelerator.get_state_dict(model)
    return {"losses": losses, "norms": norms, "params": {k: v.clone() for k, v in state.items()}}


def sharded_job(rank, world, accum, mixed_precision="no", norm_type=2.0):
    with launched(rank, world):
        accelerator = sharded.Accelerator(cpu=True, gradient_accumulation_steps=accum, mixed_precision=mixed_precision)
        report = script(accelerator, accum, PER_RANK, norm_type=norm_type)
        report["reduce_scatters"] = accelerator.runtime.counters["reduce_scatters"]
        accelerator.runtime.close()
    return report


def plain_job(rank, world, accum, mixed_precision="no", norm_type=2.0):
    with launched(0, 1):
        accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=accum,
                                             mixed_precision=mixed_precision)
        return script(accelerator, accum, PER_RANK * WORLD, norm_type=norm_type)


def assert_same_run(ours, plain, accum, rel=1e-5, atol=1e-5):
    assert len(plain["norms"]) == STEPS and len(plain["losses"]) == STEPS * accum
    assert any(norm > MAX_NORM for norm in plain["norms"]), "clipping must be active for the test to see it"
    assert ours["losses"] == pytest.approx(plain["losses"], rel=rel)
    assert ours["norms"] == pytest.approx(plain["norms"], rel=rel * 10)
    assert set(ours["params"]) == set(plain["params"])
    for key, want in plain["params"].items():
        assert torch.allclose(ours["params"][key], want, atol=atol), key


@pytest.mark.parametrize("accum", [1, 2], ids=["no_accumulation", "accumulate_2"])
def test_matches_plain_accelerate_over_the_global_batch(ranks2, ranks1, accum):
    ours, other = ranks2.run(sharded_job, accum)
    (plain,) = ranks1.run(plain_job, accum)
    assert_same_run(ours, plain, accum)
    assert other["params"] == {}, "get_state_dict: full tensors on rank 0 only"
    assert other["losses"] == ours["losses"] and other["norms"] == ours["norms"]
    # One reduce-scatter per bucket per optimizer step, whatever the accumulation (the model is one bucket).
    assert ours["reduce_scatters"] == STEPS, ours["reduce_scatters"]


@pytest.mark.parametrize("norm_type", [math.inf, 1.0], ids=["inf", "one"])
def test_clip_grad_norm_of_another_norm_type_matches_plain_accelerate(ranks2, ranks1, norm_type):
    """``accelerator.clip_grad_norm_(params, max_norm, norm_type=inf)``: the global max-norm over the shards,
    clipping as plain Accelerate does (a 2-norm there returned 1.27 for 0.66 and clipped by it)."""
    ours, _ = ranks2.run(sharded_job, 1, "no", norm_type)
    (plain,) = ranks1.run(plain_job, 1, "no", norm_type)
    assert_same_run(ours, plain, 1)


def test_bf16_autocast_matches_plain_accelerate(ranks2, ranks1):
    ours, _ = ranks2.run(sharded_job, 1, "bf16")
    (plain,) = ranks1.run(plain_job, 1, "bf16")
    assert ours["losses"][0] != pytest.approx(script_fp32_first_loss(), rel=1e-4), "autocast must apply"
    assert_same_run(ours, plain, 1, rel=2e-3, atol=2e-3)


def script_fp32_first_loss() -> float:
    x, y = data(1)[: PER_RANK * WORLD]
    with torch.no_grad():
        return nn.functional.mse_loss(build()(x), y).item()


def resume_job(rank, world, accum):
    """A straight run, and a run stopped at step 2 by save_state and resumed from it by a new Accelerator."""
    with tempfile.TemporaryDirectory() as scratch:
        where = [scratch]
        torch.distributed.broadcast_object_list(where, src=0)
        folder = os.path.join(where[0], "state")
        with launched(rank, world):
            straight = sharded.Accelerator(cpu=True, gradient_accumulation_steps=accum)
            whole = script(straight, accum, PER_RANK)
            straight.runtime.close()
        with launched(rank, world):
            first = sharded.Accelerator(cpu=True, gradient_accumulation_steps=accum)
            head = script(first, accum, PER_RANK, stop_after=2, save=folder)
            saved = sorted(os.listdir(folder))
            first.runtime.close()
        with launched(rank, world):
            again = sharded.Accelerator(cpu=True, gradient_accumulation_steps=accum)
            tail = script(again, accum, PER_RANK, stop_after=2, resume=folder)
            resumed_at = again.trained_batches
            again.runtime.close()
        torch.distributed.barrier()
    return whole, head, tail, saved, resumed_at


@pytest.mark.parametrize("accum", [1, 2], ids=["no_accumulation", "accumulate_2"])
def test_load_state_resumes_exactly(ranks2, accum):
    (whole, head, tail, saved, resumed_at), _ = ranks2.run(resume_job, accum)
    assert sharded.SHARDS_DIR in saved and sharded.STEPS_FILE in saved and "optimizer.bin" not in saved, saved
    assert resumed_at == STEPS * accum, "the batch count continues from the saved one"
    assert head["norms"] + tail["norms"] == pytest.approx(whole["norms"], rel=1e-6)
    assert head["losses"] + tail["losses"] == pytest.approx(whole["losses"], rel=1e-6)
    for key, want in whole["params"].items():
        assert torch.allclose(tail["params"][key], want, atol=1e-6), key


def save_model_job(rank, world):
    with launched(rank, world), tempfile.TemporaryDirectory() as scratch:
        where = [scratch]
        torch.distributed.broadcast_object_list(where, src=0)
        accelerator = sharded.Accelerator(cpu=True)
        report = script(accelerator, 1, PER_RANK)
        model = accelerator._models[0]
        assert accelerator.unwrap_model(model) is accelerator.runtime.model
        accelerator.save_model(model, where[0])
        written = sorted(os.listdir(where[0]))
        loaded = None
        if "model.safetensors" in written:
            from safetensors.torch import load_file

            loaded = load_file(os.path.join(where[0], "model.safetensors"))
        torch.distributed.barrier()
        accelerator.runtime.close()
    return report["params"], written, loaded


def test_save_model_writes_full_tensors(ranks2):
    (params, written, loaded), _ = ranks2.run(save_model_job)
    assert "model.safetensors" in written and loaded is not None, written
    assert set(loaded) == set(params)
    for key, want in params.items():
        assert torch.equal(loaded[key], want), key


def skipping_job(rank, world):
    with launched(rank, world):
        accelerator = sharded.Accelerator(cpu=True, shard_options={"collective_timeout": 20})
        try:
            script(accelerator, 1, PER_RANK, skip=lambda index: rank == 1 and index == 1)
        except RankDesync as exc:
            accelerator.runtime.reset()
            accelerator.runtime.detach()
            return exc.rank, exc.step, str(exc)
        accelerator.runtime.detach()
    return None


def test_a_rank_skipping_a_batch_raises_rank_desync(ranks2):
    results = ranks2.run(skipping_job, timeout=90)
    assert all(r is not None for r in results), "a rank that skipped a batch was paired silently"
    for rank, (err_rank, step, message) in enumerate(results):
        assert err_rank == rank and step == (1 if rank == 0 else 2), message
        assert "at step 1" in message and "at step 2" in message, message
