"""A training loop `paramfsm verify` drew under offload to disk, saved as its reproduction.

An evaluation under `torch.inference_mode()` pages shards in; a DCP checkpoint round trip then writes
them in place. The working buffers were allocated inside inference mode, so they were inference tensors
and the load's in-place copy raised "Inplace update to inference tensor outside InferenceMode". The pager
now allocates working buffers outside inference mode; the script exits 0.

Run it with `torchrun --nproc-per-node 2 THIS_FILE`; tests/test_offload.py runs it in a rank pool.
"""
import sys

import torch
from torch.utils.checkpoint import checkpoint

import paramfsm
import paramfsm.checkpoint
from paramfsm.verify.checker import Checker
from paramfsm.verify.programs import Backward, Checkpoint, Config, Drop, Evaluate, Flush, Forward, Gathered, Loss, Step, SubForward, ZeroGrad
from paramfsm.verify.reproduction import run_reproduction
from paramfsm.verify.subject import load_subject
from paramfsm.verify.loop_helpers import offload_policy, perturbed
from paramfsm.verify.user_loops import detached, record_inputs, tree_loss

FAULT = None  # the catalogued bug the verify run injected (paramfsm.verify.faults), if any


def main(rank, world):
    torch.manual_seed(0)
    subject = load_subject('paramfsm.testing.subjects:branchy_lm')
    model, make_batch, loss_fn = subject.model, subject.make_batch, subject.loss_fn
    config = Config(retain='regather', prefetch=0, bucket_bytes=1, max_deferred_bytes=None, param_dtype='bfloat16', reshard_after_forward=False, offload='disk')
    check = Checker(subject, config, seed=0, per_rank=2)  # plain torch, verify's checks
    rt = paramfsm.shard(model, units=subject.units, retain='regather', prefetch=0, bucket_bytes=1,
                        max_deferred_bytes=None, trace=True, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, reshard_after_forward=False,
                        offload=offload_policy(subject, config, world)[0])
    check.attach(rt)
    opt = subject.optimizer(rt.shard_parameters())

    def batch(i):
        """This rank's share of global batch i (identical data on every rank)."""
        inputs, targets = make_batch(torch.Generator().manual_seed(0 * 1000 + i), world * 2)
        share = lambda t: t.chunk(world)[rank] if isinstance(t, torch.Tensor) else type(t)(map(share, t))
        return share(inputs), share(targets)

    with check(Gathered(module='blocks.0.up', batch=0)):
        x0, y0 = batch(0)
        with rt.gathered(model.get_submodule('blocks.0.up')):
            with torch.no_grad():
                model(x0)
            check.inside_gathered(model.get_submodule('blocks.0.up'))
    with check(Forward(out=0, batch=3, mode='train')):
        x3, y3 = batch(3)
        with record_inputs(model) as acts0:  # each module's inputs, for SubForward ops
            out0 = model(x3)
    with check(ZeroGrad()):
        opt.zero_grad()
    with check(SubForward(out=1, module='blocks.1.norm1', source=0, detach=False, view=False)):
        args, kwargs = acts0['blocks.1.norm1']  # its inputs in forward 0
        out1 = model.get_submodule('blocks.1.norm1')(*args, **kwargs)
        check.same(out1)  # plain torch's output
        del args, kwargs
    with check(Loss(loss=0, out=1, batch=3, variant=3)):
        loss0 = tree_loss(3, out1)  # sum of mean squares
        check.same(loss0)  # plain torch's value
    with check(Backward(loss=0, retain=True, via_runtime=False)):
        loss0.backward(retain_graph=True)
    with check(Step()):
        opt.step()
    with check(ZeroGrad()):
        opt.zero_grad()
    with check(SubForward(out=2, module='blocks.1.norm1', source=0, detach=False, view=False)):
        args, kwargs = acts0['blocks.1.norm1']  # its inputs in forward 0
        out2 = model.get_submodule('blocks.1.norm1')(*args, **kwargs)
        check.same(out2)  # plain torch's output
        del args, kwargs
    with check(Loss(loss=1, out=2, batch=3, variant=3)):
        loss1 = tree_loss(3, out2)  # sum of mean squares
        check.same(loss1)  # plain torch's value
    with check(Drop(out=2, losses=(1,))):
        del out2, loss1
    with check(Drop(out=1, losses=(0,))):
        del out1, loss0
    with check(Drop(out=0, losses=())):
        del out0, acts0
    with check(Evaluate(batches=(0, 1), inference=True)):
        x1, y1 = batch(1)
        model.eval()
        with torch.inference_mode():
            outs = [model(x0), model(x1)]
        model.train()
        check.same(outs)  # plain torch's outputs
        del outs
    with check(Evaluate(batches=(3,), inference=False)):
        model.eval()
        with torch.no_grad():
            outs = [model(x3)]
        model.train()
        check.same(outs)  # plain torch's outputs
        del outs
    with check(Forward(out=3, batch=0, mode='train')):
        with record_inputs(model) as acts3:  # each module's inputs, for SubForward ops
            out3 = model(x0)
    with check(ZeroGrad()):
        opt.zero_grad()
    with check(SubForward(out=4, module='blocks.1.norm1', source=3, detach=False, view=False)):
        args, kwargs = acts3['blocks.1.norm1']  # its inputs in forward 3
        out4 = model.get_submodule('blocks.1.norm1')(*args, **kwargs)
        check.same(out4)  # plain torch's output
        del args, kwargs
    with check(Loss(loss=2, out=4, batch=0, variant=3)):
        loss2 = tree_loss(3, out4)  # sum of mean squares
        check.same(loss2)  # plain torch's value
    with check(Backward(loss=2, retain=True, via_runtime=False)):
        loss2.backward(retain_graph=True)
    with check(Step()):
        opt.step()
    with check(ZeroGrad()):
        opt.zero_grad()
    with check(SubForward(out=5, module='blocks.1.norm1', source=3, detach=False, view=False)):
        args, kwargs = acts3['blocks.1.norm1']  # its inputs in forward 3
        out5 = model.get_submodule('blocks.1.norm1')(*args, **kwargs)
        check.same(out5)  # plain torch's output
        del args, kwargs
    with check(Loss(loss=3, out=5, batch=0, variant=3)):
        loss3 = tree_loss(3, out5)  # sum of mean squares
        check.same(loss3)  # plain torch's value
    with check(Drop(out=5, losses=(3,))):
        del out5, loss3
    with check(Drop(out=4, losses=(2,))):
        del out4, loss2
    with check(Drop(out=3, losses=())):
        del out3, acts3
    with check(ZeroGrad()):
        opt.zero_grad()
    with check(Forward(out=6, batch=2, mode='train')):
        x2, y2 = batch(2)
        out6 = model(x2)
    with check(Loss(loss=4, out=6, batch=2, variant=0)):
        loss4 = loss_fn(out6.float(), y2)
        check.same(loss4)  # plain torch's value
    with check(Backward(loss=4, retain=False, via_runtime=True)):
        rt.backward(loss4)
    with check(Drop(out=6, losses=(4,))):
        del out6, loss4
    with check(Step()):
        opt.step()
    with check(Gathered(module='blocks.0.down', batch=None)):
        with rt.gathered(model.get_submodule('blocks.0.down')):
            check.inside_gathered(model.get_submodule('blocks.0.down'))
    with check(Flush()):
        rt.flush()
    with check(Evaluate(batches=(3,), inference=True)):
        model.eval()
        with torch.inference_mode():
            outs = [model(x3)]
        model.train()
        check.same(outs)  # plain torch's outputs
        del outs
    with check(Checkpoint()):
        path = check.scratch_dir()  # one folder for every rank
        paramfsm.checkpoint.save(rt, path)
        check.sharded(rt.sharded_state_dict())  # each DTensor holds this rank's Shard(0) chunk
        rt.load_full_state_dict(perturbed(rt.full_state_dict()))
        paramfsm.checkpoint.load(rt, path)  # <- fails here
    with check(Forward(out=7, batch=2, mode='train')):
        with record_inputs(model) as acts7:  # each module's inputs, for SubForward ops
            out7 = model(x2)
    with check(SubForward(out=8, module='blocks.0.proj', source=7, detach=True, view=False)):
        args, kwargs = detached(acts7['blocks.0.proj'])  # its inputs in forward 7
        out8 = model.get_submodule('blocks.0.proj')(*args, **kwargs)
        check.same(out8)  # plain torch's output
        del args, kwargs
    with check(Loss(loss=5, out=8, batch=2, variant=4)):
        loss5 = tree_loss(4, out8)  # sum of mean tanh
        check.same(loss5)  # plain torch's value
    with check(SubForward(out=9, module='blocks.0.down', source=7, detach=True, view=False)):
        args, kwargs = detached(acts7['blocks.0.down'])  # its inputs in forward 7
        out9 = model.get_submodule('blocks.0.down')(*args, **kwargs)
        check.same(out9)  # plain torch's output
        del args, kwargs
    with check(Loss(loss=6, out=9, batch=2, variant=3)):
        loss6 = tree_loss(3, out9)  # sum of mean squares
        check.same(loss6)  # plain torch's value
    with check(Drop(out=7, losses=())):
        del out7, acts7
    with check(Drop(out=8, losses=(5,))):
        del out8, loss5
    with check(Drop(out=9, losses=(6,))):
        del out9, loss6
    check.finish()


if __name__ == "__main__":
    sys.exit(run_reproduction(main, fault=FAULT))
