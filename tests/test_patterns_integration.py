"""What a training script plugs into paramfsm, on gloo ranks, compared with plain torch.

torch.optim optimizers on the shards, gradient clipping over shards, mixed
precision (bf16 gathers and compute, fp32 shards and optimizer), parameters
of different dtypes in one bucket, full state dicts loadable without
paramfsm, sharded DCP checkpoints reloaded at another world size
(2 -> 3 -> 1), and ``rt.close()``.
"""

from __future__ import annotations

import copy
import math
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from patterns_common import Pair, batch, tokens, unit_kwargs
from patterns_common import ranks2  # noqa: F401 - the fixture: every test here runs under both unit choices
from torch import nn

import paramfsm
from paramfsm import State, checkpoint
from paramfsm.testing import assert_close_dicts, rank_slice
from paramfsm.testing.models import TinyTransformer, mlp

VOCAB, SEQ = 32, 8

#: Element-wise optimizers: on a shard they do exactly what they do on the full tensor.
OPTIMIZERS = {
    "SGD-nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    "Adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    "AdamW": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "Adamax": lambda ps: torch.optim.Adamax(ps, lr=1e-2),
    "NAdam": lambda ps: torch.optim.NAdam(ps, lr=1e-2),
    "RAdam": lambda ps: torch.optim.RAdam(ps, lr=1e-2),
    "Adagrad": lambda ps: torch.optim.Adagrad(ps, lr=1e-2),
    "Adadelta": lambda ps: torch.optim.Adadelta(ps, lr=0.5),
    "RMSprop-centered": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, centered=True, momentum=0.5),
    "Rprop": lambda ps: torch.optim.Rprop(ps, lr=1e-2),
    "ASGD": lambda ps: torch.optim.ASGD(ps, lr=1e-2),
}


def optimizers_job(rank, world, names):
    errors = {}
    for name in names:
        torch.manual_seed(0)
        pair = Pair(mlp(width=7, depth=3, d_in=4, d_out=3), rank, world, make_optimizer=OPTIMIZERS[name])
        for step in range(3):
            x, = batch(step, world, 2, (4,))
            pair.zero_grad()
            pair.model(pair.local(x)).pow(2).mean().backward()
            pair.ref.model(x).pow(2).mean().backward()
            pair.step(f"{name} step {step}")
        errors[name] = pair.finish()["param_err"]
    return errors


@pytest.mark.slow  # over 5 s on two cores: make test-slow
def test_torch_optimizers_on_shards(ranks2):
    errors = ranks2.run(optimizers_job, list(OPTIMIZERS))[0]
    assert set(errors) == set(OPTIMIZERS)


def clip_job(rank, world, norm_type, max_norm):
    torch.manual_seed(0)
    pair = Pair(TinyTransformer(vocab=VOCAB, dim=16, depth=1, seq=SEQ), rank, world)
    norms = []
    for step in range(2):
        tok = tokens(step, world, 2, SEQ, VOCAB)
        pair.zero_grad()
        pair.model(pair.local(tok)).pow(2).mean().backward()
        pair.ref.model(tok).pow(2).mean().backward()
        got = pair.rt.clip_grad_norm_(max_norm, norm_type=norm_type)
        want = torch.nn.utils.clip_grad_norm_(pair.ref.model.parameters(), max_norm, norm_type=norm_type)
        assert torch.allclose(got, want, rtol=1e-5), (got, want)
        norms.append(float(want))
        pair.check_grads(f"clipped gradients at step {step}")
        pair.step(f"step {step}")
    report = pair.finish()
    report["norms"] = norms
    return report


NORM_TYPES = {"l0": 0.0, "l0.5": 0.5, "l1": 1.0, "l2": 2.0, "l3": 3.0, "inf": math.inf}


@pytest.mark.parametrize("norm_type", list(NORM_TYPES.values()), ids=list(NORM_TYPES))
def test_clip_grad_norm_over_shards(ranks2, norm_type):
    """max_norm below the total norm: the gradients are scaled down exactly as torch scales them."""
    max_norm = 0.05 if norm_type else 1.0
    report = ranks2.run(clip_job, norm_type, max_norm)[0]
    assert all(n > max_norm for n in report["norms"]), "the test must actually clip"


@pytest.mark.parametrize("norm_type", [0.0, 2.0, math.inf], ids=["l0", "l2", "inf"])
def test_clip_grad_norm_above_the_total_leaves_gradients_alone(ranks3, norm_type):
    """max_norm above the total norm (world 3, padded shards): nothing may be scaled, up or down."""
    report = ranks3.run(clip_job, norm_type, 1e6)[0]
    assert all(n < 1e6 for n in report["norms"])


def mixed_precision_job(rank, world, reduce_dtype):
    """bf16 gathers and compute, fp32 shards, gradients and optimizer, against a bf16-copy reference.

    Reference: fp32 master weights and an fp32 AdamW, as in the sharded run.
    Every step a bf16 copy of the master runs forward and backward on the
    combined batch (inputs cast to bf16, loss in fp32); its bf16 gradients
    are cast to fp32 into the master's ``.grad``. The sharded run differs
    only in how bf16 rounding falls: each rank computes its half of the
    batch and the halves are averaged in ``reduce_dtype``. bf16 keeps 8
    significant bits (a relative step of 2**-8), so gradients must agree to
    a few bf16 steps of the largest gradient: 2**-5 of it (about 3%).
    An fp32 run of the same model would pass this too, which is why the
    dtypes seen inside the forward are checked directly.
    """
    torch.manual_seed(0)
    model = mlp(width=16, depth=3, d_in=8, d_out=4)
    master = copy.deepcopy(model)
    master_opt = torch.optim.AdamW(master.parameters(), lr=1e-2)
    rt = paramfsm.shard(model, param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype, trace=True, strict=True,
                        **unit_kwargs(model))
    opt = torch.optim.AdamW(rt.shard_parameters(), lr=1e-2)
    seen = []
    model[0].register_forward_hook(lambda m, args, out: seen.append((m.weight.dtype, args[0].dtype, out.dtype)))
    worst = 0.0
    for step in range(3):
        x, = batch(step, world, 2, (8,))
        opt.zero_grad(set_to_none=True)
        master_opt.zero_grad(set_to_none=True)
        model(rank_slice(x, rank, world)).float().pow(2).mean().backward()
        low = copy.deepcopy(master).to(torch.bfloat16)
        low(x.bfloat16()).float().pow(2).mean().backward()
        for p, q in zip(master.parameters(), low.parameters()):
            p.grad = q.grad.float()
        got = {n: rt.full_grad(n) for n, _ in model.named_parameters()}
        want = {n: p.grad for n, p in master.named_parameters()}
        scale = max(g.abs().max().item() for g in want.values())
        worst = max(worst, assert_close_dicts(got, want, atol=scale * 2 ** -5, rtol=0, what=f"step {step}"))
        assert all(s.grad.dtype == torch.float32 for s in rt.shard_parameters())
        opt.step()
        master_opt.step()
        params = {n: rt.full_param(n) for n, _ in model.named_parameters()}
        assert_close_dicts(params, {n: p.detach() for n, p in master.named_parameters()}, atol=2e-2, rtol=0,
                           what=f"params after step {step}")
    assert set(seen) == {(torch.bfloat16, torch.bfloat16, torch.bfloat16)}, seen
    assert all(s.dtype == torch.float32 for s in rt.shard_parameters())
    assert all(v.dtype == torch.float32 for state in opt.state.values() for v in state.values()
               if isinstance(v, torch.Tensor) and v.dim())
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}, "empty placeholders use the compute dtype"
    assert rt.scheduler.audit.last == []
    plain = rt.close()
    assert {p.dtype for p in plain.parameters()} == {torch.float32}
    return worst


@pytest.mark.parametrize("reduce_dtype", [torch.float32, None], ids=["reduce_fp32", "reduce_bf16"])
def test_mixed_precision_bf16(ranks2, reduce_dtype):
    assert ranks2.run(mixed_precision_job, reduce_dtype)[0] > 0


class _ToFloat(nn.Module):
    def forward(self, x):
        return x.float()


def mixed_dtypes_job(rank, world, one_unit):
    """fp64 and fp32 parameters in one gather bucket (or one unit) are gathered and reduced in their own dtypes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8).double(), _ToFloat(), nn.Linear(8, 3))
    pair = Pair(model, rank, world, units=(lambda name, module: False) if one_unit else None)
    for step in range(3):
        x, = batch(step, world, 2, (4,))
        pair.zero_grad()
        pair.model(pair.local(x.double())).pow(2).mean().backward()
        pair.ref.model(x.double()).pow(2).mean().backward()
        pair.check_grads(f"step {step}")
        pair.step(f"step {step}")
    assert [s.dtype for s in pair.rt.shard_parameters()] == [torch.float64] * 2 + [torch.float32] * 2
    return pair.finish()


@pytest.mark.parametrize("one_unit", [False, True], ids=["bucketed_units", "one_unit"])
def test_parameters_of_different_dtypes(ranks2, one_unit):
    assert ranks2.run(mixed_dtypes_job, one_unit)[0]["checks"] == 6


def state_dict_and_close_job(rank, world):
    torch.manual_seed(0)
    pair = Pair(TinyTransformer(vocab=VOCAB, dim=16, depth=2, seq=SEQ, tied=True), rank, world)
    for step in range(2):
        tok = tokens(step, world, 2, SEQ, VOCAB)
        pair.zero_grad()
        pair.model(pair.local(tok)).pow(2).mean().backward()
        pair.ref.model(tok).pow(2).mean().backward()
        pair.step(f"step {step}")
    full = pair.rt.full_state_dict()
    plain = TinyTransformer(vocab=VOCAB, dim=16, depth=2, seq=SEQ, tied=True)
    plain.load_state_dict(full)
    tok = tokens(9, world, 2, SEQ, VOCAB)
    want = pair.ref.model(tok)
    assert torch.allclose(plain(tok), want, atol=1e-5)
    with torch.no_grad():
        sharded_out = pair.model(tok)
    pair.assert_states(State.NOT_AVAILABLE, what="after a no_grad forward")
    pair.finish(close=False)
    closed = pair.rt.close()
    before = pair.rt.counters
    assert closed is pair.model
    assert all(type(p) is nn.Parameter and p.shape == q.shape
               for p, q in zip(closed.parameters(), pair.ref.model.parameters()))
    with torch.no_grad():
        assert torch.equal(closed(tok), sharded_out)
    assert pair.rt.counters == before, "a closed runtime issues no collectives"
    again = paramfsm.shard(closed)
    again.load_full_state_dict(full)
    with torch.no_grad():
        assert torch.equal(closed(tok), sharded_out)
    again.close()
    return True


def test_full_state_dict_and_close(ranks2):
    assert ranks2.run(state_dict_and_close_job) == [True, True]


def _dcp_model():
    torch.manual_seed(0)
    model = TinyTransformer(vocab=VOCAB, dim=16, depth=1, seq=SEQ, tied=True)
    model.register_buffer("seen", torch.zeros(3))
    return model


def _adamw(params):
    # eps well above rounding noise: attention's key bias has a zero gradient in exact arithmetic, and
    # Adam would otherwise turn rounding noise (which differs between world sizes) into lr-sized steps
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-4)


def _train_step(model, opt, tok):
    opt.zero_grad(set_to_none=True)
    model(tok).pow(2).mean().backward()
    opt.step()
    with torch.no_grad():
        model.seen += 1


def dcp_save_job(rank, world, path):
    pair = Pair(_dcp_model(), rank, world, make_optimizer=_adamw)
    for step in range(2):
        tok = tokens(step, world, 2, SEQ, VOCAB)
        _train_step(pair.model, pair.opt, pair.local(tok))
    checkpoint.save(pair.rt, path, optimizer=pair.opt)
    full = pair.rt.full_state_dict()
    pair.finish()
    return full


def dcp_load_job(rank, world, path, saved):
    """Load at another world size: identical values, then one more step equals plain torch's third step."""
    model = _dcp_model()
    ref = copy.deepcopy(model)
    ref_opt = _adamw(ref.parameters())
    for step in range(3):
        tok = tokens(step, 2, 2, SEQ, VOCAB) if step < 2 else tokens(step, 6, 1, SEQ, VOCAB)
        ref_opt.zero_grad(set_to_none=True)
        ref(tok).pow(2).mean().backward()
        ref_opt.step()
    rt = paramfsm.shard(model, trace=True, strict=True)
    opt = _adamw(rt.shard_parameters())
    sd = rt.sharded_state_dict()
    dcp.load(sd, checkpoint_id=path)
    rt.load_sharded_state_dict(sd)
    checkpoint.load(rt, path, optimizer=opt)
    full = rt.full_state_dict()
    assert set(full) == set(saved)
    assert all(torch.equal(full[k], saved[k]) for k in saved), "reloaded values differ"
    tok = tokens(2, 6, 1, SEQ, VOCAB)  # six sequences: an even share on 1, 2 or 3 ranks
    opt.zero_grad(set_to_none=True)
    model(rank_slice(tok, rank, world)).pow(2).mean().backward()
    opt.step()
    assert_close_dicts({n: rt.full_param(n) for n, _ in model.named_parameters()},
                       {n: p.detach() for n, p in ref.named_parameters()}, atol=1e-5,
                       what=f"step after reloading on {world} rank(s)")
    assert rt.scheduler.audit.last == []
    rt.close()
    return True


@pytest.mark.slow  # over 5 s on two cores: make test-slow
def test_sharded_checkpoint_changes_world_size(ranks2, ranks3, ranks1, tmp_path):
    path = str(tmp_path / "ckpt")
    saved = ranks2.run(dcp_save_job, path)[0]
    assert saved["seen"].tolist() == [2.0, 2.0, 2.0]
    assert ranks3.run(dcp_load_job, path, saved) == [True] * 3
    assert ranks1.run(dcp_load_job, path, saved) == [True]
    assert ranks1.run(broken_load_job, path, saved) == [True]


def broken_load_job(rank, world, path, saved):
    """A checkpoint missing a data file is refused before anything is written: the model is unchanged and
    runs, and a good checkpoint then loads."""
    broken = Path(path + "-incomplete")
    shutil.copytree(path, broken)
    max(broken.glob("*.distcp")).unlink()  # the file of the last rank that saved
    model = _dcp_model()
    rt = paramfsm.shard(model)
    tok = tokens(0, 1, 2, SEQ, VOCAB)
    before = rt.full_state_dict()
    with pytest.raises(paramfsm.ParamFSMError, match="is missing"):
        checkpoint.load(rt, broken)
    assert all(torch.equal(v, before[k]) for k, v in rt.full_state_dict().items()), "a refused load wrote"
    model(tok)
    checkpoint.load(rt, path)
    full = rt.full_state_dict()
    assert all(torch.equal(full[k], saved[k]) for k in saved), "the second load left other values"
    model(tok).sum().backward()
    rt.close()
    return True
