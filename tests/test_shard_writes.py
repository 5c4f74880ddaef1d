"""Shard writes and model changes on 2 gloo ranks, against plain torch over the global batch or the named error.

Each case here once gave a silent wrong result: a GAN-style loop computing with
the weights from before the optimizer step (a deferred copy reused), writes
inside ``rt.gathered()`` thrown away, a parameter replaced after ``shard()``
trained by each rank alone.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import paramfsm
from paramfsm import IllegalTransition, ModelChanged, NotGathered, ParamFSMError, State
from paramfsm.testing import assert_close_dicts, rank_slice, sharded_params


@pytest.fixture(scope="module")
def ranks2(in_process2):
    """This file's two ranks are threads of the test process (``gloo_ranks.py``), where ``make mutate`` sees
    them; a test that needs processes of its own asks for ``suite_ranks2``."""
    return in_process2


PER_RANK = 2


class Pair(nn.Module):
    """Two units called one by one from the loop: ``a`` (a generator) and ``b`` (a discriminator)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return self.b(self.a(x))


def _pair():
    torch.manual_seed(0)
    return Pair()


def _batch(world, step=0):
    return torch.randn(world * PER_RANK, 4, generator=torch.Generator().manual_seed(10 + step))


def _stale_after_step(rank, world):
    """A retained backward leaves ``b`` deferred, the step changes it, a new forward of ``b`` reads it."""
    model = _pair()
    ref = copy.deepcopy(model)
    rt = paramfsm.shard(model)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    x = _batch(world)
    h = model.a(rank_slice(x, rank, world))
    l1 = model.b(h).pow(2).mean()
    l1.backward(retain_graph=True)  # l1's graph lives on, so b stays deferred for it
    deferred = rt.state("b.weight")
    opt.step()
    after_step = rt.state("b.weight")
    l2 = model.b(h).pow(2).mean()
    l2.backward()
    opt.step()
    del l1

    ref_h = ref.a(x)
    ref.b(ref_h).pow(2).mean().backward(retain_graph=True)
    ref_opt.step()
    ref_l2 = ref.b(rank_slice(ref_h, rank, world)).pow(2).mean()
    ref.b(ref_h).pow(2).mean().backward()
    ref_opt.step()
    assert_close_dicts(sharded_params(rt, model), dict(ref.named_parameters()), what="parameters")
    return deferred, after_step, l2.item(), ref_l2.item()


def test_a_forward_after_a_step_reads_the_stepped_weights(ranks2):
    for deferred, after_step, got, want in ranks2.run(_stale_after_step):
        assert deferred is State.DEFERRED_RELEASE and after_step is State.NOT_AVAILABLE
        assert got == pytest.approx(want, rel=1e-6, abs=1e-7)


def _backward_after_step(rank, world):
    """A graph recorded before a step needs the weights the step changed: autograd refuses, as in plain torch."""
    out = []
    for shard in (False, True):
        model = _pair()
        rt = paramfsm.shard(model) if shard else None
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        x = rank_slice(_batch(world), rank, world)
        model(x).sum().backward()
        loss = model(x).pow(2).sum()
        opt.step()
        try:
            loss.backward()
            out.append("no error")
        except RuntimeError as err:
            out.append("modified by an inplace operation" in str(err))
        if rt is not None:
            rt.reset()
    return out


def test_a_backward_over_a_graph_older_than_the_step_fails_as_in_plain_torch(ranks2):
    assert ranks2.run(_backward_after_step) == [[True, True]] * 2


def _step_inside_gathered(rank, world):
    model = _pair()
    rt = paramfsm.shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model(rank_slice(_batch(world), rank, world)).sum().backward()
    before = rt.full_param("a.weight")
    with rt.gathered(model.a, writeback=False):
        try:
            opt.step()
            message = ""
        except IllegalTransition as err:
            message = str(err)
    assert torch.equal(rt.full_param("a.weight"), before), "the refused step changed the shards"
    opt.step()  # outside the block it steps
    return message, torch.equal(rt.full_param("a.weight"), before)


def test_a_step_inside_gathered_is_refused_before_it_writes(ranks2):
    for rank, (message, unchanged) in enumerate(ranks2.run(_step_inside_gathered)):
        for fact in ("'a.weight'", "'a'", "AVAILABLE", "shard_written", f"rank {rank}", "SGD.step()",
                     "What to do: leave `with rt.gathered(...)`"):
            assert fact in message, (fact, message)
        assert not unchanged


def _kept_unit_then_step(rank, world):
    """reshard_after_forward=False keeps ``b`` gathered for its backward; a step then a submodule forward."""
    model = _pair()
    ref = copy.deepcopy(model)
    rt = paramfsm.shard(model, reshard_after_forward=False)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(ref.parameters(), lr=0.5)
    x = _batch(world)
    model(rank_slice(x, rank, world)).pow(2).mean().backward()
    ref(x).pow(2).mean().backward()
    h = model.a(rank_slice(x, rank, world)).detach()
    ref_h = rank_slice(ref.a(x), rank, world).detach()
    kept = model.b(h)  # b's forward hold is kept for a backward that never comes
    opt.step()
    ref_opt.step()
    got = model.b(h).sum().item()
    del kept
    return got, ref.b(ref_h).sum().item()


def test_a_unit_kept_for_backward_is_refreshed_by_a_step(ranks2):
    for got, want in ranks2.run(_kept_unit_then_step):
        assert got == pytest.approx(want, rel=1e-6, abs=1e-6)


def _writeback(rank, world):
    model = _pair()
    ref = copy.deepcopy(model)
    rt = paramfsm.shard(model)
    with torch.no_grad(), rt.gathered():
        model.a.weight.mul_(0.5)
        model.b.bias.data = torch.arange(4.0)
    with torch.no_grad():
        ref.a.weight.mul_(0.5)
        ref.b.bias.copy_(torch.arange(4.0))
    assert_close_dicts(sharded_params(rt, model), dict(ref.named_parameters()), atol=0, rtol=0, what="written")
    with torch.no_grad(), rt.gathered(model.a, writeback=False):
        model.a.weight.zero_()  # read-only block: dropped at its end
    assert_close_dicts(sharded_params(rt, model), dict(ref.named_parameters()), atol=0, rtol=0, what="read-only")
    # then it trains like plain torch from the written values
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    x = _batch(world, 1)
    model(rank_slice(x, rank, world)).pow(2).mean().backward()
    ref(x).pow(2).mean().backward()
    opt.step()
    ref_opt.step()
    assert_close_dicts(sharded_params(rt, model), dict(ref.named_parameters()), what="trained")
    return rt.states()


def test_writes_inside_gathered_reach_the_shards(ranks2):
    for states in ranks2.run(_writeback):
        assert set(states.values()) == {State.NOT_AVAILABLE}


def _writeback_refusals(rank, world):
    model = _pair()
    rt = paramfsm.shard(model)
    before = sharded_params(rt, model)
    out = {}
    for case in ("different values", "one rank", "shape"):
        try:
            with torch.no_grad(), rt.gathered():
                if case == "different values":
                    model.a.weight.fill_(float(rank))
                elif case == "one rank" and rank == 1:
                    model.b.weight.add_(1.0)
                elif case == "shape":
                    model.b.bias.data = torch.zeros(5)
            out[case] = ""
        except ParamFSMError as err:
            out[case] = str(err)
    assert_close_dicts(sharded_params(rt, model), before, atol=0, rtol=0, what="nothing written back")
    model.a.weight.grad = None
    model(rank_slice(_batch(world), rank, world)).sum().backward()
    with torch.no_grad(), rt.gathered():
        model.a.weight.grad.zero_()  # the shard gradient, as outside the block
        try:
            model.a.weight.grad.sum()
            out["grad read"] = ""
        except NotGathered as err:
            out["grad read"] = str(err)
    out["grad zeroed"] = bool((rt.full_grad("a.weight") == 0).all())
    return out


def test_writeback_refuses_what_cannot_be_the_same_on_every_rank(ranks2):
    for rank, out in enumerate(ranks2.run(_writeback_refusals)):
        assert "parameter 'a.weight' (unit 'a'" in out["different values"]
        assert "cannot be written back: the ranks wrote different values (rank 0 changed it, rank 1 changed it)" \
            in out["different values"]
        assert "parameter 'b.weight'" in out["one rank"] and \
            "only some ranks wrote it (rank 0 left it unchanged, rank 1 changed it)" in out["one rank"]
        assert "parameter 'b.bias'" in out["shape"] and "shape (5,)" in out["shape"]
        for message in (out["different values"], out["one rank"], out["shape"]):
            assert message.startswith(f"rt.gathered(writeback=True) on rank {rank}: parameter '"), message
            assert message.endswith(
                "Nothing was written back. What to do: make the same in-place change on every rank (seed random "
                "writes alike, or broadcast the values first), keep the parameter's shape and dtype, or use "
                "rt.gathered(writeback=False) for read-only access."), message
        assert "rt.full_grad" in out["grad read"]
        assert out["grad zeroed"]


def _changed_after_shard(rank, world):
    out = {}
    for case in ("replaced", "added", "attached", "deleted", "submodule"):
        model = _pair()
        rt = paramfsm.shard(model)
        if case == "replaced":
            model.a.weight = nn.Parameter(torch.ones(4, 4))
        elif case == "added":
            model.gain = nn.Parameter(torch.ones(4))
        elif case == "attached":
            model.head = nn.Linear(4, 2)
        elif case == "deleted":
            del model.b.bias
        else:
            model.b.weight = nn.Parameter(torch.ones(4, 4))
        try:
            x = rank_slice(_batch(world), rank, world)
            (model.b(x) if case == "submodule" else model(x)).sum().backward()
            out[case] = ""
        except ModelChanged as err:
            out[case] = str(err)
        rt.detach()
    return out


def _global_hooks_after_a_refused_change(rank, world):
    from torch.nn.modules import module as torch_module

    before = len(torch_module._global_forward_pre_hooks)
    model = _pair()
    rt = paramfsm.shard(model)
    model.gain = nn.Parameter(torch.ones(4))
    armed = len(torch_module._global_forward_pre_hooks)
    with pytest.raises(ModelChanged):
        model(rank_slice(_batch(world), rank, world))
    rt.detach()
    return before, armed, len(torch_module._global_forward_pre_hooks)


def test_a_refused_change_leaves_no_global_module_hook_once_its_runtime_is_gone(ranks2):
    """The hook that refuses a changed model's forward runs for every module of the process (and makes
    ``torch.compile`` warn): it goes once no runtime has a change left to refuse."""
    for before, armed, after in ranks2.run(_global_hooks_after_a_refused_change):
        assert armed == before + 1 and after == before, (before, armed, after)


def test_a_parameter_changed_after_shard_is_refused_at_the_next_forward(ranks2):
    for rank, out in enumerate(ranks2.run(_changed_after_shard)):
        assert "parameter 'a.weight' (module 'a') was added or replaced" in out["replaced"]
        assert "parameter 'gain' (module '<root>') was added or replaced" in out["added"]
        assert "parameter 'head.weight'" in out["attached"] and "attached after paramfsm.shard()" in out["attached"]
        assert "parameter 'b.bias' (module 'b') was deleted" in out["deleted"]
        assert "parameter 'b.weight'" in out["submodule"]
        for case in ("replaced", "added", "attached", "deleted", "submodule"):
            assert f"on rank {rank}" in out[case] and "model = rt.close()" in out[case], out[case]
