"""Whole-model passes under offload stream through the tier: one module's or parameter's shards at a time.

``rt.init_weights()`` on a meta model, ``rt.load_full_state_dict``, ``load_pretrained``,
``rt.full_state_dict()`` and a DCP save (``paramfsm.checkpoint.save``, model and optimizer state) each page
in only what they are working on and page it out after (written to the tier when they changed it), so
they never hold the whole model; their values are plain torch's. A save of shards that span several rows
and end mid-row (several boxes per shard) reads back exactly through plain DCP into a plain model.
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch

import paramfsm
import paramfsm.checkpoint
from paramfsm.checkpoint import streamed_load
from paramfsm.integrations.hf import load_pretrained
from paramfsm.testing.models import mlp


@pytest.fixture(scope="module")
def ranks2(in_process2):
    """This file's two ranks are threads of the test process (``gloo_ranks.py``), where ``make mutate`` sees
    them; a test that needs processes of its own asks for ``suite_ranks2``."""
    return in_process2


WIDTH, DEPTH = 32, 6


def _build():
    return mlp(width=WIDTH, depth=DEPTH, d_in=8, d_out=4)


def _constant_init(module):
    if isinstance(module, torch.nn.Linear):
        torch.nn.init.constant_(module.weight, 0.01 * module.in_features)
        torch.nn.init.constant_(module.bias, -0.02)


class Watch:
    """The most offloaded bytes resident in working memory at once while it is on (wraps ``need``)."""

    def __init__(self, rt):
        self.residency, self.peak = rt.offload.residency, 0
        need = self.residency.need

        def watched(placements, **kwargs):
            need(placements, **kwargs)
            self.peak = max(self.peak, self.residency.resident_bytes)
        self.residency.need = watched

    def measure(self, fn):
        self.peak = 0
        out = fn()
        return out, self.peak, self.residency.resident_bytes


@contextlib.contextmanager
def one_unit_a_read():
    """A streamed load reads one unit a DCP load (its staging budget below any unit), then the default again:
    the rank pools' workers outlive a test."""
    budget, streamed_load.STAGING_BYTES = streamed_load.STAGING_BYTES, 1
    try:
        yield
    finally:
        streamed_load.STAGING_BYTES = budget


def test_units_are_read_together_up_to_the_staging_budget():
    own = {f"k{i}": torch.empty(n) for i, n in enumerate((4, 4, 8, 2, 2))}  # float32: 16, 16, 32, 8, 8 bytes
    plan = [(("a",), ["k0"]), (("b",), ["k1"]), (("c",), ["k2"]), (("d",), ["k3", "k4"])]
    assert streamed_load.merged(plan, own, 32) == [(("a", "b"), ["k0", "k1"]), (("c",), ["k2"]), (("d",), ["k3", "k4"])]
    assert streamed_load.merged(plan, own, 1) == [(r, k) for r, k in plan]  # a unit over budget is read alone
    assert streamed_load.merged(plan, own, 1 << 20) == [(("a", "b", "c", "d"), ["k0", "k1", "k2", "k3", "k4"])]


class Staged:
    """The most tensor bytes one ``dcp.load`` call was handed to read into while it is on."""

    def __init__(self):
        self.peak = 0

    @contextlib.contextmanager
    def watching(self):
        import torch.distributed.checkpoint as dcp

        read = dcp.load

        def counted(state_dict, **kwargs):
            nbytes = sum(_local(v).numel() * v.element_size() for v in state_dict.values() if torch.is_tensor(v))
            self.peak = max(self.peak, nbytes)
            return read(state_dict, **kwargs)
        dcp.load = counted
        try:
            yield self
        finally:
            dcp.load = read


def _local(value):
    """The values a rank holds of a staged tensor: a DTensor's local part, a ShardPieces' valid flat part."""
    if hasattr(value, "to_local"):
        return value.to_local()
    return getattr(value, "flat", value)


def stream_job(rank, world, folder, pretrained):
    with torch.device("meta"):
        model = _build()
    offload = paramfsm.Offload(params="disk", optimizer="disk", grads="disk", path=folder)
    rt = paramfsm.shard(model, device="cpu", offload=offload)
    unit_bytes = max(sum(rec.shard.numel() * rec.shard.element_size() for rec in unit.records)
                     for unit in rt.units)
    model_bytes = sum(rec.shard.numel() * rec.shard.element_size() for rec in rt._by_id.values())
    watch = Watch(rt)
    passes = {}
    passes["init"] = watch.measure(lambda: rt.init_weights(_constant_init))[1:]
    initialised, *passes["save"] = watch.measure(rt.full_state_dict)
    doubled = {k: v * 2 for k, v in initialised.items()}
    passes["load"] = watch.measure(lambda: rt.load_full_state_dict(doubled))[1:]
    loaded = rt.full_state_dict()
    passes["pretrained"] = watch.measure(lambda: load_pretrained(rt, pretrained))[1:]
    reloaded = rt.full_state_dict()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(4, 8)).pow(2).mean().backward()
    opt.step()
    trained = rt.full_state_dict()
    checkpoint = f"{folder}-checkpoint"
    residency = rt.offload.residency
    # A parameter's optimizer state is one placement (both AdamW moments): the most a save holds at once.
    state_bytes = max(p.nbytes for p in residency.optim.values())
    passes["dcp save"] = watch.measure(lambda: paramfsm.checkpoint.save(rt, checkpoint, optimizer=opt))[1:]
    unit_bytes = {name: unit_bytes for name in passes} | {"dcp save": max(unit_bytes, state_bytes)}
    rt.close()
    with torch.device("meta"):
        again = _build()
    rt2 = paramfsm.shard(again, device="cpu", offload=offload)
    opt2 = torch.optim.AdamW(again.parameters(), lr=1e-2)
    opt2.step()  # the state exists before the load, so the load's own peak is what the watch sees
    staged = Staged()
    with staged.watching(), one_unit_a_read():  # what the bounds below check
        passes["dcp load"] = Watch(rt2).measure(lambda: paramfsm.checkpoint.load(rt2, checkpoint, optimizer=opt2))[1:]
    # A load holds one unit's shards and their AdamW moments, resident and staged; a step count is 8 bytes.
    unit_bytes["dcp load"] = 3 * unit_bytes["init"]
    passes["dcp load staging"] = (staged.peak, 0)
    unit_bytes["dcp load staging"] = 3 * unit_bytes["init"] + 8 * 2 * len(residency.optim)
    restored = rt2.full_state_dict()
    moments = [sorted(k for k in opt2.state_dict()["state"][i]) for i in opt2.state_dict()["state"]]
    rt2.close()
    return passes, unit_bytes, model_bytes, initialised, loaded, reloaded, trained, restored, moments


def test_whole_model_passes_stream_through_the_tier(ranks2, tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(0)
    plain = _build()
    plain.apply(_constant_init)
    pretrained = {k: v * 3 for k, v in plain.state_dict().items()}
    save_file(pretrained, str(tmp_path / "model.safetensors"))
    folder = tmp_path / "tier"
    results = ranks2.run(stream_job, str(folder), str(tmp_path))
    reference = _build()
    reference.load_state_dict(pretrained)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    reference(torch.ones(4 * 2, 8)).pow(2).mean().backward()
    opt.step()
    for passes, unit_bytes, model_bytes, initialised, loaded, reloaded, trained, restored, moments in results:
        assert model_bytes > 4 * unit_bytes["init"]  # several units: holding the model whole would show
        for name, (peak, after) in passes.items():
            # One module's shards (or one parameter's optimizer state) at a time, nothing resident after.
            assert 0 < peak <= unit_bytes[name], (name, peak, unit_bytes, model_bytes)
            assert after == 0, (name, after)
        for key, value in plain.state_dict().items():
            assert torch.equal(initialised[key], value), key
            assert torch.equal(loaded[key], value * 2), key
            assert torch.equal(reloaded[key], value * 3), key
            torch.testing.assert_close(trained[key], reference.state_dict()[key], rtol=1e-5, atol=1e-6)
            assert torch.equal(restored[key], trained[key]), key
        assert moments and all(names == ["exp_avg", "exp_avg_sq", "step"] for names in moments)


def in_place_job(rank, world, folder):
    """``dcp.load`` into ``rt.sharded_state_dict()`` in place (its values view the shards) under offload."""
    import torch.distributed.checkpoint as dcp

    offload = paramfsm.Offload(params="disk", optimizer="disk", grads="disk", path=f"{folder}/tier")
    torch.manual_seed(0)
    model = _build()
    rt = paramfsm.shard(model, offload=offload)
    saved = rt.full_state_dict()
    paramfsm.checkpoint.save(rt, f"{folder}/ck")
    rt.load_full_state_dict({k: torch.zeros_like(v) for k, v in saved.items()})
    dcp.load(rt.sharded_state_dict(), checkpoint_id=f"{folder}/ck")
    loaded = rt.full_state_dict()
    rt.close()
    return saved, loaded


def test_dcp_load_into_the_sharded_state_dict_writes_offloaded_shards(ranks2, tmp_path):
    for saved, loaded in ranks2.run(in_place_job, str(tmp_path)):
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), f"{key}: the in-place load did not reach the shard"


def rows_job(rank, world, folder, offload):
    """A save of shards that span several rows and end mid-row, read back by plain DCP into a plain model."""
    import torch.distributed.checkpoint as dcp

    def build():
        torch.manual_seed(0)  # Linear(7, 5).weight: 35 elements, rank 0 holds rows 0-1 and 4 elements of row 2
        return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Tanh(), torch.nn.Linear(5, 9))

    model = build()
    tier = paramfsm.Offload(params="disk", optimizer="disk", path=f"{folder}/tier") if offload else None
    rt = paramfsm.shard(model, offload=tier)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(4, 7, generator=torch.Generator().manual_seed(rank))).pow(2).mean().backward()
    opt.step()
    saved = rt.full_state_dict()
    paramfsm.checkpoint.save(rt, f"{folder}/ck")
    rt.close()
    plain = build()
    state = {k: torch.zeros_like(v) for k, v in plain.state_dict().items()}
    dcp.load(state, checkpoint_id=f"{folder}/ck")
    return saved, state


@pytest.mark.parametrize("offload", [False, True], ids=["resident", "offloaded"])
def test_a_save_of_shards_spanning_rows_loads_into_a_plain_model(ranks2, tmp_path, offload):
    for rank, (saved, loaded) in enumerate(ranks2.run(rows_job, str(tmp_path), offload)):
        assert set(loaded) == set(saved)
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), f"rank {rank}: {key} read back differs from what was saved"


def failing_load_job(rank, world, folder, fail_at):
    """Save, change the values, then load with rank 1's ``fail_at``-th DCP read failing (0: none)."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader

    offload = paramfsm.Offload(params="disk", optimizer="disk", path=f"{folder}/tier")
    torch.manual_seed(0)
    model = _build()
    rt = paramfsm.shard(model, offload=offload)
    saved = rt.full_state_dict()
    paramfsm.checkpoint.save(rt, f"{folder}/ck")
    changed = {k: v + 1 for k, v in saved.items()}
    rt.load_full_state_dict(changed)
    read, calls = FileSystemReader.read_data, [0]

    def flaky(self, plan, planner):
        calls[0] += 1
        if rank == 1 and calls[0] == fail_at:
            raise OSError(5, "Input/output error")
        return read(self, plan, planner)
    FileSystemReader.read_data = flaky
    try:
        with one_unit_a_read():  # so the third read fails part-way
            paramfsm.checkpoint.load(rt, f"{folder}/ck")
        error = None
    except paramfsm.ParamFSMError as exc:
        error = str(exc)
    finally:
        FileSystemReader.read_data = read
    try:
        model(torch.ones(2, 8))
        refused = None
    except paramfsm.ParamFSMError as exc:
        refused = str(exc)
    after = rt.full_state_dict()
    paramfsm.checkpoint.load(rt, f"{folder}/ck")
    model(torch.ones(2, 8))  # a complete load lifts the refusal
    again = rt.full_state_dict()
    units = len(rt.units)
    rt.close()
    return error, refused, after, again, saved, changed, units, calls[0]


# Spawned ranks: each rank patches the process's checkpoint reader its own way.
@pytest.mark.parametrize("fail_at", [1, 3], ids=["first-unit", "part-way"])
def test_a_streamed_load_that_fails_part_way_refuses_the_forward_until_a_load_completes(suite_ranks2, tmp_path,
                                                                                      fail_at):
    for error, refused, after, again, saved, changed, units, calls in suite_ranks2.run(failing_load_job, str(tmp_path),
                                                                                 fail_at):
        assert units > 3 and calls >= fail_at
        assert error is not None and "rank 1" in error and "Input/output error" in error, error
        for key, value in saved.items():
            assert torch.equal(again[key], value), key  # the complete load restores every value
        if fail_at == 1:
            assert "unchanged" in error, error
            assert refused is None, refused
            for key, value in changed.items():
                assert torch.equal(after[key], value), key  # nothing was written
        else:
            assert re.search(r"the values of [1-9]\d* of \d+ parameters were loaded", error), error
            assert refused is not None and "paramfsm.checkpoint.load failed part-way" in refused, refused
            mixed = [torch.equal(after[key], saved[key]) for key in saved]
            assert any(mixed) and not all(mixed), mixed  # earlier units loaded, later ones old


def buffers_job(rank, world, folder):
    """A streamed load of a model with buffers (batch norm's running statistics) and its optimizer state."""
    offload = paramfsm.Offload(params="disk", optimizer="disk", grads="disk", path=f"{folder}/tier")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
    rt = paramfsm.shard(model, offload=offload, min_unit_bytes=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    saved = rt.full_state_dict()
    paramfsm.checkpoint.save(rt, f"{folder}/ck", optimizer=opt)
    model(torch.randn(4, 8)).pow(2).mean().backward()  # moves every value and statistic on
    opt.step()
    paramfsm.checkpoint.load(rt, f"{folder}/ck", optimizer=opt)
    loaded = rt.full_state_dict()
    rt.close()
    return saved, loaded


# Spawned ranks: the ranks draw their batches from the global generator after sharding.
def test_a_streamed_load_restores_buffers_with_the_parameters(suite_ranks2, tmp_path):
    for saved, loaded in suite_ranks2.run(buffers_job, str(tmp_path)):
        assert "1.running_mean" in saved
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), key
