"""A training loop the new `paramfsm verify` drew against the engine before issue #52's fixes (loop 3), saved as
its reproduction: units kept from forward to backward under a 4 KiB deferral bound, the root reading the
embedding's weight (a tied output layer through F.linear), two losses over a retained graph. On that engine the
root's second backward read the embedding emptied by the bound; the script exits 1 there and 0 now.

What verify reported on that engine:

exception check failed: RuntimeError: setStorage: sizes [1291, 13], strides [13, 1], storage offset 0, and itemsize 4 requiring a storage size of 67132 are out of bounds for storage of size 0

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
from paramfsm.verify.programs import Backward, Config, Drop, Forward, Loss, Step, ZeroGrad
from paramfsm.verify.reproduction import run_reproduction
from paramfsm.verify.subject import load_subject

FAULT = None  # the catalogued bug the verify run injected (paramfsm.verify.faults), if any


def main(rank, world):
    torch.manual_seed(0)
    subject = load_subject('paramfsm.testing.subjects:sized_lm')
    model, make_batch, loss_fn = subject.model, subject.make_batch, subject.loss_fn
    config = Config(retain='defer', prefetch=1, bucket_bytes=8388608, max_deferred_bytes=4096, param_dtype=None, reshard_after_forward=False, offload=None, units='default')
    check = Checker(subject, config, seed=0, per_rank=2)  # plain torch, verify's checks
    rt = paramfsm.shard(model, units=subject.units, min_unit_bytes=subject.min_unit_bytes, retain='defer',
                        prefetch=1, bucket_bytes=8388608,
                        max_deferred_bytes=4096, trace=True, reshard_after_forward=False)
    check.attach(rt)
    opt = subject.optimizer(rt.shard_parameters())

    def batch(i):
        """This rank's share of global batch i (identical data on every rank)."""
        inputs, targets = make_batch(torch.Generator().manual_seed(0 * 1000 + i), world * 2)
        share = lambda t: t.chunk(world)[rank] if isinstance(t, torch.Tensor) else type(t)(map(share, t))
        return share(inputs), share(targets)

    with check(Forward(out=0, batch=0, mode='train')):
        x0, y0 = batch(0)
        out0 = model(x0)
    with check(Loss(loss=0, out=0, batch=0, variant=0)):
        loss0 = loss_fn(out0, y0)
        check.same(loss0)  # plain torch's value
    with check(Loss(loss=1, out=0, batch=0, variant=1)):
        loss1 = out0.float().pow(2).mean()
        check.same(loss1)  # plain torch's value
    with check(ZeroGrad()):
        opt.zero_grad()
    with check(Backward(loss=0, retain=True, via_runtime=False)):
        loss0.backward(retain_graph=True)
    with check(ZeroGrad()):
        opt.zero_grad()
    with check(Backward(loss=1, retain=False, via_runtime=False)):
        loss1.backward()  # <- fails here
    with check(Step()):
        opt.step()
    with check(Forward(out=1, batch=1, mode='train')):
        x1, y1 = batch(1)
        out1 = model(x1)
    with check(Loss(loss=2, out=1, batch=1, variant=0)):
        loss2 = loss_fn(out1, y1)
        check.same(loss2)  # plain torch's value
    with check(Loss(loss=3, out=1, batch=1, variant=1)):
        loss3 = out1.float().pow(2).mean()
        check.same(loss3)  # plain torch's value
    with check(ZeroGrad()):
        opt.zero_grad()
    with check(Backward(loss=2, retain=True, via_runtime=True)):
        rt.backward(loss2, retain_graph=True)
    with check(ZeroGrad()):
        opt.zero_grad()
    with check(Backward(loss=3, retain=False, via_runtime=True)):
        rt.backward(loss3)
    with check(Drop(out=0, losses=(0, 1))):
        del out0, loss0, loss1
    with check(Drop(out=1, losses=(2, 3))):
        del out1, loss2, loss3
    check.finish()


if __name__ == "__main__":
    sys.exit(run_reproduction(main, fault=FAULT))
