"""Offload at world 2: every tier and combination trains exactly like no offload, and like plain torch.

Each job trains the same model three AdamW steps on two gloo ranks (each
rank its half of the batch), with and without offload, and compares the
parameters: bit-identical to the run without offload, and equal to plain
torch on the whole batch. The tiers' files must be gone after ``rt.close()``.
"""

from __future__ import annotations

import contextlib
import os
import threading

import pytest
import torch

import paramfsm
from paramfsm.errors import ArgumentError, OffloadError
from paramfsm.testing.models import mlp


@pytest.fixture(scope="module")
def ranks2(in_process2):
    """This file's two ranks are threads of the test process (``gloo_ranks.py``), where ``make mutate`` sees
    them; a test that needs processes of its own asks for ``suite_ranks2``."""
    return in_process2


STEPS = 3


def _model():
    torch.manual_seed(0)
    return mlp(width=16, depth=4, d_in=8, d_out=4)


def _batch(step):
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 + step))


def _train(rank, world, offload, *, accumulate=1, clip=None, folder=None):
    model = _model()
    rt = paramfsm.shard(model, offload=offload, trace=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        for micro in range(accumulate):
            x = _batch(step * accumulate + micro).chunk(world)[rank]
            sync = micro == accumulate - 1
            with rt.no_sync() if not sync else _nothing():
                (model(x).pow(2).mean() / accumulate).backward()
        if clip is not None:
            rt.clip_grad_norm_(clip)
        opt.step()
        opt.zero_grad()
    held = rt.memory()  # before the full state dict pages shards in on demand
    full = rt.full_state_dict()
    machines = {r.machine or "lifetime" for r in rt.trace.records}
    traffic = {**rt.offload.traffic(), "memory": held} if rt.offload is not None else None
    files = sorted(os.listdir(folder)) if folder else []
    rt.close()
    after = sorted(os.listdir(folder)) if folder else []
    return full, machines, traffic, files, after


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _plain(accumulate=1, clip=None):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        for micro in range(accumulate):
            (model(_batch(step * accumulate + micro)).pow(2).mean() / accumulate).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


def compare_job(rank, world, folder, params, optimizer, ratio, accumulate, clip, per_unit, grads=None):
    base = _train(rank, world, None, accumulate=accumulate, clip=clip)[0]
    offload = paramfsm.Offload(params=params, optimizer=optimizer, grads=grads, path=folder, ratio=ratio)
    if per_unit:
        offload_all = offload
        offload = lambda name, module: offload_all if name.endswith(("0", "2")) else None  # noqa: E731
    full, machines, traffic, files, after = _train(rank, world, offload, accumulate=accumulate, clip=clip,
                                                   folder=folder)
    return base, full, machines, traffic, files, after


CASES = {
    "params-disk": ("disk", None, 1.0, 1, None, False),
    "optimizer-disk": (None, "disk", 1.0, 1, None, False),
    "both-disk": ("disk", "disk", 1.0, 1, None, False),
    "both-cpu": ("cpu", "cpu", 1.0, 1, None, False),
    "optimizer-ratio": (None, "disk", 0.5, 1, None, False),
    "per-unit": ("disk", "disk", 1.0, 1, None, True),
    "no-sync-and-clip": ("disk", "disk", 1.0, 2, 0.05, False),
    "grads-disk": (None, None, 1.0, 1, None, False, "disk"),
    "grads-cpu": (None, None, 1.0, 1, None, False, "cpu"),
    "all-disk": ("disk", "disk", 1.0, 1, None, False, "disk"),
    "all-cpu": ("cpu", "cpu", 1.0, 1, None, False, "cpu"),
    "all-disk-per-unit": ("disk", "disk", 1.0, 1, None, True, "disk"),
    "all-disk-no-sync-and-clip": ("disk", "disk", 1.0, 2, 0.05, False, "disk"),
    "grads-and-optimizer-ratio": (None, "disk", 0.5, 1, None, False, "disk"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_offload_trains_bit_identically_to_no_offload_and_like_plain_torch(ranks2, tmp_path, case):
    params, optimizer, ratio, accumulate, clip, per_unit, grads = (*CASES[case], None)[:7]
    plain = _plain(accumulate, clip)
    for rank, (base, full, machines, traffic, files, after) in enumerate(ranks2.run(
            compare_job, str(tmp_path), params, optimizer, ratio, accumulate, clip, per_unit, grads)):
        for name, value in base.items():
            assert torch.equal(full[name], value), (case, rank, name)
            # Accumulated micro-batches sum in another order than one whole batch; Adam's division by
            # the root of the second moment turns that rounding into ~4e-5 on near-zero gradients (a micro-batch lost would move weights by ~lr = 1e-2).
            tolerance = dict(rtol=1e-3, atol=2e-4) if accumulate > 1 else dict(rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(full[name], plain[name], **tolerance)
        assert "residency" in machines, "residency transitions must be traced"
        assert traffic["written"] > 0
        tiers = traffic["memory"]
        for where in ("cpu", "disk"):
            assert (tiers[f"tier_{where}"] > 0) == (where in (params, optimizer, grads)), (where, tiers)
        # With no bound on the resident set, every shard is paged out after the step; rt.memory() counts
        # resident shards only.
        assert (tiers["shards"] == 0) == (params is not None and not per_unit), (case, tiers)
        if "disk" in (params, optimizer, grads):
            assert len([f for f in files if f.startswith(f"paramfsm-offload-rank{rank}")]) == 1
        assert after == []


def checkpoint_job(rank, world, folder):
    import paramfsm.checkpoint as ck

    offload = paramfsm.Offload(params="disk", optimizer="disk", path=os.path.join(folder, "tier"))
    model = _model()
    rt = paramfsm.shard(model, offload=offload)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        model(_batch(step).chunk(world)[rank]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    ck.save(rt, os.path.join(folder, "ck"), optimizer=opt)
    saved = rt.full_state_dict()
    model(_batch(5).chunk(world)[rank]).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    expected = rt.full_state_dict()
    rt.close()

    model2 = _model()
    rt2 = paramfsm.shard(model2, offload=offload)
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    ck.load(rt2, os.path.join(folder, "ck"), optimizer=opt2)
    loaded = rt2.full_state_dict()
    model2(_batch(5).chunk(world)[rank]).pow(2).mean().backward()
    opt2.step()
    opt2.zero_grad()
    resumed = rt2.full_state_dict()
    rt2.close()
    return saved, loaded, expected, resumed


def test_a_checkpoint_of_an_offloaded_run_resumes_it_exactly(ranks2, tmp_path):
    for saved, loaded, expected, resumed in ranks2.run(checkpoint_job, str(tmp_path)):
        for name in saved:
            assert torch.equal(loaded[name], saved[name]), name
            assert torch.equal(resumed[name], expected[name]), name


def _constant_init(module):
    if isinstance(module, torch.nn.Linear):
        torch.nn.init.constant_(module.weight, 0.01)
        torch.nn.init.constant_(module.bias, -0.02)


def meta_job(rank, world, folder):
    with torch.device("meta"):
        model = _model()
    rt = paramfsm.shard(model, device="cpu", offload=paramfsm.Offload(params="disk", optimizer="disk",
                                                                      path=folder))
    rt.init_weights(_constant_init)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(_batch(0).chunk(world)[rank]).pow(2).mean().backward()
    opt.step()
    full = rt.full_state_dict()
    rt.close()
    return full


def test_a_meta_model_initialised_under_offload_trains_like_plain_torch(ranks2, tmp_path):
    torch.manual_seed(0)
    plain = _model()
    plain.apply(_constant_init)
    opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    plain(_batch(0)).pow(2).mean().backward()
    opt.step()
    for full in ranks2.run(meta_job, str(tmp_path)):
        for name, value in plain.state_dict().items():
            torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6)


_full_disk = {"in": 0, "real": None}
_full_disk_lock = threading.Lock()


@contextlib.contextmanager
def disk_full():
    """Every reservation of disk space fails as on a full disk (ENOSPC).

    Ranks that are threads of one process (``gloo_ranks.py``) share the patch: the first in puts it in,
    the last out takes it out (each restoring what it found would leave it in when they interleave).
    """
    def no_space(fd, offset, length):
        raise OSError(28, "No space left on device")
    with _full_disk_lock:
        if _full_disk["in"] == 0:
            _full_disk["real"], os.posix_fallocate = os.posix_fallocate, no_space
        _full_disk["in"] += 1
    try:
        yield
    finally:
        with _full_disk_lock:
            _full_disk["in"] -= 1
            if _full_disk["in"] == 0:
                os.posix_fallocate = _full_disk["real"]


def bad_input_job(rank, world, folder, case):
    model = _model()
    try:
        if case == "unwritable":
            blocker = os.path.join(folder, "a-file")
            open(blocker, "w").close()
            paramfsm.shard(model, offload=paramfsm.Offload(params="disk", path=os.path.join(blocker, "tier")))
        elif case == "full-disk":
            with disk_full():
                paramfsm.shard(model, offload=paramfsm.Offload(params="disk", path=folder))
        elif case == "bound":
            paramfsm.shard(model, offload=paramfsm.Offload(params="disk", path=folder, max_resident_bytes=16))
    except (OffloadError, ArgumentError) as exc:
        return type(exc).__name__, str(exc), sorted(os.listdir(folder))
    return None, "", []


@pytest.mark.parametrize("case,error,words", [
    ("unwritable", "OffloadError", ["a-file", "What to do"]),
    ("full-disk", "OffloadError", ["No space left", "What to do", "0.weight"]),
    ("bound", "ArgumentError", ["max_resident_bytes=16", "unit"]),
])
def test_bad_offload_inputs_fail_at_shard_with_a_clear_error(ranks2, tmp_path, case, error, words):
    (tmp_path / "tier").mkdir()
    for rank, (kind, message, listing) in enumerate(ranks2.run(bad_input_job, str(tmp_path / "tier"), case)):
        assert kind == error, (case, rank, message)
        for word in words:
            assert word in message, (word, message)
        assert f"rank {rank}" in message or case == "bound"
        # Its own file only: the ranks share the folder, and the other may not have failed yet.
        assert [name for name in listing if name.startswith(f"paramfsm-offload-rank{rank}-")] == [], \
            "a failed shard leaves no file"


def two_runs_job(rank, world, folder):
    """Two runtimes in one process offload into one folder, trained in turn on different batches."""
    def build():
        model = _model()
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    runs = []
    for _ in range(2):
        model, opt = build()
        runs.append((model, paramfsm.shard(model, offload=paramfsm.Offload(params="disk", optimizer="disk",
                                                                            path=folder)), opt))
    files = sorted(os.listdir(folder))
    for step in range(STEPS):
        for which, (model, _, opt) in enumerate(runs):
            model(_batch(10 * which + step).chunk(world)[rank]).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    fulls = [rt.full_state_dict() for _, rt, _ in runs]
    for _, rt, _ in runs:
        rt.close()
    return files, fulls


def test_two_runs_in_one_folder_never_share_a_file(ranks2, tmp_path):
    expected = []
    for which in range(2):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(STEPS):
            model(_batch(10 * which + step)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        expected.append(model.state_dict())
    for rank, (files, fulls) in enumerate(ranks2.run(two_runs_job, str(tmp_path))):
        mine = [f for f in files if f.startswith(f"paramfsm-offload-rank{rank}-")]
        assert len(mine) == 2, files
        for full, plain in zip(fulls, expected):
            for name, value in plain.items():
                torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6)
    assert os.listdir(tmp_path) == []


def inference_job(rank, world, folder):
    """Evaluation under inference_mode between steps pages values in there; a load and the next steps update
    them in place (a working buffer made under inference_mode could not be)."""
    model = _model()
    rt = paramfsm.shard(model, offload=paramfsm.Offload(params="disk", optimizer="disk", path=folder))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    evaluated = []
    for step in range(STEPS):
        model(_batch(step).chunk(world)[rank]).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        with torch.inference_mode():
            evaluated.append(model(_batch(50).chunk(world)[rank]).clone())
        if step == 1:  # a checkpoint round trip writes the shards the evaluation paged in, in place
            import paramfsm.checkpoint as ck

            ck.save(rt, os.path.join(folder, "ck"), optimizer=opt)
            ck.load(rt, os.path.join(folder, "ck"), optimizer=opt)
    full = rt.full_state_dict()
    rt.close()
    return full, evaluated


def test_evaluation_under_inference_mode_between_offloaded_steps(ranks2, tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    expected = []
    for step in range(STEPS):
        model(_batch(step)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        with torch.inference_mode():
            expected.append(model(_batch(50)))
    for rank, (full, evaluated) in enumerate(ranks2.run(inference_job, str(tmp_path))):
        for name, value in model.state_dict().items():
            torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6)
        for got, want in zip(evaluated, expected):
            torch.testing.assert_close(got, want.chunk(2)[rank], rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # over 5 s on two cores: make test-slow
def test_a_load_after_an_evaluation_under_inference_mode_writes_the_paged_in_shards(ranks2):
    """A loop verify drew (tests/reproductions/offload_inference_page_in.py): an evaluation under
    inference_mode pages shards in, and a checkpoint load writes them in place."""
    from pathlib import Path

    from paramfsm.verify.reproduction import run_saved

    script = Path(__file__).resolve().parent / "reproductions" / "offload_inference_page_in.py"
    for status, output in ranks2.run(run_saved, str(script), timeout=240):
        assert status == 0, output


def _load_state_steps(model, opt, batch):
    """Two steps, the optimizer's state kept, a third step, that state loaded back, a fourth step."""
    def step(i):
        model(batch(i)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    step(0)
    step(1)
    kept = {"state": {k: {n: v.clone() if torch.is_tensor(v) else v for n, v in entry.items()}
                      for k, entry in opt.state_dict()["state"].items()},
            "param_groups": opt.state_dict()["param_groups"]}
    step(2)
    opt.load_state_dict(kept)
    step(3)


def load_state_job(rank, world, folder):
    model = _model()
    rt = paramfsm.shard(model, offload=paramfsm.Offload(optimizer="disk", path=folder))
    _load_state_steps(model, torch.optim.AdamW(model.parameters(), lr=1e-2), lambda i: _batch(i).chunk(world)[rank])
    full = rt.full_state_dict()
    rt.close()
    return full


def test_optimizer_load_state_dict_under_offload_replaces_the_offloaded_state(ranks2, tmp_path):
    """load_state_dict puts new state tensors in place of paged-out ones: the next step must use them,
    never the tier's copy of the replaced state."""
    model = _model()
    _load_state_steps(model, torch.optim.AdamW(model.parameters(), lr=1e-2), _batch)
    for full in ranks2.run(load_state_job, str(tmp_path)):
        for name, value in model.state_dict().items():
            torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6)
