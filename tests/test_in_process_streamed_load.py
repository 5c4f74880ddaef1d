"""A checkpoint load under offload (:mod:`paramfsm.checkpoint.streamed_load`) on one rank, in the test process.

On one rank the optimizer state can be offloaded (a parameter is a view of its
shard there, so the shards stay), and that is enough for the load to stream:
here, on a world-1 group (``one_rank``) where ``make mutate`` sees it. A run
resumed from the checkpoint ends where the straight run ends, whether units
are read one at a time or together; buffers and the optimizer's
hyperparameters come back with them; a read that fails first changes
nothing, and one that fails part-way refuses the forward until a load
completes. ``tests/test_offload_streaming.py`` runs the same on two ranks.
"""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader

import paramfsm
import paramfsm.checkpoint
from one_rank import one_rank  # noqa: F401 - the fixture
from paramfsm.checkpoint import streamed_load

STEPS, SAVE_AT = 4, 2
X = torch.randn(4, 8, generator=torch.Generator().manual_seed(5))


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _step(model, opt, i):
    opt.zero_grad()
    model(X * (i + 1)).pow(2).mean().backward()
    opt.step()


@contextlib.contextmanager
def _staging(nbytes):
    budget, streamed_load.STAGING_BYTES = streamed_load.STAGING_BYTES, nbytes
    try:
        yield
    finally:
        streamed_load.STAGING_BYTES = budget


@contextlib.contextmanager
def _reads(fail_at=0):
    """Count the checkpoint's DCP data reads; the ``fail_at``-th raises an I/O error (0: none does)."""
    read, calls = FileSystemReader.read_data, [0]

    def counted(self, plan, planner):
        calls[0] += 1
        if calls[0] == fail_at:
            raise OSError(5, "Input/output error")
        return read(self, plan, planner)
    FileSystemReader.read_data = counted
    try:
        yield calls
    finally:
        FileSystemReader.read_data = read


def _run(folder, *, resume: bool, staging: int):
    """STEPS AdamW steps under optimizer offload; with ``resume``, saved at SAVE_AT, moved on, loaded back."""
    model = _model()
    rt = paramfsm.shard(model, offload=paramfsm.Offload(optimizer="disk", path=f"{folder}/tier"), min_unit_bytes=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    reads = None
    for i in range(STEPS):
        if resume and i == SAVE_AT:
            paramfsm.checkpoint.save(rt, f"{folder}/ck", optimizer=opt)
            _step(model, opt, 99)  # a step the load must undo, values, statistics and moments alike
            opt.param_groups[0]["lr"] = 5.0
            with _staging(staging), _reads() as reads:
                paramfsm.checkpoint.load(rt, f"{folder}/ck", optimizer=opt)
            assert opt.param_groups[0]["lr"] == 1e-2
        _step(model, opt, i)
    values, units = rt.full_state_dict(), len(rt.units)
    rt.close()
    return values, units, reads[0] if reads else None


@pytest.mark.parametrize("staging", [1, 1 << 24], ids=["one-unit-a-read", "together"])
def test_a_run_resumed_under_offload_ends_where_the_straight_run_ends(one_rank, tmp_path, staging):
    straight, units, _ = _run(tmp_path / "a", resume=False, staging=staging)
    resumed, _, reads = _run(tmp_path / "b", resume=True, staging=staging)
    assert "1.running_mean" in straight and units == 5  # the root (no parameters of its own) and four modules
    for key, value in straight.items():
        assert torch.equal(resumed[key], value), key
    assert reads == (units if staging == 1 else 1)  # one unit a read: the root's read carries the buffers


def _failing(folder, fail_at):
    model = _model()
    rt = paramfsm.shard(model, offload=paramfsm.Offload(optimizer="cpu"), min_unit_bytes=0)
    saved = rt.full_state_dict()
    paramfsm.checkpoint.save(rt, f"{folder}/ck")
    changed = {k: v + 1 for k, v in saved.items()}
    rt.load_full_state_dict(changed)
    with _staging(1), _reads(fail_at), pytest.raises(paramfsm.ParamFSMError) as caught:
        paramfsm.checkpoint.load(rt, f"{folder}/ck")
    model.eval()  # the forward below must not move the batch norm's statistics
    try:
        model(X)
        refused = None
    except paramfsm.ParamFSMError as exc:
        refused = str(exc)
    after = rt.full_state_dict()
    paramfsm.checkpoint.load(rt, f"{folder}/ck")
    model(X)  # a complete load lifts any refusal
    again = rt.full_state_dict()
    rt.close()
    return str(caught.value), refused, saved, changed, after, again


def test_a_first_read_that_fails_changes_nothing(one_rank, tmp_path):
    error, refused, saved, changed, after, again = _failing(tmp_path, 1)
    assert "(rank 0: OSError: Input/output error); nothing was loaded; the model and optimizer are unchanged. " \
           "What to do: load another complete checkpoint (rank 0)" in error, error
    assert refused is None
    assert all(torch.equal(after[k], v) for k, v in changed.items())
    assert all(torch.equal(again[k], v) for k, v in saved.items())


@pytest.mark.parametrize("fail_at", [3, 4])
def test_a_read_that_fails_part_way_refuses_the_forward_until_a_load_completes(one_rank, tmp_path, fail_at):
    error, refused, saved, changed, after, again = _failing(tmp_path, fail_at)
    # the root's read (the buffers) succeeded, then one unit a read: 2 parameters each
    assert f"the values of {2 * (fail_at - 2)} of 8 parameters were loaded and the rest hold their old values, so " \
           "the model's forward is refused until a load completes" in error, error
    assert refused is not None and "paramfsm.checkpoint.load failed part-way" in refused, refused
    loaded = [key for key in saved if torch.equal(after[key], saved[key])]
    want = ["0.weight", "0.bias", "1.weight", "1.bias"][: 2 * (fail_at - 2)]
    assert loaded == [*want[:2], *want[2:], "1.running_mean", "1.running_var", "1.num_batches_tracked"], loaded
    assert torch.equal(after["5.weight"], changed["5.weight"])
    assert all(torch.equal(again[k], v) for k, v in saved.items())


def test_keys_are_batched_by_unit_in_unit_order(one_rank, tmp_path):
    model = _model()
    rt = paramfsm.shard(model, offload=paramfsm.Offload(optimizer="cpu"), min_unit_bytes=0)
    opt = torch.optim.AdamW(model.parameters())
    _step(model, opt, 0)
    keys = ["1.running_mean", "5.bias", "0.weight", "optim.0.weight.exp_avg", "optim.param_groups", "3.weight",
            "optim.5.bias.step", "1.weight", "extra"]
    plan = streamed_load.batches(rt, keys, opt)
    names = [[rec.name for rec in records] for records, _ in plan]
    assert names == [[], ["0.weight", "0.bias"], ["1.weight", "1.bias"], ["3.weight", "3.bias"], ["5.weight", "5.bias"]]
    assert [batch_keys for _, batch_keys in plan] == [
        ["1.running_mean", "optim.param_groups", "extra"], ["0.weight", "optim.0.weight.exp_avg"], ["1.weight"],
        ["3.weight"], ["5.bias", "optim.5.bias.step"]]
    without = [batch_keys for _, batch_keys in streamed_load.batches(rt, keys, None)]  # no optimizer: state is loose
    assert without == [["1.running_mean", "optim.0.weight.exp_avg", "optim.param_groups", "optim.5.bias.step",
                        "extra"], ["0.weight"], ["1.weight"], ["3.weight"], ["5.bias"]]
    assert streamed_load.batches(rt, [], None) == []
    rt.close()
    merged = _model()  # every layer merged into the root, whose batch then carries the loose keys too
    rt = paramfsm.shard(merged, offload=paramfsm.Offload(optimizer="cpu"), min_unit_bytes=1 << 16)
    ((records, batch_keys),) = streamed_load.batches(rt, ["5.bias", "1.running_var", "0.weight"], None)
    assert sorted(rec.name for rec in records) == sorted(name for name, _ in merged.named_parameters())
    assert batch_keys == ["1.running_var", "5.bias", "0.weight"]
    rt.close()


def test_the_staging_of_a_value_is_the_part_this_rank_holds(one_rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from paramfsm.checkpoint.layout import ShardPieces

    local = torch.zeros(4, 3, dtype=torch.float64)
    sharded = DTensor.from_local(local, init_device_mesh("cpu", (1,)), [Shard(0)], run_check=False, shape=(8, 3),
                                 stride=(3, 1))
    assert sharded.numel() == 24 and streamed_load._staged_bytes(sharded) == 4 * 3 * 8
    pieces = ShardPieces("w", (10, 10), torch.zeros(7, dtype=torch.bfloat16), [])
    assert streamed_load._staged_bytes(pieces) == 7 * 2
    assert streamed_load._staged_bytes(torch.zeros(5, dtype=torch.float16)) == 10
    assert streamed_load._staged_bytes({"lr": 0.1}) == 0 and streamed_load._staged_bytes(3) == 0


def test_merging_keeps_unit_order_and_starts_a_new_read_only_past_the_budget():
    own = {f"k{i}": torch.empty(n) for i, n in enumerate((4, 4, 4, 4))}  # 16 bytes each
    plan = [(("a",), ["k0"]), (("b",), ["k1"]), (("c",), ["k2"]), (("d",), ["k3"])]
    assert streamed_load.merged(plan, own, 32) == [(("a", "b"), ["k0", "k1"]), (("c", "d"), ["k2", "k3"])]
    assert streamed_load.merged(plan, own, 48) == [(("a", "b", "c"), ["k0", "k1", "k2"]), (("d",), ["k3"])]
    assert streamed_load.merged(plan, own, 31) == plan
    assert streamed_load.merged([], own, 32) == []
    first = streamed_load.merged([((), ["k0"]), (("a",), ["k1"])], own, 32)
    assert first == [(("a",), ["k0", "k1"])]  # a batch with no records (the buffers) joins the next
