"""Offloaded shard gradients (``Offload(grads=...)``): paged out once reduced, paged in to accumulate and step.

The matrix of tiers and combinations against plain torch is in ``tests/test_offload.py``; these tests
cover what only gradients do: several backward passes adding into a paged-out gradient, ``zero_grad``
without ``set_to_none``, reads between backward and step, one rank, and the reserved slots.
"""

from __future__ import annotations

import os

import pytest
import torch

import paramfsm
from paramfsm.errors import ArgumentError, OffloadError
from test_offload import STEPS, _batch, _model, disk_full


@pytest.fixture(scope="module")
def ranks2(in_process2):
    """This file's two ranks are threads of the test process (``gloo_ranks.py``), where ``make mutate`` sees
    them; a test that needs processes of its own asks for ``suite_ranks2``."""
    return in_process2


def _loop(model, opt, rt, rank, world, *, passes, set_to_none, probe):
    """STEPS steps of ``passes`` synced backward passes each (gradients add up in the shard gradients)."""
    seen = []
    for step in range(STEPS):
        for i in range(passes):
            x = _batch(step * passes + i)
            if world > 1:
                x = x.chunk(world)[rank]
            (model(x).pow(2).mean() / passes).backward()
            if probe is not None:
                seen.append(probe())
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    return seen


def accumulate_job(rank, world, folder, tier, passes, set_to_none):
    results = {}
    for offload in (None, paramfsm.Offload(grads=tier, path=folder)):
        model = _model()
        rt = paramfsm.shard(model, offload=offload, trace=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

        def probe():
            held = rt.memory()
            return held["shard_grads"], held.get(f"tier_{tier}", 0)
        seen = _loop(model, opt, rt, rank, world, passes=passes, set_to_none=set_to_none, probe=probe)
        grads = [r for r in rt.trace.records if r.machine == "residency" and r.kind == "grad"]
        traffic = rt.offload.traffic() if rt.offload is not None else None
        results["offload" if offload else "none"] = (rt.full_state_dict(), seen, len(grads), traffic)
        rt.close()
    return results, sorted(os.listdir(folder))


def _plain(passes):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _loop(model, opt, None, 0, 1, passes=passes, set_to_none=True, probe=None)
    return model.state_dict()


@pytest.mark.parametrize("tier", ["disk", "cpu"])
@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradients_added_over_backward_passes_into_paged_out_ones_train_like_plain_torch(
        ranks2, tmp_path, tier, set_to_none):
    plain = _plain(passes=2)
    for rank, (results, left) in enumerate(ranks2.run(accumulate_job, str(tmp_path), tier, 2, set_to_none)):
        base, _, _, _ = results["none"]
        full, seen, grad_records, traffic = results["offload"]
        for name, value in base.items():
            assert torch.equal(full[name], value), (rank, name)
            # Two backward passes sum in another order than one whole batch (see tests/test_offload.py).
            torch.testing.assert_close(full[name], plain[name], rtol=1e-3, atol=2e-4)
        # After every backward the shard gradients are in the tier, none in working memory.
        assert all(resident == 0 and tiered > 0 for resident, tiered in seen), seen
        assert grad_records > 0, "the gradients' residency must be traced"
        # The second backward of each step read the first one's gradients back.
        assert traffic["read"] > 0 and traffic["written"] > 0, traffic
        assert left == []


def one_rank_job(rank, world, folder):
    return accumulate_job(rank, world, folder, "disk", 2, True)


def test_gradients_offload_on_one_rank(ranks1, tmp_path):
    plain = _plain(passes=2)
    (results, left), = ranks1.run(one_rank_job, str(tmp_path))
    full, seen, _, _ = results["offload"]
    assert all(resident == 0 for resident, _ in seen), seen
    for name, value in plain.items():
        torch.testing.assert_close(full[name], value, rtol=1e-3, atol=2e-4)
    assert left == []


def reads_job(rank, world, folder):
    """Between backward and step: full_grad, the shard gradients' norm, a GradScaler-style in-place scale."""
    out = {}
    for offload in (None, paramfsm.Offload(grads="disk", path=folder)):
        model = _model()
        rt = paramfsm.shard(model, offload=offload)
        opt = torch.optim.SGD(model.parameters(), lr=1e-1)
        model(_batch(0).chunk(world)[rank]).pow(2).mean().backward()
        full_grads = {n: rt.full_grad(n) for n, _ in model.named_parameters()}
        norm = rt.clip_grad_norm_(0.01)
        shards = [p for p in rt.shard_parameters() if p.grad is not None]
        for p in shards:
            p.grad.mul_(0.5)
        opt.step()
        out["offload" if offload else "none"] = full_grads, norm, rt.full_state_dict()
        rt.close()
    return out


def test_reads_of_paged_out_gradients_page_them_in(ranks2, tmp_path):
    for out in ranks2.run(reads_job, str(tmp_path)):
        (grads0, norm0, full0), (grads1, norm1, full1) = out["none"], out["offload"]
        assert torch.equal(norm0, norm1)
        for name in grads0:
            assert torch.equal(grads0[name], grads1[name]), name
        for name in full0:
            assert torch.equal(full0[name], full1[name]), name


def bad_job(rank, world, folder, case):
    model = _model()
    try:
        if case == "bound":
            paramfsm.shard(model, offload=paramfsm.Offload(grads="cpu", max_resident_bytes=16))
        elif case == "full-disk":
            with disk_full():
                paramfsm.shard(model, offload=paramfsm.Offload(grads="disk", path=folder))
    except (OffloadError, ArgumentError) as exc:
        return type(exc).__name__, str(exc), sorted(os.listdir(folder))
    return None, "", []


@pytest.mark.parametrize("case,error,words", [
    ("bound", "ArgumentError", ["max_resident_bytes=16", "unit", "What to do"]),
    ("full-disk", "OffloadError", ["No space left", "0.weight", "What to do"]),
])
def test_gradient_tiers_refuse_bad_inputs_at_shard(ranks2, tmp_path, case, error, words):
    for rank, (kind, message, listing) in enumerate(ranks2.run(bad_job, str(tmp_path), case)):
        assert kind == error, (case, rank, message)
        for word in words:
            assert word in message, (word, message)
        assert [name for name in listing if name.startswith(f"paramfsm-offload-rank{rank}-")] == []


def test_grads_on_disk_needs_a_folder():
    with pytest.raises(ArgumentError, match="path="):
        paramfsm.Offload(grads="disk")


def clip_job(rank, world, folder, norm_type):
    results = {}
    for offload in (None, paramfsm.Offload(grads="disk", path=folder)):
        model = _model()
        rt = paramfsm.shard(model, offload=offload)
        model(_batch(0).chunk(world)[rank]).pow(2).mean().backward()
        peak = [0]
        if offload is not None:
            residency = rt.offload.residency
            need = residency.need

            def watched(placements, **kwargs):
                need(placements, **kwargs)
                peak[0] = max(peak[0], residency.resident_bytes)
            residency.need = watched
        norm = rt.clip_grad_norm_(0.01, norm_type)
        largest = max(p.numel() * p.element_size() for p in rt.shard_parameters())
        resident = rt.offload.memory()["offload_resident"] if offload is not None else 0
        clip_peak = peak[0]  # the clip's alone: full_grad below pages gradients in on demand
        grads = {n: rt.full_grad(n) for n, _ in model.named_parameters()}
        results["offload" if offload else "none"] = norm, grads, clip_peak, largest, resident
        rt.close()
    return results


@pytest.mark.parametrize("norm_type", [2.0, float("inf"), 0.0])
def test_clipping_offloaded_gradients_pages_one_at_a_time(ranks2, tmp_path, norm_type):
    for results in ranks2.run(clip_job, str(tmp_path), norm_type):
        norm0, grads0, _, _, _ = results["none"]
        norm1, grads1, peak, largest, resident = results["offload"]
        assert torch.equal(norm0, norm1)
        for name in grads0:
            assert torch.equal(grads0[name], grads1[name]), name
        assert 0 < peak <= largest, (peak, largest)  # one shard gradient in working memory at a time
        assert resident == 0  # and none once the clip is done
