"""Behaviour a user relies on that the rest of the suite let slip, each checked where it lives.

Every test states what a user does and what they see, against plain torch or
the documented contract: which unit a read outside a unit is credited to (the
``ReadOutsideUnit`` warning and when the weight is released), the default
units of ``nn.TransformerDecoder``, leaving ``rt.no_sync()`` after
``rt.set_requires_gradient_sync(False)``, a :class:`~paramfsm.verify.launch.RankPool`
after a rank failed, the boundary of ``paramfsm.by_size``, and ``rt.memory()``
on one rank and two.
"""

from __future__ import annotations

import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from one_rank import one_rank  # noqa: F401  (fixture)
from patterns_common import Pair, batch
from reading_models import DIM, Reader
from torch import nn

import paramfsm
from paramfsm import State
from paramfsm.engine.schedule.on_demand import ReadOutsideUnit
from paramfsm.errors import UnsyncedGradients
from paramfsm.verify.launch import RankFailure, RankPool
from paramfsm.testing.models import mlp



# ---------------------------------------------------------------- reads outside a unit

def reader_job(rank, world):
    torch.manual_seed(0)
    pair = Pair(Reader(), rank, world)
    rt = pair.rt
    at_out = []  # the weight's state when the next module's forward starts, every step
    pair.model.out.register_forward_pre_hook(lambda module, args: at_out.append(rt.state("block.proj.weight")))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(2):
            (x,) = batch(step, world, 2, (4,))
            pair.zero_grad()
            pair.model(pair.local(x)).pow(2).mean().backward()
            pair.ref.model(x).pow(2).mean().backward()
            pair.check_grads(f"step {step}")
            pair.step(f"step {step}")
    told = [str(w.message) for w in caught if issubclass(w.category, ReadOutsideUnit)]
    borrowers = [u.name for u in rt.record("block.proj.weight").units]
    report = pair.finish()
    report.update(told=told, at_out=at_out, borrowers=borrowers)
    return report


def test_a_read_outside_its_unit_is_credited_to_the_innermost_running_unit(ranks2):
    """``block`` reads ``block.proj``'s weight while the root's forward also runs: the warning names
    ``block`` (not the root) and advises merging ``block.proj`` alone, the weight is released with
    ``block`` (empty again when ``out`` starts), and training equals plain torch."""
    for report in ranks2.run(reader_job):
        assert len(report["told"]) == 2, report["told"]  # the weight and the bias, once each
        for message in report["told"]:
            assert "read by the forward or backward of unit 'block' outside" in message, message
            assert "units=lambda name, module: name not in ('block.proj',)" in message, message
        assert report["borrowers"] == ["block.proj", "block"], report["borrowers"]
        assert report["at_out"] == [State.NOT_AVAILABLE] * 2, report["at_out"]
        assert report["checks"] == 4 and report["grad_err"] <= 1e-6, report


# ---------------------------------------------------------------- nn.TransformerDecoder's default units
def decoder_job(rank, world):
    torch.manual_seed(0)
    layer = nn.TransformerDecoderLayer(DIM, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
    pair = Pair(nn.TransformerDecoder(layer, 2), rank, world)
    rt = pair.rt
    tgt, memory = batch(0, world, 2, (3, DIM), (4, DIM))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pair.zero_grad()
        pair.model(pair.local(tgt), pair.local(memory)).pow(2).mean().backward()
        pair.ref.model(tgt, memory).pow(2).mean().backward()
        first_step = dict(rt.counters)
        pair.check_grads("decoder")
        pair.step("decoder")
    report = pair.finish()
    report.update(units=[u.name for u in rt.units], first_step=first_step,
                  told=[str(w.message) for w in caught if issubclass(w.category, ReadOutsideUnit)])
    return report


def test_transformer_decoder_layers_are_one_unit_each(ranks2):
    """A 2-layer ``nn.TransformerDecoder`` gets 3 units: each layer whole (its forward reads its
    attentions' and linears' weights itself), plus the root unit, which every model has and which owns
    nothing here (the decoder has no final norm). The first backward therefore issues 4 all-gathers,
    each layer once in forward and once in backward (a layer split into its 7 parameterised children
    would give 15 units and 28), nothing is gathered on demand, and training equals plain torch."""
    for report in ranks2.run(decoder_job):
        assert report["units"] == ["<root>", "layers.0", "layers.1"], report["units"]
        assert report["first_step"]["all_gathers"] == 4, report["first_step"]
        assert report["first_step"]["reduce_scatters"] == 1, report["first_step"]
        assert report["told"] == [], report["told"]
        assert report["checks"] == 2 and report["grad_err"] <= 1e-6 and report["param_err"] <= 1e-5, report


# ---------------------------------------------------------------- no_sync restores the previous switch
def sync_switch_job(rank, world):
    torch.manual_seed(0)
    pair = Pair(mlp(), rank, world)
    rt, out = pair.rt, {}

    def micro_batch(i):
        x, y = batch(i, world, 2, (4,), (3,))
        F.mse_loss(pair.model(pair.local(x)), pair.local(y)).backward()
        F.mse_loss(pair.ref.model(x), y).backward()

    pair.zero_grad()
    rt.set_requires_gradient_sync(False)
    micro_batch(0)
    with rt.no_sync():
        micro_batch(1)
    before = rt.counters["reduce_scatters"]
    micro_batch(2)  # sync is still off: no_sync restored the switch as it found it
    out["reduce_scatters_after_window"] = rt.counters["reduce_scatters"] - before
    try:
        pair.opt.step()
        out["step"] = "stepped"
    except UnsyncedGradients as exc:
        out["step"] = str(exc)
    if out["step"] == "stepped":
        return out  # the weights moved without the reference's: nothing after this could match it
    rt.set_requires_gradient_sync(True)
    micro_batch(3)  # the first backward with sync on reduce-scatters all four micro-batches once
    out["reduce_scatters_synced"] = rt.counters["reduce_scatters"] - before
    pair.check_grads("four micro-batches")
    pair.step("four micro-batches")
    pair.zero_grad()
    with rt.no_sync():
        micro_batch(4)
    before = rt.counters["reduce_scatters"]
    micro_batch(5)  # sync was on before the window: on again after it
    out["reduce_scatters_sync_on"] = rt.counters["reduce_scatters"] - before
    pair.check_grads("two micro-batches")
    out.update(pair.finish())
    return out


def test_leaving_no_sync_restores_the_switch_it_found(ranks2):
    """After ``rt.set_requires_gradient_sync(False)``, a ``with rt.no_sync():`` block leaves sync off:
    the next backward reduce-scatters nothing and an optimizer step still refuses the kept gradients;
    with sync on before the block, it is on after it. Gradients are plain torch's accumulated sums."""
    for out in ranks2.run(sync_switch_job):
        assert out["reduce_scatters_after_window"] == 0, out
        assert out["step"] != "stepped" and "SGD.step()" in out["step"], out["step"]
        assert out["reduce_scatters_synced"] > 0 and out["reduce_scatters_sync_on"] > 0, out
        assert out["checks"] == 3 and out["grad_err"] <= 1e-6, out


# ---------------------------------------------------------------- RankPool after a failure
def _fails_on_rank_1(rank, world):
    """Rank 1 raises at once; rank 0 answers later, after the failure has been reported."""
    if rank == 1:
        raise ValueError("rank 1 gives up")
    time.sleep(0.5)
    return ("failed run", rank)


def _answers(rank, world):
    return ("next run", rank, world)


def test_a_pool_after_a_failed_run_returns_the_next_runs_results():
    """A run that fails on one rank raises ``RankFailure`` naming it; the pool's next run answers with
    the next function's results on every rank, never an answer left over from the failed run."""
    with RankPool(2, timeout=60) as pool:
        with pytest.raises(RankFailure, match="rank 1 gives up") as failure:
            pool.run(_fails_on_rank_1)
        assert failure.value.rank == 1
        assert pool.run(_answers) == [("next run", 0, 2), ("next run", 1, 2)]


# ---------------------------------------------------------------- by_size's boundary
def _two_linears() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def _units_and_grads(min_bytes: int):
    model = _two_linears()
    ref = _two_linears()
    rt = paramfsm.shard(model, units=paramfsm.by_size(min_bytes=min_bytes))
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    model(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    worst = max((rt.full_grad(name) - p.grad).abs().max().item() for name, p in ref.named_parameters())
    names = [u.name for u in rt.units]
    rt.close()
    return names, worst


def test_by_size_makes_a_container_of_exactly_min_bytes_a_unit(one_rank):  # noqa: F811
    """``by_size(min_bytes=N)`` makes a module a unit once its parameters "add up to" N: a Linear(4, 4)
    of exactly 80 bytes is a unit at N = 80 (and below), not at 81, where the root takes it."""
    size = sum(p.numel() * p.element_size() for p in nn.Linear(4, 4).parameters())
    assert size == 80
    for min_bytes, units in ((size - 1, ["<root>", "0"]), (size, ["<root>", "0"]), (size + 1, ["<root>"])):
        names, worst = _units_and_grads(min_bytes)
        assert names == units, (min_bytes, names)
        assert worst <= 1e-6, (min_bytes, worst)


# ---------------------------------------------------------------- rt.memory()
def _bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_memory_on_one_rank_never_counts_parameters_as_gathered(one_rank):  # noqa: F811
    """On one rank a parameter is a view of its shard: ``rt.memory()`` reports the model once, as
    shards, and nothing gathered, at rest, inside ``rt.gathered()`` and during a forward."""
    torch.manual_seed(0)
    model = mlp()
    full = _bytes(model)
    rt = paramfsm.shard(model)
    during = []
    model[2].register_forward_pre_hook(lambda module, args: during.append(rt.memory()["gathered"]))
    at_rest = rt.memory()
    with rt.gathered(writeback=False):
        inside = rt.memory()
    model(torch.randn(2, 4)).sum().backward()
    after = rt.memory()
    rt.close()
    assert at_rest["shards"] == full and at_rest["gathered"] == 0, at_rest
    assert inside["shards"] == full and inside["gathered"] == 0, inside
    assert during == [0], during
    assert after["gathered"] == 0 and after["shard_grads"] == full, after


def memory_job(rank, world):
    torch.manual_seed(0)
    model = mlp()
    full = _bytes(model)
    shards = sum(-(-p.numel() // world) * p.element_size() for p in model.parameters())
    rt = paramfsm.shard(model)
    at_rest = rt.memory()
    with rt.gathered(writeback=False):
        inside = rt.memory()
    rt.close()
    return full, shards, at_rest, inside


def test_memory_on_two_ranks_counts_gathered_parameters_only_while_gathered(ranks2):
    """On two ranks each rank holds half of every parameter (padded) at rest and the full model inside
    ``rt.gathered()``."""
    for full, shards, at_rest, inside in ranks2.run(memory_job):
        assert at_rest["shards"] == shards and at_rest["gathered"] == 0, at_rest
        assert inside["shards"] == shards and inside["gathered"] == full, (full, inside)
