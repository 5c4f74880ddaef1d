"""Gradient accumulation under ``rt.no_sync()``: plain torch's gradients and parameters after K
micro-batches, one reduce-scatter per bucket per optimizer step, and clear errors for misuse."""

from __future__ import annotations

import contextlib

import pytest
import torch
from patterns_common import Pair, batch
from torch.nn.utils import clip_grad_norm_

import paramfsm
from paramfsm import State
from paramfsm.errors import UnsyncedGradients
from paramfsm.testing.models import mlp

K = 4


def _micro_batches(pair, step, k, sync_last=True, loss_scale=1.0):
    """K micro-batches on both sides; all but the last (or all) under no_sync. Returns reduce-scatters."""
    before = pair.rt.counters["reduce_scatters"]
    for m in range(k):
        x, y = batch(10 * step + m, pair.world, 2, (4,), (3,))
        quiet = pair.rt.no_sync() if (m < k - 1 or not sync_last) else contextlib.nullcontext()
        with quiet:
            (torch.nn.functional.mse_loss(pair.model(pair.local(x)), pair.local(y)) * loss_scale / k).backward()
        (torch.nn.functional.mse_loss(pair.ref.model(x), y) * loss_scale / k).backward()
    return pair.rt.counters["reduce_scatters"] - before


def accumulation_job(rank, world):
    torch.manual_seed(0)
    pair = Pair(mlp(width=8, depth=3, d_in=4, d_out=3), rank, world, bucket_bytes=256)
    rt, out = pair.rt, {}
    # One plain backward: its reduce-scatters are what one optimizer step should cost.
    pair.zero_grad()
    out["per_backward"] = _micro_batches(pair, 0, 1)
    pair.check_grads("one backward")
    pair.step("one backward")
    # K micro-batches without no_sync: K times that.
    pair.zero_grad()
    before = rt.counters["reduce_scatters"]
    for m in range(K):
        x, y = batch(100 + m, world, 2, (4,), (3,))
        (torch.nn.functional.mse_loss(pair.model(pair.local(x)), pair.local(y)) / K).backward()
        (torch.nn.functional.mse_loss(pair.ref.model(x), y) / K).backward()
    out["synced_every_micro_batch"] = rt.counters["reduce_scatters"] - before
    pair.check_grads("K synced micro-batches")
    pair.step("K synced micro-batches")
    # K micro-batches, K-1 under no_sync: one reduce-scatter per bucket, plain torch's results.
    pair.zero_grad()
    out["no_sync"] = _micro_batches(pair, 1, K)
    pair.check_grads("K micro-batches under no_sync")
    pair.step("K micro-batches under no_sync")
    # Every micro-batch under set_requires_gradient_sync(False), then rt.sync_gradients().
    pair.zero_grad()
    rt.set_requires_gradient_sync(False)
    _micro_batches(pair, 2, K, sync_last=False)
    pair.assert_states(State.NOT_AVAILABLE, what="between micro-batches")
    out["kept_bytes"] = rt.executor.unsynced.nbytes
    out["memory"] = rt.memory()
    try:
        pair.opt.step()
    except UnsyncedGradients as exc:
        out["step_error"] = str(exc)
    try:
        rt.clip_grad_norm_(1.0)
    except UnsyncedGradients as exc:
        out["clip_error"] = str(exc)
    try:
        rt.close()
    except UnsyncedGradients as exc:
        out["close_error"] = str(exc)
    before = rt.counters["reduce_scatters"]
    rt.sync_gradients()
    out["explicit_sync"] = rt.counters["reduce_scatters"] - before
    rt.set_requires_gradient_sync(True)
    pair.check_grads("sync_gradients()")
    norm = rt.clip_grad_norm_(0.05)
    out["norm_err"] = abs(norm.item() - clip_grad_norm_(pair.ref.model.parameters(), 0.05).item())
    pair.step("sync_gradients(), clipped")
    # zero_grad between micro-batches by mistake: plain torch drops what came before (both kinds).
    for set_to_none in (True, False):
        pair.zero_grad()
        _micro_batches(pair, 3, 2, sync_last=False)
        pair.opt.zero_grad(set_to_none=set_to_none)
        pair.ref.optimizer.zero_grad(set_to_none=set_to_none)
        _micro_batches(pair, 4, 2)
        pair.check_grads(f"zero_grad(set_to_none={set_to_none}) between micro-batches")
        pair.step(f"zero_grad(set_to_none={set_to_none}) between micro-batches")
    # The two-loss retained-graph loop: the first backward under no_sync, the second syncs.
    pair.zero_grad()
    x, y = batch(50, world, 2, (4,), (3,))
    got, want = pair.model(pair.local(x)), pair.ref.model(x)
    before = rt.counters["reduce_scatters"]
    with rt.no_sync():
        rt.backward(torch.nn.functional.mse_loss(got, pair.local(y)), retain_graph=True)
    got.pow(2).mean().backward()
    out["two_losses"] = rt.counters["reduce_scatters"] - before
    torch.nn.functional.mse_loss(want, y).backward(retain_graph=True)
    want.pow(2).mean().backward()
    pair.check_grads("two losses, the first under no_sync")
    pair.step("two losses")
    # A checkpoint inside no_sync saves the parameters; the kept gradients stay for the next backward.
    pair.zero_grad()
    _micro_batches(pair, 6, 1, sync_last=False)
    with rt.no_sync():
        out["checkpoint_keys"] = len(rt.sharded_state_dict())
    _micro_batches(pair, 7, 1)
    pair.check_grads("a checkpoint between micro-batches")
    pair.step("a checkpoint between micro-batches")
    kinds = {r.event for r in rt.trace.records}
    out["events"] = sorted(kinds & {"grad_kept", "grad_sync"})
    out.update(pair.finish())
    return out


def test_no_sync_matches_plain_torch_with_one_reduce_scatter_per_bucket(ranks2):
    for rank, out in enumerate(ranks2.run(accumulation_job)):
        per = out["per_backward"]
        assert per >= 2, out  # several buckets, so "per bucket" is tested
        assert out["synced_every_micro_batch"] == K * per, out
        assert out["no_sync"] == per, f"rank {rank}: K micro-batches under no_sync cost {out['no_sync']} " \
                                      f"reduce-scatters, one optimizer step should cost {per}"
        # An explicit sync packs every kept gradient into buckets at once, with no unit boundaries, so it
        # may need fewer reduce-scatters than a backward, never more.
        assert 1 <= out["explicit_sync"] <= per, out
        assert out["two_losses"] == per, out
        full_bytes = 4 * sum(p.numel() for p in mlp(width=8, depth=3, d_in=4, d_out=3).parameters())
        assert out["kept_bytes"] == full_bytes, out  # one full fp32 gradient per parameter
        held = out["memory"]
        assert held["unsynced_grads"] == full_bytes and held["gathered"] == held["deferred"] == 0, held
        assert held["shards"] >= full_bytes // 2 and held["shard_grads"] == held["shards"], held
        for key in ("step_error", "clip_error", "close_error"):
            assert "not synchronised" in out.get(key, "") and f"rank {rank}" in out[key], (key, out)
        assert "rt.sync_gradients()" in out["step_error"] and "parameter '" in out["step_error"], out["step_error"]
        assert out["norm_err"] < 1e-5 and out["checkpoint_keys"] > 0, out
        assert out["events"] == ["grad_kept", "grad_sync"], out
        assert out["grad_err"] <= 1e-6 and out["param_err"] <= 1e-6, out


def interrupted_job(rank, world):
    """A backward under no_sync that raises leaves a lost gradient: stepping raises until zero_grad."""
    torch.manual_seed(0)
    model = mlp(width=8, depth=2, d_in=4, d_out=3)
    rt = paramfsm.shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(2, 4)
    with rt.no_sync():
        model(x).pow(2).mean().backward()

    def boom(grad):
        raise RuntimeError("interrupted")

    errors = []
    with rt.no_sync():
        y = model(x).pow(2).mean()
        handle = list(model.parameters())[0].register_hook(boom)
        with pytest.raises(RuntimeError, match="interrupted"):
            y.backward()
        handle.remove()
    rt.reset()
    for call in (opt.step, rt.sync_gradients):
        try:
            call()
        except UnsyncedGradients as exc:
            errors.append(str(exc))
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
    rt.detach()
    return errors


def test_an_interrupted_accumulation_is_never_stepped(ranks2):
    for errors in ranks2.run(interrupted_job):
        assert len(errors) == 2 and all("is lost" in e and "zero_grad" in e for e in errors), errors
