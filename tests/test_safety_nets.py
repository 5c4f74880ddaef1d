"""Each safety net is shown to catch, and communication is asserted rather than assumed.

Odd parameter sizes at world 3 (padding in every shard), the leak audit on a
real leak, the reduce dtype through bytes on the wire, prefetch read from the
trace, and the number of collectives per step of the standard model.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import paramfsm
from paramfsm.engine.effects import rankcheck
from paramfsm.engine.schedule.audit import LeakError
from paramfsm.testing import Reference, assert_close_dicts, rank_slice, sharded_grads, sharded_params
from paramfsm.testing.models import TinyTransformer


@pytest.fixture(scope="module")
def ranks2(in_process2):
    """This file's two ranks are threads of the test process (``gloo_ranks.py``), where ``make mutate`` sees
    them; a test that needs processes of its own asks for ``suite_ranks2``."""
    return in_process2


VOCAB, SEQ = 32, 8


class Odd(nn.Module):
    """No size divisible by 2 or 3, so every parameter's last shard is padded at world 2 and 3.

    20 parameters: the gradient bucket takes the flat (many-parameter) pack path on the CPU too.
    """

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 5)
        self.mix = nn.ModuleList(nn.Linear(5, 5) for _ in range(6))
        self.a = nn.Linear(5, 7)
        self.b = nn.Linear(7, 13)
        self.c = nn.Linear(13, 1)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.mix:
            x = torch.tanh(layer(x))
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _odd_batch(step, world):
    gen = torch.Generator().manual_seed(step)
    return torch.randint(0, 11, (world * 2, 5), generator=gen), torch.randn(world * 2, 5, 1, generator=gen)


def odd_sizes_job(rank, world):
    torch.manual_seed(0)
    model = Odd()
    ref = Reference(model, lambda ps: torch.optim.SGD(ps, lr=0.1))
    rt = paramfsm.shard(model, strict=True)
    opt = torch.optim.SGD(rt.shard_parameters(), lr=0.1)
    report = {"padding": 0, "grad_err": 0.0, "param_err": 0.0}
    for step in range(2):
        tokens, target = _odd_batch(step, world)
        opt.zero_grad()
        ref.zero_grad()
        F.mse_loss(model(rank_slice(tokens, rank, world)), rank_slice(target, rank, world)).backward()
        F.mse_loss(ref.model(tokens), target).backward()
        ref_grads = ref.grads()
        for name, _ in model.named_parameters():
            rec = rt.record(name)
            flat = torch.zeros(rec.shard_numel * world)
            flat[: rec.numel] = ref_grads[name].reshape(-1)
            want = flat[rank * rec.shard_numel:(rank + 1) * rec.shard_numel]
            got = rec.shard.grad
            assert torch.allclose(got, want, atol=1e-6), f"{name}: shard gradient on rank {rank}"
            pad = max(0, min(rec.shard_numel, (rank + 1) * rec.shard_numel - rec.numel))
            if pad:
                assert torch.equal(got[-pad:], torch.zeros(pad)), f"{name}: nonzero padding on rank {rank}"
                report["padding"] += pad
        total = rt.clip_grad_norm_(0.01)
        ref_total = torch.nn.utils.clip_grad_norm_(ref.model.parameters(), 0.01)
        assert torch.allclose(total, ref_total, rtol=1e-5), (total, ref_total)
        report["grad_err"] = max(report["grad_err"], assert_close_dicts(sharded_grads(rt, model), ref.grads()))
        opt.step()
        ref.optimizer.step()
        report["param_err"] = max(report["param_err"], assert_close_dicts(sharded_params(rt, model), ref.params()))
    # a plain state dict loads into the padded shards at the right offsets
    plain = {k: torch.randn_like(v) for k, v in ref.model.state_dict().items()}
    rt.load_full_state_dict(plain)
    loaded = sharded_params(rt, model)
    report["load_err"] = max((loaded[k] - plain[k]).abs().max().item() for k in plain)
    # and the sharded state dict round-trips
    saved = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in rt.sharded_state_dict().items()}
    rt.load_full_state_dict({k: torch.zeros_like(v) for k, v in plain.items()})
    rt.load_sharded_state_dict(saved)
    report["round_trip_err"] = max((v - plain[k]).abs().max().item() for k, v in sharded_params(rt, model).items())
    rt.close()
    return report


# Spawned ranks: the ranks draw values from the global generator after sharding.
@pytest.mark.parametrize("world", [2, 3])
def test_odd_sizes_padding_state_dicts_and_clipping(suite_ranks2, ranks3, world):
    reports = (suite_ranks2 if world == 2 else ranks3).run(odd_sizes_job)
    for report in reports:
        assert report["grad_err"] < 1e-6 and report["param_err"] < 1e-6
        assert report["load_err"] == 0.0 and report["round_trip_err"] == 0.0
    assert sum(r["padding"] for r in reports) > 0, "no shard had padding: the test is vacuous"


def leak_job(rank, world):
    torch.manual_seed(0)
    model = TinyTransformer(vocab=VOCAB, dim=16, depth=2, seq=SEQ)
    rt = paramfsm.shard(model, strict=True)
    tokens = torch.randint(0, VOCAB, (2, SEQ))
    model(tokens).pow(2).mean().backward()
    assert rt.scheduler.audit.last == []
    out = model(tokens)
    unit = rt.units[-1]
    rt.scheduler._step_all(unit.records, "fetch")  # a holder that nobody will release: a real leak
    try:
        out.pow(2).mean().backward()
    except LeakError as exc:
        rt.detach()
        return str(exc), unit.name
    raise AssertionError("the leak audit did not report a parameter left gathered")


def test_leak_audit_reports_a_real_leak(ranks2):
    message, unit = ranks2.run(leak_job)[0]
    assert f"(unit '{unit}') left AVAILABLE holds=1" in message
    assert "held by a forward or backward that never released it" in message


def comm_job(rank, world, reduce_dtype):
    torch.manual_seed(0)
    model = TinyTransformer(vocab=VOCAB, dim=16, depth=2, seq=SEQ)
    rt = paramfsm.shard(model, trace=True, reduce_dtype=reduce_dtype)
    opt = torch.optim.SGD(rt.shard_parameters(), lr=0.1)
    per_step = []
    for step in range(3):
        tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(step))
        before = rt.counters
        out = model(tokens)
        opt.zero_grad()
        out.pow(2).mean().backward(retain_graph=True)
        opt.zero_grad()
        out.abs().mean().backward()
        opt.step()
        per_step.append({k: v - before[k] for k, v in rt.counters.items()})
    shard_elems = sum(rt.record(n).shard_numel for n, _ in model.named_parameters())
    rt.close()
    return per_step, shard_elems * world


@pytest.mark.parametrize("reduce_dtype", [None, torch.bfloat16], ids=["fp32", "bf16"])
def test_collectives_and_bytes_per_step(ranks2, reduce_dtype):
    per_step, gathered_elems = ranks2.run(comm_job, reduce_dtype)[0]
    steady = per_step[-1]
    # One bucket (the whole tiny model fits in 1 MiB): one all-gather for the forward, one for the
    # first backward (the forward released everything), none for the second (deferred), and one
    # reduce-scatter per backward.
    assert steady["all_gathers"] == 2 and steady["reduce_scatters"] == 2, steady
    tag = rankcheck.TAG_NUMEL * 2  # the rank-order tag riding in each CPU gather bucket
    assert steady["gathered_bytes"] == 2 * (gathered_elems + tag) * 4
    itemsize = 2 if reduce_dtype is torch.bfloat16 else 4
    assert steady["reduced_bytes"] == 2 * gathered_elems * itemsize, "the reduce dtype is not what went over the wire"


def prefetch_job(rank, world):
    """Every unit its own bucket, so only look-ahead prefetch (not bucket-mates) issues early gathers."""
    torch.manual_seed(0)
    model = TinyTransformer(vocab=VOCAB, dim=16, depth=3, seq=SEQ)
    rt = paramfsm.shard(model, trace=True, bucket_bytes=1)
    for step in range(2):
        model(torch.randint(0, VOCAB, (2, SEQ))).pow(2).mean().backward()
    records = [r for r in rt.trace.records if r.step == 2]
    first = {}
    for r in records:
        if r.event in ("prefetch", "fetch") and r.src == "NOT_AVAILABLE":
            first.setdefault((r.param, r.graph_task), r.event)
    units = len(rt.units)
    rt.close()
    return sorted(first.values()).count("prefetch"), len(first), units


def test_prefetch_runs_ahead_of_use(ranks2):
    prefetched, gathers, units = ranks2.run(prefetch_job)[0]
    # forward and backward each gather every unit; all but each pass's first units arrive by prefetch
    assert units > 10 and prefetched >= gathers // 2 > 0, (prefetched, gathers, units)
