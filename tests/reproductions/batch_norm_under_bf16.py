"""A failing training loop found by `paramfsm verify`.

paramfsm #53: a frozen batch norm under param_dtype=bfloat16 (rendered from verify's canonical loop)

Run it with `torchrun --nproc-per-node 2 THIS_FILE`. Every op runs inside `with check(op):`, which
runs the op on an unsharded plain-torch copy of the model first and then checks paramfsm against it
(gradients, parameters, states, communication), as `paramfsm verify` does. The script prints the
failed check and exits 1 while the bug is present, and exits 0 once it is fixed.
"""
import sys
from math import inf

import torch
from torch.utils.checkpoint import checkpoint

import paramfsm
import paramfsm.checkpoint
from paramfsm.verify.checker import Checker
from paramfsm.verify.programs import Backward, Checkpoint, Clip, Config, Drop, Forward, FullState, Loss, RequiresGrad, Step, ZeroGrad
from paramfsm.verify.reproduction import run_reproduction
from paramfsm.verify.subject import load_subject
from paramfsm.verify.loop_helpers import perturbed
from paramfsm.verify.user_loops import optimizers

FAULT = None  # the catalogued bug the verify run injected (paramfsm.verify.faults), if any


def main(rank, world):
    torch.manual_seed(0)
    subject = load_subject('paramfsm.testing.subjects:frozen_norm_mlp')
    model, make_batch, loss_fn = subject.model, subject.make_batch, subject.loss_fn
    config = Config(retain='defer', prefetch=1, bucket_bytes=8388608, max_deferred_bytes=None, param_dtype='bfloat16', reshard_after_forward=True, offload=None, units='default', optimizer='subject', step_hooks=False, zero_grad_to_none=True, clip_plain=False, refused_shard=False, compiled=False)
    check = Checker(subject, config, seed=0, per_rank=2)  # plain torch, verify's checks
    rt = paramfsm.shard(model, units=subject.units, min_unit_bytes=subject.min_unit_bytes, retain='defer',
                        prefetch=1, bucket_bytes=8388608,
                        max_deferred_bytes=None, trace=True, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    check.attach(rt)
    opt, = optimizers(subject, model, rt.shard_parameters(), config)  # built as config says

    def batch(i):
        """This rank's share of global batch i (identical data on every rank)."""
        inputs, targets = make_batch(torch.Generator().manual_seed(0 * 1000 + i), world * 2)
        share = lambda t: t.chunk(world)[rank] if isinstance(t, torch.Tensor) else type(t)(map(share, t))
        return share(inputs), share(targets)

    with check(RequiresGrad(param='inp.bias', flag=False)):
        model.get_parameter('inp.bias').requires_grad_(False)
    with check(Forward(out=0, batch=0, mode='train')):
        x0, y0 = batch(0)
        out0 = model(x0)
    with check(Loss(loss=0, out=0, batch=0, variant=1)):
        loss0 = out0.float().pow(2).mean()
        check.same(loss0)  # plain torch's value
    with check(Backward(loss=0, retain=True, via_runtime=True)):
        rt.backward(loss0, retain_graph=True)
    with check(Backward(loss=0, retain=False, via_runtime=True)):
        rt.backward(loss0)
    with check(Clip(max_norm=1.0, norm_type=inf)):
        total = rt.clip_grad_norm_(1.0, norm_type=inf)
        check.clipped(total)  # the total norm is plain torch's
    with check(Step()):
        opt.step()
    with check(Drop(out=0, losses=(0,))):
        del out0, loss0
    with check(RequiresGrad(param='inp.bias', flag=True)):
        model.get_parameter('inp.bias').requires_grad_(True)
    with check(Checkpoint()):
        path = check.scratch_dir()  # one folder for every rank
        paramfsm.checkpoint.save(rt, path)
        check.sharded(rt.sharded_state_dict())  # each value holds this rank's Shard(0) range
        rt.load_full_state_dict(perturbed(rt.full_state_dict()))
        paramfsm.checkpoint.load(rt, path)
    with check(FullState(perturb=True)):
        sd = rt.full_state_dict()
        check.full_state(sd)  # the reference's state dict
        rt.load_full_state_dict(perturbed(sd))
        del sd
    with check(ZeroGrad()):
        opt.zero_grad(set_to_none=config.zero_grad_to_none)
    with check(Forward(out=1, batch=2, mode='train')):
        x2, y2 = batch(2)
        out1 = model(x2)
    with check(Loss(loss=1, out=1, batch=2, variant=0)):
        loss1 = loss_fn(out1.float(), y2)
        check.same(loss1)  # plain torch's value
    with check(Backward(loss=1, retain=False, via_runtime=False)):
        loss1.backward()
    with check(Drop(out=1, losses=(1,))):
        del out1, loss1
    with check(Step()):
        opt.step()
    check.finish()


if __name__ == "__main__":
    sys.exit(run_reproduction(main, fault=FAULT))
