"""A failing training loop found by `paramfsm verify`.

paramfsm #53: an eval forward of compiled blocks between backward and step (rendered from verify's canonical loop)

Run it with `torchrun --nproc-per-node 2 THIS_FILE`. Every op runs inside `with check(op):`, which
runs the op on an unsharded plain-torch copy of the model first and then checks paramfsm against it
(gradients, parameters, states, communication), as `paramfsm verify` does. The script prints the
failed check and exits 1 while the bug is present, and exits 0 once it is fixed.
"""
import sys

import torch
from torch.utils.checkpoint import checkpoint

import paramfsm
from paramfsm.verify.checker import Checker
from paramfsm.verify.programs import Backward, Config, Drop, Evaluate, Forward, Loss, Step, ZeroGrad
from paramfsm.verify.reproduction import run_reproduction
from paramfsm.verify.subject import load_subject
from paramfsm.verify.compiled_blocks import compile_blocks
from paramfsm.verify.user_loops import optimizers

FAULT = None  # the catalogued bug the verify run injected (paramfsm.verify.faults), if any


def main(rank, world):
    torch.manual_seed(0)
    subject = load_subject('paramfsm.testing.subjects:branchy_lm')
    model, make_batch, loss_fn = subject.model, subject.make_batch, subject.loss_fn
    config = Config(retain='defer', prefetch=1, bucket_bytes=8388608, max_deferred_bytes=None, param_dtype=None, reshard_after_forward=True, offload=None, units='default', optimizer='subject', step_hooks=False, zero_grad_to_none=True, clip_plain=False, refused_shard=False, compiled=True)
    check = Checker(subject, config, seed=0, per_rank=2)  # plain torch, verify's checks
    rt = paramfsm.shard(model, units=subject.units, min_unit_bytes=subject.min_unit_bytes, retain='defer',
                        prefetch=1, bucket_bytes=8388608,
                        max_deferred_bytes=None, trace=True)
    compile_blocks(model, check.blocks)  # each block's forward torch.compile'd (aot_eager)
    check.attach(rt)
    opt, = optimizers(subject, model, rt.shard_parameters(), config)  # built as config says

    def batch(i):
        """This rank's share of global batch i (identical data on every rank)."""
        inputs, targets = make_batch(torch.Generator().manual_seed(0 * 1000 + i), world * 2)
        share = lambda t: t.chunk(world)[rank] if isinstance(t, torch.Tensor) else type(t)(map(share, t))
        return share(inputs), share(targets)

    with check(ZeroGrad()):
        opt.zero_grad(set_to_none=config.zero_grad_to_none)
    with check(Forward(out=0, batch=0, mode='train')):
        x0, y0 = batch(0)
        out0 = model(x0)
    with check(Loss(loss=0, out=0, batch=0, variant=0)):
        loss0 = loss_fn(out0, y0)
        check.same(loss0)  # plain torch's value
    with check(Backward(loss=0, retain=False, via_runtime=False)):
        loss0.backward()
    with check(Drop(out=0, losses=(0,))):
        del out0, loss0
    with check(Step()):
        opt.step()
    with check(Forward(out=1, batch=1, mode='train')):
        x1, y1 = batch(1)
        out1 = model(x1)
    with check(Loss(loss=1, out=1, batch=1, variant=1)):
        loss1 = out1.float().pow(2).mean()
        check.same(loss1)  # plain torch's value
    with check(Backward(loss=1, retain=False, via_runtime=True)):
        rt.backward(loss1)
    with check(Evaluate(batches=(2, 3), inference=False)):
        x2, y2 = batch(2)
        x3, y3 = batch(3)
        model.eval()
        with torch.no_grad():
            outs = [model(x2), model(x3)]
        model.train()
        check.same(outs)  # plain torch's outputs
        del outs
    with check(Step()):
        opt.step()
    with check(ZeroGrad()):
        opt.zero_grad(set_to_none=config.zero_grad_to_none)
    with check(Forward(out=2, batch=3, mode='train')):
        out2 = model(x3)
    with check(Loss(loss=2, out=2, batch=3, variant=0)):
        loss2 = loss_fn(out2, y3)
        check.same(loss2)  # plain torch's value
    with check(Backward(loss=2, retain=False, via_runtime=False)):
        loss2.backward()
    with check(Drop(out=2, losses=(2,))):
        del out2, loss2
    with check(Step()):
        opt.step()
    with check(Drop(out=1, losses=(1,))):
        del out1, loss1
    check.finish()


if __name__ == "__main__":
    sys.exit(run_reproduction(main, fault=FAULT))
