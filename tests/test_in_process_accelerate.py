"""``paramfsm.integrations.accelerate.Accelerator`` on one rank, in the test process.

The same Accelerate script as ``tests/test_integrations_accelerate.py`` (which
runs it on two gloo ranks), here on one process (``group="single"``, as a plain
``python script.py`` gets it) against plain Accelerate, so ``make mutate`` sees
the Accelerator: the losses, clipped norms (2 and inf) and parameters agree,
a run stopped by ``save_state`` and resumed by ``load_state`` ends where the
straight one ends, steps are named from the loader, and every refusal says
what to do.
"""

from __future__ import annotations

import contextlib
import json
import math
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import paramfsm

accelerate = pytest.importorskip("accelerate")

from paramfsm.integrations import accelerate as sharded  # noqa: E402 - after the skip
from test_integrations_accelerate import (  # noqa: E402 - the script both files run
    PER_RANK, STEPS, WORLD, assert_same_run, build, data, script,
)

BATCH = PER_RANK * WORLD
LAUNCHER = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@contextlib.contextmanager
def launched(rank, world):
    """A plain ``python script.py``: no launcher's variables, and a fresh Accelerate process state.

    ``paramfsm.shard(group="single")`` (what the Accelerator uses alone) leaves a one-rank default group; it
    is destroyed on the way out, so the process is left as it was found: ``make mutate`` forks the test
    process for every mutant, and a group inherited across a fork has lost its threads (its next
    collective never returns).
    """
    from accelerate.state import AcceleratorState

    assert (rank, world) == (0, 1)
    before = dist.is_initialized()
    saved = {key: os.environ.pop(key) for key in LAUNCHER if key in os.environ}
    AcceleratorState._reset_state(True)
    try:
        yield
    finally:
        AcceleratorState._reset_state(True)
        os.environ.update(saved)
        if dist.is_initialized() and not before:
            dist.destroy_process_group()


def _ours(accum, norm_type=2.0, **options):
    with launched(0, 1):
        accelerator = sharded.Accelerator(cpu=True, gradient_accumulation_steps=accum, **options)
        report = script(accelerator, accum, BATCH, norm_type=norm_type)
        rt = accelerator.runtime
        report.update(batches=accelerator.trained_batches, step=rt.ctx.pinned, world=rt.world,
                      reduce_scatters=rt.counters["reduce_scatters"])
        rt.close()
    return report


def _plain(accum, norm_type=2.0):
    with launched(0, 1):
        return script(accelerate.Accelerator(cpu=True, gradient_accumulation_steps=accum), accum, BATCH,
                      norm_type=norm_type)


@pytest.mark.parametrize("norm_type", [2.0, math.inf], ids=["2-norm", "inf-norm"])
@pytest.mark.parametrize("accum", [1, 2], ids=["no_accumulation", "accumulate_2"])
def test_one_rank_matches_plain_accelerate(accum, norm_type):
    ours, plain = _ours(accum, norm_type), _plain(accum, norm_type)
    assert_same_run(ours, plain, accum)
    assert ours["world"] == 1
    assert ours["batches"] == STEPS * accum and ours["step"] == STEPS - 1  # batch n names step n // accum


def test_the_inf_norm_is_not_the_2_norm():
    two, inf = _ours(1, 2.0), _ours(1, math.inf)
    assert two["norms"][0] > 1.5 * inf["norms"][0] > 0


def test_shard_options_reach_shard():
    with launched(0, 1):
        accelerator = sharded.Accelerator(cpu=True, shard_options={"prefetch": 0, "min_unit_bytes": 0})
        model = accelerator.prepare(build())
        rt = accelerator.runtime
        assert rt.model is accelerator.unwrap_model(model) and rt.world == 1
        assert len(rt.units) == 4  # three Linears and the root: min_unit_bytes=0 merged nothing
        assert rt.scheduler.prefetch.depth == 0
        rt.close()


def test_a_model_sharded_before_is_prepared_as_it_is():
    with launched(0, 1):
        model = build()
        rt = paramfsm.shard(model, group="single")
        accelerator = sharded.Accelerator(cpu=True, runtime=rt)
        prepared = accelerator.prepare(model)
        assert accelerator.runtime is rt and accelerator.unwrap_model(prepared) is model
        with pytest.raises(paramfsm.ParamFSMError, match=r"shards one model \(Sequential, rank 0\); prepare another "
                                                         r"\(Linear\) with a second Accelerator"):
            accelerator.prepare(nn.Linear(2, 2))
        rt.close()


def test_resume_from_save_state_ends_where_the_straight_run_ends(tmp_path):
    folder = str(tmp_path / "state")
    straight = _ours(2)
    with launched(0, 1):
        first = sharded.Accelerator(cpu=True, gradient_accumulation_steps=2)
        head = script(first, 2, BATCH, stop_after=2, save=folder)
        first.runtime.close()
    saved = sorted(os.listdir(folder))
    assert sharded.SHARDS_DIR in saved and sharded.STEPS_FILE in saved and "optimizer.bin" not in saved, saved
    with open(os.path.join(folder, sharded.STEPS_FILE), encoding="utf-8") as handle:
        assert json.load(handle) == {"trained_batches": 4}
    with launched(0, 1):
        again = sharded.Accelerator(cpu=True, gradient_accumulation_steps=2)
        tail = script(again, 2, BATCH, stop_after=2, resume=folder)
        assert again.trained_batches == STEPS * 2
        again.runtime.close()
    assert head["norms"] + tail["norms"] == pytest.approx(straight["norms"], rel=1e-6)
    for key, want in straight["params"].items():
        assert torch.allclose(tail["params"][key], want, atol=1e-6), key


def test_load_state_refuses_what_save_state_did_not_write(tmp_path):
    with launched(0, 1):
        accelerator = sharded.Accelerator(cpu=True)
        accelerator.prepare(build())
        with pytest.raises(paramfsm.ParamFSMError, match=r"load_state: pass the folder save_state wrote \(rank 0\)"):
            accelerator.load_state(None)
        with pytest.raises(paramfsm.ParamFSMError, match=rf"has no {sharded.SHARDS_DIR}/ \(rank 0\): it was not saved"):
            accelerator.load_state(str(tmp_path))
        accelerator.runtime.close()


def test_two_optimizers_are_refused_by_save_state(tmp_path):
    with launched(0, 1):
        accelerator = sharded.Accelerator(cpu=True)
        model = build()
        first = torch.optim.SGD(model.parameters(), lr=0.1)
        second = torch.optim.SGD(model.parameters(), lr=0.1)
        accelerator.prepare(model, first, second)
        with pytest.raises(paramfsm.ParamFSMError, match=r"2 optimizers were prepared \(rank 0\); paramfsm "
                                                         "checkpoints one optimizer"):
            accelerator.save_state(str(tmp_path / "s"))
        accelerator.runtime.close()


@pytest.mark.parametrize("plugin", ["deepspeed_plugin", "fsdp_plugin", "megatron_lm_plugin"])
def test_a_sharding_plugin_is_refused(plugin):
    with pytest.raises(paramfsm.ParamFSMError) as caught:
        sharded.Accelerator(cpu=True, **{plugin: object()})
    assert str(caught.value) == (f"paramfsm's Accelerator takes no {plugin}: paramfsm shards the model itself; drop "
                                 "the plugin (or use accelerate.Accelerator with it, without paramfsm)")


def test_fp16_is_refused_with_the_fix():
    with pytest.raises(paramfsm.ParamFSMError) as caught:
        sharded.Accelerator(cpu=True, mixed_precision="fp16")
    assert str(caught.value) == (
        "paramfsm's Accelerator: mixed_precision='fp16' scales the loss with Accelerate's GradScaler, which would "
        "decide on each rank alone whether to skip a step (the shards would diverge); use mixed_precision='bf16', "
        "or shard_options={'param_dtype': torch.bfloat16}")


def test_shard_options_and_a_runtime_together_are_refused():
    with launched(0, 1):
        model = build()
        rt = paramfsm.shard(model, group="single")
        with pytest.raises(paramfsm.ParamFSMError) as caught:
            sharded.Accelerator(cpu=True, runtime=rt, shard_options={"prefetch": 2})
        assert str(caught.value) == ("paramfsm's Accelerator: pass shard_options= (prepare shards the model) or "
                                     "runtime= (a model already sharded), not both")
        rt.close()


def test_the_loader_names_training_batches_only():
    with launched(0, 1):
        accelerator = sharded.Accelerator(cpu=True, gradient_accumulation_steps=2)
        model, loader = accelerator.prepare(build(), torch.utils.data.DataLoader(data(2), batch_size=BATCH))
        assert isinstance(loader, sharded.SteppedLoader)
        assert len(loader) == len(loader.loader) == STEPS * 2 and loader.dataset is loader.loader.dataset
        model.eval()
        assert sum(1 for _ in loader) == STEPS * 2 and accelerator.trained_batches == 0
        model.train()
        seen = []
        for _ in loader:
            seen.append(accelerator.runtime.ctx.pinned)
        assert seen == [n // 2 for n in range(STEPS * 2)] and accelerator.trained_batches == STEPS * 2
        rest = accelerator.skip_first_batches(loader, 5)
        assert isinstance(rest, sharded.SteppedLoader) and sum(1 for _ in rest) == STEPS * 2 - 5
        assert accelerator.trained_batches == STEPS * 4 - 5
        with pytest.raises(AttributeError):
            sharded.SteppedLoader.__getattr__(loader, "accelerator")
        accelerator.runtime.close()


def test_without_a_sharded_model_it_is_plain_accelerate():
    with launched(0, 1):
        accelerator = sharded.Accelerator(cpu=True)
        model = build()
        model(torch.ones(1, 8)).sum().backward()
        norm = accelerator.clip_grad_norm_(model.parameters(), 1e-3)
        assert float(norm) > 1e-3
        assert sum(p.grad.norm() ** 2 for p in model.parameters()) ** 0.5 == pytest.approx(1e-3, rel=1e-3)
        with accelerator.no_sync(model):
            pass
        assert set(accelerator.get_state_dict(model)) == set(model.state_dict())


def test_a_launch_that_accelerate_runs_alone_is_refused_word_for_word(monkeypatch):
    from accelerate.state import AcceleratorState

    if torch.cuda.is_available():
        pytest.skip("with a GPU, Accelerate joins the launched processes")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    AcceleratorState._reset_state(True)
    try:
        with pytest.raises(paramfsm.ParamFSMError) as caught:
            sharded.Accelerator().prepare(build())
    finally:
        AcceleratorState._reset_state(True)
    assert str(caught.value) == (
        "this process is one of 2 (WORLD_SIZE), but Accelerate runs it alone (rank 1), so each would train its own "
        "unsharded copy: without a GPU, pass Accelerator(cpu=True), which makes Accelerate join the processes "
        "torchrun started")


def test_skipping_batches_of_a_loader_it_did_not_prepare_numbers_them_too():
    with launched(0, 1):
        accelerator = sharded.Accelerator(cpu=True)
        accelerator.prepare(build())
        plain = torch.utils.data.DataLoader(data(1), batch_size=BATCH)
        rest = accelerator.skip_first_batches(plain, 1)
        assert isinstance(rest, sharded.SteppedLoader) and sum(1 for _ in rest) == len(plain) - 1
        assert accelerator.trained_batches == len(plain) - 1
        accelerator.runtime.close()
