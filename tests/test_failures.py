"""Failing well: every misuse ends in an error that says what happened and what to do.

A parameter used while not gathered, ranks issuing collectives in different
orders, an exception inside forward or backward (the next iteration must
work, compared with plain torch), and models paramfsm cannot partition.
"""

from __future__ import annotations

import copy
import io
import time
import warnings

import pytest
import torch
from patterns_common import Pair, batch, tokens
from torch import nn

import paramfsm
from paramfsm import NotGathered, RankDesync, State
from paramfsm.testing.models import TinyTransformer, mlp


@pytest.fixture(scope="module")
def ranks2(in_process2):
    """This file's two ranks are threads of the test process (``gloo_ranks.py``), where ``make mutate`` sees
    them; a test that needs processes of its own asks for ``suite_ranks2``."""
    return in_process2


VOCAB, SEQ = 32, 8


def _messages(fn) -> str:
    try:
        fn()
    except NotGathered as exc:
        return str(exc)
    raise AssertionError("no NotGathered raised")


def not_gathered_job(rank, world):
    torch.manual_seed(0)
    pair = Pair(mlp(width=8, depth=3, d_in=4, d_out=3), rank, world)
    model = pair.model
    x, = batch(0, world, 2, (4,))
    pair.zero_grad()
    model(pair.local(x)).pow(2).mean().backward()
    pair.ref.model(x).pow(2).mean().backward()
    pair.step("step 0")
    weight = model[0].weight
    messages = {
        "arithmetic": _messages(lambda: weight.sum()),
        "matmul": _messages(lambda: x @ weight.T),
        "state_dict": _messages(lambda: model.state_dict()),
        "functional": _messages(lambda: torch.nn.functional.linear(x, weight)),
        "save": _messages(lambda: torch.save(dict(model.named_parameters()), io.BytesIO())),
    }
    try:  # a dtype conversion is refused before anything converts (tests/test_atomic_refusals.py)
        model.to(torch.float64)
    except paramfsm.errors.ConversionRefused as exc:
        assert "'0.weight'" in str(exc) and f"rank {rank}" in str(exc), str(exc)
    else:
        raise AssertionError("model.to(torch.float64) was not refused")
    # metadata stays readable (and logical, like a DTensor's), and nothing was gathered by the failed uses
    assert weight.requires_grad and weight.shape == (8, 4) and weight.numel() == 32
    pair.assert_states(State.NOT_AVAILABLE, what="after the failed uses")
    # legitimate access: a full copy, or the parameter in place while held
    ref_weight = pair.ref.model[0].weight.detach()
    assert torch.allclose(pair.rt.full_param("0.weight"), ref_weight, atol=1e-6)
    with pair.rt.gathered(model[0]):
        assert pair.rt.state("0.weight") is State.AVAILABLE
        assert torch.allclose(weight.detach().clone(), ref_weight, atol=1e-6)
        assert pair.rt.state("2.weight") is State.NOT_AVAILABLE
    pair.assert_states(State.NOT_AVAILABLE, what="after rt.gathered")
    pair.finish()
    return messages


def test_use_of_a_parameter_that_is_not_gathered(ranks2):
    messages = ranks2.run(not_gathered_job)[0]
    for what, message in messages.items():
        assert "'0.weight'" in message and "not gathered on rank 0" in message, (what, message)
        assert "rt.full_param('0.weight')" in message and "rt.gathered" in message, (what, message)


class CrossUnit(nn.Module):
    """A module that reads another unit's weight directly in its forward (outside that unit)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.out = nn.Linear(8, 4)

    def forward(self, tok):
        h = self.out(self.embed(tok))
        return h @ self.embed.weight[:4]


def cross_unit_job(rank, world):
    torch.manual_seed(0)
    model = CrossUnit()
    want = copy.deepcopy(model)(torch.zeros(2, 3, dtype=torch.long))
    paramfsm.shard(model, units=[nn.Embedding, nn.Linear])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = model(torch.zeros(2, 3, dtype=torch.long))
    try:
        model.embed.weight[:4].sum()
    except NotGathered as exc:
        outside = str(exc)
    return torch.allclose(got, want), [str(w.message) for w in caught], outside


# Spawned ranks: the job records warnings, and warnings.catch_warnings is the process's.
def test_another_units_parameter_inside_forward(suite_ranks2):
    """Read inside the root's forward, the embedding's weight is gathered on demand, with a warning that
    names it and the units= to pass; read outside any forward it is still NotGathered, naming it."""
    same, told, outside = suite_ranks2.run(cross_unit_job)[0]
    assert same
    assert len(told) == 1 and "'embed.weight'" in told[0] and "units=" in told[0], told
    assert "'embed.weight'" in outside and "not gathered" in outside, outside


def generation_job(rank, world):
    """A generation loop under no_grad inside rt.gathered(model): no gather per token, same tokens."""
    torch.manual_seed(0)
    pair = Pair(TinyTransformer(vocab=VOCAB, dim=16, depth=2, seq=SEQ), rank, world)
    model, ref = pair.model, pair.ref.model
    prompt = tokens(0, world, 2, 2, VOCAB)
    seq, ref_seq = pair.local(prompt), prompt
    with torch.no_grad(), pair.rt.gathered(model):
        pair.assert_states(State.AVAILABLE, what="inside rt.gathered")
        before = pair.rt.counters["all_gathers"]
        for _ in range(SEQ - 2):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], 1)
            ref_seq = torch.cat([ref_seq, ref(ref_seq)[:, -1].argmax(-1, keepdim=True)], 1)
        during = pair.rt.counters["all_gathers"] - before
    pair.assert_states(State.NOT_AVAILABLE, what="after rt.gathered")
    assert torch.equal(seq, pair.local(ref_seq))
    pair.zero_grad()
    model(seq).pow(2).mean().backward()
    ref(ref_seq).pow(2).mean().backward()
    pair.check_grads("training after generation")
    pair.finish()
    return during


def test_generation_loop_inside_gathered(ranks2):
    assert ranks2.run(generation_job) == [0, 0]


class Twins(nn.Module):
    """Two blocks of identical shapes; ``order`` decides which runs first."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)
        self.extra = nn.Linear(8, 8)

    def forward(self, x, order: str):
        if order == "swap":
            return self.first(self.second(x))
        if order == "extra":
            return self.second(self.extra(self.first(x)))
        return self.second(self.first(x))


def desync_job(rank, world, rank0_order, debug):
    torch.manual_seed(0)
    model = Twins()
    rt = paramfsm.shard(model, bucket_bytes=0, debug=debug)
    x = torch.randn(2, 8)
    model(x, "plain").sum().backward()
    start = time.monotonic()
    try:
        model(x, rank0_order if rank == 0 else "plain").sum().backward()
    except RankDesync as exc:
        return str(exc), exc.rank, exc.unit, exc.step, time.monotonic() - start
    return "no error", None, None, None, time.monotonic() - start


@pytest.mark.parametrize("rank0_order,debug", [("swap", False), ("swap", True), ("extra", True)],
                         ids=["same_size_tag", "same_size_header", "extra_branch_header"])
def test_ranks_in_different_orders_raise_rank_desync(ranks2, rank0_order, debug):
    results = ranks2.run(desync_job, rank0_order, debug, timeout=60)
    for rank, (message, err_rank, unit, step, elapsed) in enumerate(results):
        assert err_rank == rank, message
        assert step == 2 and f"at step 2, unit '{unit}'" in message, message
        assert "ranks [0, 1]" in message and "rank 0:" in message and "rank 1:" in message, message
        assert elapsed < 10, elapsed
    assert results[0][2] != results[1][2] or rank0_order == "extra"


class Flaky(nn.Module):
    """An MLP whose forward or backward raises when told to."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.fail = None

    def forward(self, x):
        x = torch.tanh(self.a(x))
        if self.fail == "forward":
            raise RuntimeError("failure inside forward")
        if self.fail == "backward":
            x = _FailInBackward.apply(x)
        return self.c(torch.tanh(self.b(x)))


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("failure inside backward")


def exception_job(rank, world, where, retain):
    torch.manual_seed(0)
    pair = Pair(Flaky(), rank, world, retain=retain, bucket_bytes=0)
    model, ref = pair.model, pair.ref.model
    x, = batch(0, world, 2, (4,))
    pair.zero_grad()
    model(pair.local(x)).pow(2).mean().backward()
    ref(x).pow(2).mean().backward()
    pair.step("before the failure")
    model.fail = where
    with pytest.raises(RuntimeError, match=f"failure inside {where}"):
        out = model(pair.local(x))
        out.pow(2).mean().backward(retain_graph=True)
    model.fail = None
    left = {n: s for n, s in pair.rt.states().items() if s is not State.NOT_AVAILABLE}
    pair.zero_grad()
    for step in range(2):
        x, = batch(step + 1, world, 2, (4,))
        model(pair.local(x)).pow(2).mean().backward()
        ref(x).pow(2).mean().backward()
        pair.assert_states(State.NOT_AVAILABLE, what=f"iteration {step} after the failure")
        pair.check_grads(f"iteration {step} after the failure")
        pair.step(f"iteration {step} after the failure")
        pair.zero_grad()
    pair.finish()
    return left


@pytest.mark.parametrize("retain", ["defer", "regather"])
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_exception_inside_forward_or_backward(ranks2, where, retain):
    left = ranks2.run(exception_job, where, retain)[0]
    assert left, "the failure should have interrupted a pass (otherwise the test tests nothing)"


def unsupported_job(rank, world):
    messages = {}
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(2, 2))
    meta.append(nn.Linear(2, 2))  # partly on the meta device
    for what, build in [("meta", lambda: meta),
                        ("integer", lambda: _with_int_param()),
                        ("sharded twice", lambda: _sharded_model()),
                        ("sharded parent", lambda: nn.Sequential(_sharded_model(), nn.Linear(2, 2)))]:
        try:
            paramfsm.shard(build())
            messages[what] = "no error"
        except paramfsm.ParamFSMError as exc:
            messages[what] = str(exc)
    return messages


def _with_int_param():
    model = nn.Linear(2, 2)
    model.steps = nn.Parameter(torch.zeros(3, dtype=torch.long), requires_grad=False)
    return model


_KEEP = []


def _sharded_model():
    model = nn.Linear(2, 2)
    _KEEP.append(paramfsm.shard(model))
    return model


def test_unsupported_models(ranks2):
    messages = ranks2.run(unsupported_job)[0]
    assert "'0.weight' is on the meta device but '1.weight' on cpu" in messages["meta"], messages["meta"]
    assert "'steps' has dtype torch.int64" in messages["integer"] and "buffers" in messages["integer"]
    assert "already sharded" in messages["sharded twice"] and "rt.close()" in messages["sharded twice"]
    assert "'0.weight' is already partitioned" in messages["sharded parent"], messages["sharded parent"]
