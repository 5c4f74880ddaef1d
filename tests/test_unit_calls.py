"""Units called from the training loop itself (not only through the root), on 2 gloo ranks, against plain torch.

A GAN loop, feature reuse and evaluation call submodules directly on activations
saved from an earlier forward. Each case here once failed or held memory:
a backward reaching the root's own parameter through a saved activation, a
unit kept gathered after its output was dropped, a checkpoint whose optimizer
state was saved before every parameter had some.
"""

from __future__ import annotations

import copy
import gc
import tempfile

import torch
import torch.distributed as dist
from torch import nn

import paramfsm
import paramfsm.checkpoint as ck
from paramfsm import State
from paramfsm.testing import assert_close_dicts, rank_slice, sharded_grads


class WithPosition(nn.Module):
    """The root owns ``pos`` and adds it between two child units, as a transformer adds its positions."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 6)
        self.b = nn.Linear(6, 3)
        self.pos = nn.Parameter(torch.randn(6))

    def forward(self, x):
        return self.b(self.a(x) + self.pos)


def _saved_input_reaches_the_root(rank, world):
    torch.manual_seed(0)
    model = WithPosition()
    ref = copy.deepcopy(model)
    rt = paramfsm.shard(model)
    x = torch.randn(world * 2, 4, generator=torch.Generator().manual_seed(1))
    saved = {}
    hook = model.b.register_forward_pre_hook(lambda module, args: saved.setdefault("b", args[0]))
    model(rank_slice(x, rank, world))
    hook.remove()
    model.b(saved["b"]).pow(2).mean().backward()  # reaches pos and a through the saved input alone
    ref.b(ref.a(x) + ref.pos).pow(2).mean().backward()
    assert_close_dicts(sharded_grads(rt, model), {n: p.grad for n, p in ref.named_parameters()}, what="grads")
    return rt.states()


def test_a_backward_through_a_saved_activation_gathers_the_root(ranks2):
    for states in ranks2.run(_saved_input_reaches_the_root):
        assert set(states.values()) == {State.NOT_AVAILABLE}


class Pair(nn.Module):
    def __init__(self):
        super().__init__()
        self.gen = nn.Sequential(nn.Linear(5, 4), nn.Tanh())
        self.disc = nn.Sequential(nn.Linear(4, 1))

    def forward(self, z):
        return self.disc(self.gen(z))


def _direct_calls_release(rank, world):
    torch.manual_seed(0)
    out = {}
    model = Pair()
    rt = paramfsm.shard(model, units=[nn.Sequential], reshard_after_forward=False)
    score = model.disc(model.gen(torch.randn(2, 5)).detach())
    out["kept while the output lives"] = rt.state("disc.0.weight")
    del score
    gc.collect()
    out["released with the output"] = rt.state("disc.0.weight")
    rt.close()

    model = Pair()
    rt = paramfsm.shard(model, units=[nn.Sequential])
    fake = model.gen(torch.randn(2, 5))
    rt.backward(model.disc(fake).mean(), retain_graph=True)
    out["deferred for the retained graph"] = rt.state("gen.0.weight")
    del fake
    gc.collect()
    out["flushed with the graph"] = rt.state("gen.0.weight")
    return out


def test_units_called_directly_let_go_with_their_graph(ranks2):
    for out in ranks2.run(_direct_calls_release):
        assert out == {"kept while the output lives": State.AVAILABLE,
                       "released with the output": State.NOT_AVAILABLE,
                       "deferred for the retained graph": State.DEFERRED_RELEASE,
                       "flushed with the graph": State.NOT_AVAILABLE}


def _checkpoint_before_all_state(rank, world):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    ref = copy.deepcopy(model)
    rt = paramfsm.shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(world * 2, 4, generator=torch.Generator().manual_seed(2))
    for net in (model, ref):
        net[1].weight.requires_grad_(False)  # no gradient, so no momentum buffer, when saved
    model(rank_slice(x, rank, world)).pow(2).mean().backward()
    ref(x).pow(2).mean().backward()
    opt.step()
    ref_opt.step()
    path = [tempfile.mkdtemp() if rank == 0 else None]
    dist.broadcast_object_list(path)
    ck.save(rt, path[0], optimizer=opt)
    saved_ref = copy.deepcopy(ref_opt.state_dict())
    saved_params = copy.deepcopy(ref.state_dict())
    for net, optimizer in ((model, opt), (ref, ref_opt)):
        net[1].weight.requires_grad_(True)
        optimizer.zero_grad()
    model(rank_slice(x, rank, world)).pow(2).mean().backward()
    ref(x).pow(2).mean().backward()
    opt.step()
    ref_opt.step()
    ck.load(rt, path[0], optimizer=opt)
    ref.load_state_dict(saved_params)
    ref_opt.load_state_dict(saved_ref)
    for optimizer in (opt, ref_opt):
        optimizer.zero_grad()
    model(rank_slice(x, rank, world)).pow(2).mean().backward()
    ref(x).pow(2).mean().backward()
    opt.step()
    ref_opt.step()
    full = rt.full_state_dict()
    assert_close_dicts(full, ref.state_dict(), what="after the load and a step")
    return len(opt.state), len(ref_opt.state)


def test_a_checkpoint_saved_before_every_parameter_had_optimizer_state_loads(ranks2):
    for ours, plain in ranks2.run(_checkpoint_before_all_state):
        assert ours == plain
