"""A training loop the new `paramfsm verify` drew against the engine before issue #52's fixes (loop 1), saved as
its reproduction: the whole model one unit, a backward broken off inside a user's autograd.Function after some
gradients were accumulated, rt.reset() and zero_grad, then an iteration. On that engine the next iteration's
gradients were 0.07 off plain torch; the script exits 1 there and 0 now.

What verify reported on that engine:

reference check failed: the gradient of 'blocks.0.2.weight' differs from the reference by 0.0749 (atol 1e-05); the gradient of 'blocks.0.2.bias' differs from the reference by 0.0869 (atol 1e-05); the gradient of 'blocks.1.0.weight' differs from the reference by 0.0675 (atol 1e-05); the gradient of 'blocks.1.0.bias' differs from the reference by 0.0502 (atol 1e-05); the gradient of 'blocks.1.2.weight' differs from the reference by 0.0922 (atol 1e-05); the gradient of 'blocks.1.2.bias' differs from the reference by 0.0921 (atol 1e-05); the gradient of 'norm.weight' differs from the reference by 2.46 (atol 1e-05); the gradient of 'norm.bias' differs from the reference by 0.558 (atol 1e-05)

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
from paramfsm.verify.programs import Backward, Config, Drop, Forward, Interrupted, Loss, Step, SubForward, ZeroGrad
from paramfsm.verify.reproduction import run_reproduction
from paramfsm.verify.subject import load_subject
from paramfsm.verify.loop_helpers import forget_recoveries
from paramfsm.verify.user_loops import detached, interrupt, record_inputs, tree_loss

FAULT = None  # the catalogued bug the verify run injected (paramfsm.verify.faults), if any


def main(rank, world):
    torch.manual_seed(0)
    subject = load_subject('paramfsm.testing.subjects:sized_lm')
    model, make_batch, loss_fn = subject.model, subject.make_batch, subject.loss_fn
    config = Config(retain='defer', prefetch=1, bucket_bytes=8388608, max_deferred_bytes=None, param_dtype=None, reshard_after_forward=True, offload=None, units='one')
    check = Checker(subject, config, seed=0, per_rank=2)  # plain torch, verify's checks
    rt = paramfsm.shard(model, units=lambda name, module: False, retain='defer',
                        prefetch=1, bucket_bytes=8388608,
                        max_deferred_bytes=None, trace=True)
    check.attach(rt)
    opt = subject.optimizer(rt.shard_parameters())

    def batch(i):
        """This rank's share of global batch i (identical data on every rank)."""
        inputs, targets = make_batch(torch.Generator().manual_seed(0 * 1000 + i), world * 2)
        share = lambda t: t.chunk(world)[rank] if isinstance(t, torch.Tensor) else type(t)(map(share, t))
        return share(inputs), share(targets)

    with check(ZeroGrad()):
        opt.zero_grad()
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
    with check(Interrupted(batch=1, module='blocks.0.0', reset=True)):
        x1, y1 = batch(1)
        interrupt(model, 'blocks.0.0', x1)  # its backward raises inside an autograd.Function
        rt.reset()
        opt.zero_grad(set_to_none=True)
        forget_recoveries(rt)  # the recovery's flight-recorder dump
    with check(ZeroGrad()):
        opt.zero_grad()
    with check(Forward(out=1, batch=2, mode='train')):
        x2, y2 = batch(2)
        out1 = model(x2)
    with check(Loss(loss=1, out=1, batch=2, variant=0)):
        loss1 = loss_fn(out1, y2)
        check.same(loss1)  # plain torch's value
    with check(Backward(loss=1, retain=False, via_runtime=False)):
        loss1.backward()  # <- fails here
    with check(Drop(out=1, losses=(1,))):
        del out1, loss1
    with check(Step()):
        opt.step()
    with check(Interrupted(batch=3, module='blocks.0.2', reset=False)):
        x3, y3 = batch(3)
        interrupt(model, 'blocks.0.2', x3)  # its backward raises inside an autograd.Function
        opt.zero_grad(set_to_none=True)
        forget_recoveries(rt)  # the recovery's flight-recorder dump
    with check(Forward(out=-1, batch=2, mode='no_grad')):
        with torch.no_grad():
            model(x2)
    with check(ZeroGrad()):
        opt.zero_grad()
    with check(Forward(out=2, batch=1, mode='checkpoint')):
        out2 = checkpoint(model, x1, use_reentrant=False)
    with check(Loss(loss=2, out=2, batch=1, variant=1)):
        loss2 = out2.float().pow(2).mean()
        check.same(loss2)  # plain torch's value
    with check(Backward(loss=2, retain=False, via_runtime=False)):
        loss2.backward()
    with check(Drop(out=2, losses=(2,))):
        del out2, loss2
    with check(Step()):
        opt.step()
    with check(Forward(out=3, batch=0, mode='train')):
        with record_inputs(model) as acts3:  # each module's inputs, for SubForward ops
            out3 = model(x0)
    with check(SubForward(out=4, module='blocks.0.0', source=3, detach=False, view=False)):
        args, kwargs = acts3['blocks.0.0']  # its inputs in forward 3
        out4 = model.get_submodule('blocks.0.0')(*args, **kwargs)
        check.same(out4)  # plain torch's output
        del args, kwargs
    with check(Loss(loss=3, out=4, batch=0, variant=4)):
        loss3 = tree_loss(4, out4)  # sum of mean tanh
        check.same(loss3)  # plain torch's value
    with check(SubForward(out=5, module='embed', source=3, detach=True, view=False)):
        args, kwargs = detached(acts3['embed'])  # its inputs in forward 3
        out5 = model.get_submodule('embed')(*args, **kwargs)
        check.same(out5)  # plain torch's output
        del args, kwargs
    with check(Loss(loss=4, out=5, batch=0, variant=3)):
        loss4 = tree_loss(3, out5)  # sum of mean squares
        check.same(loss4)  # plain torch's value
    with check(Backward(loss=3, retain=False, via_runtime=False)):
        loss3.backward()
    with check(Step()):
        opt.step()
    with check(Drop(out=3, losses=())):
        del out3, acts3
    with check(Drop(out=4, losses=(3,))):
        del out4, loss3
    with check(Drop(out=5, losses=(4,))):
        del out5, loss4
    check.finish()


if __name__ == "__main__":
    sys.exit(run_reproduction(main, fault=FAULT))
