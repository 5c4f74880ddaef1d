"""A training loop `paramfsm verify` drew, saved as its reproduction: each rank's loss reads another output.

Rank 0's last loss reads `blocks.0.qkv` run again on detached inputs, rank 1's `blocks.0.norm1`, a unit
kept gathered from its forward (`reshard_after_forward`). Rank 0's backward waits for a bucket gather and
reads the tags: RankDesync. Rank 1 issued the paired gather but never waits for it (its unit is kept) and
goes on to a reduce-scatter, which rank 0 never joins: it used to end in CollectiveTimeout on rank 1 alone.
The script exits 0 once every rank raises RankDesync there (verify accepts that outcome of a RankLoss).

Run it with `torchrun --nproc-per-node 2 THIS_FILE`; tests/test_rank_desync_default.py runs it in a rank pool.
"""
import sys

import torch
from torch.utils.checkpoint import checkpoint

import paramfsm
import paramfsm.amp
import paramfsm.checkpoint
from paramfsm.verify.checker import Checker
from paramfsm.verify.programs import Backward, Config, Drop, Forward, Loss, Overflow, RankLoss, Save, Step, SubForward, ZeroGrad
from paramfsm.verify.reproduction import run_reproduction
from paramfsm.verify.subject import load_subject
from paramfsm.verify.loop_helpers import force_overflow
from paramfsm.verify.user_loops import detached, record_inputs, tree_loss

FAULT = None  # the catalogued bug the verify run injected (paramfsm.verify.faults), if any


def main(rank, world):
    torch.manual_seed(0)
    subject = load_subject('paramfsm.testing.subjects:branchy_lm')
    model, make_batch, loss_fn = subject.model, subject.make_batch, subject.loss_fn
    config = Config(retain='defer', prefetch=0, bucket_bytes=1048576, max_deferred_bytes=None, param_dtype='float16', reshard_after_forward=('', 'blocks.0.norm1', 'blocks.0.proj', 'blocks.0.up', 'blocks.1.norm1', 'blocks.1.proj', 'blocks.1.up', 'adapter', 'head'))
    check = Checker(subject, config, seed=0, per_rank=2)  # plain torch, verify's checks
    rt = paramfsm.shard(model, units=subject.units, retain='defer', prefetch=0, bucket_bytes=1048576,
                        max_deferred_bytes=None, trace=True, param_dtype=torch.float16, reduce_dtype=torch.float32,
                        reshard_after_forward=lambda name, module: name not in ('', 'blocks.0.norm1', 'blocks.0.proj', 'blocks.0.up', 'blocks.1.norm1', 'blocks.1.proj', 'blocks.1.up', 'adapter', 'head'))
    scaler = paramfsm.amp.GradScaler(rt, init_scale=1024.0, growth_interval=2)
    check.attach(rt, scaler)
    opt = subject.optimizer(rt.shard_parameters())

    def batch(i):
        """This rank's share of global batch i (identical data on every rank)."""
        inputs, targets = make_batch(torch.Generator().manual_seed(0 * 1000 + i), world * 2)
        share = lambda t: t.chunk(world)[rank] if isinstance(t, torch.Tensor) else type(t)(map(share, t))
        return share(inputs), share(targets)

    with check(Forward(out=0, batch=0, mode='train')):
        x0, y0 = batch(0)
        out0 = model(x0)
    with check(Forward(out=1, batch=1, mode='train')):
        x1, y1 = batch(1)
        with record_inputs(model) as acts1:  # each module's inputs, for SubForward ops
            out1 = model(x1)
    with check(RankLoss(loss=0, outs=(0, 1), variant=3)):
        loss0 = tree_loss(3, (out0, out1)[rank % 2])  # another output per rank
        check.same(loss0)  # plain torch's value of this rank slice's loss
    with check(Backward(loss=0, retain=False, via_runtime=False)):
        scaler.scale(loss0).backward()
    with check(Drop(out=0, losses=())):
        del out0
    with check(ZeroGrad()):
        opt.zero_grad()
    with check(Forward(out=2, batch=2, mode='train')):
        x2, y2 = batch(2)
        out2 = model(x2)
    with check(Loss(loss=1, out=2, batch=2, variant=0)):
        loss1 = loss_fn(out2.float(), y2)
        check.same(loss1)  # plain torch's value
    with check(Backward(loss=1, retain=False, via_runtime=False)):
        scaler.scale(loss1).backward()
    with check(Drop(out=2, losses=(1,))):
        del out2, loss1
    with check(Forward(out=3, batch=3, mode='train')):
        x3, y3 = batch(3)
        out3 = model(x3)
    with check(Loss(loss=2, out=3, batch=3, variant=0)):
        loss2 = loss_fn(out3.float(), y3)
        check.same(loss2)  # plain torch's value
    with check(Backward(loss=2, retain=False, via_runtime=False)):
        scaler.scale(loss2).backward()
    with check(Drop(out=3, losses=(2,))):
        del out3, loss2
    with check(Forward(out=4, batch=0, mode='train')):
        out4 = model(x0)
    with check(Loss(loss=3, out=4, batch=0, variant=0)):
        loss3 = loss_fn(out4.float(), y0)
        check.same(loss3)  # plain torch's value
    with check(Backward(loss=3, retain=False, via_runtime=False)):
        scaler.scale(loss3).backward()
    with check(Drop(out=4, losses=(3,))):
        del out4, loss3
    with check(Step()):
        scaler.step(opt)
        scaler.update()
    with check(Overflow(param='blocks.0.qkv.weight', index=380)):
        force_overflow(rt, 'blocks.0.qkv.weight', 380)  # an inf in one gradient element, on its owner rank
    with check(SubForward(out=5, module='blocks.0.norm1', source=1, detach=True, view=False)):
        args, kwargs = detached(acts1['blocks.0.norm1'])  # its inputs in forward 1
        out5 = model.get_submodule('blocks.0.norm1')(*args, **kwargs)
        check.same(out5)  # plain torch's output
        del args, kwargs
    with check(Loss(loss=4, out=5, batch=1, variant=4)):
        loss4 = tree_loss(4, out5)  # sum of mean tanh
        check.same(loss4)  # plain torch's value
    with check(SubForward(out=6, module='blocks.0.qkv', source=1, detach=True, view=False)):
        args, kwargs = detached(acts1['blocks.0.qkv'])  # its inputs in forward 1
        out6 = model.get_submodule('blocks.0.qkv')(*args, **kwargs)
        check.same(out6)  # plain torch's output
        del args, kwargs
    with check(Loss(loss=5, out=6, batch=1, variant=3)):
        loss5 = tree_loss(3, out6)  # sum of mean squares
        check.same(loss5)  # plain torch's value
    with check(RankLoss(loss=6, outs=(6, 5), variant=4)):
        loss6 = tree_loss(4, (out6, out5)[rank % 2])  # another output per rank
        check.same(loss6)  # plain torch's value of this rank slice's loss
    with check(Backward(loss=6, retain=False, via_runtime=True)):
        rt.backward(scaler.scale(loss6))
    with check(Save(full=False)):
        saved_path = check.checkpoint_dir()  # one folder for every rank, kept to the end
        for i, o in [(0, opt)]:
            paramfsm.checkpoint.save(rt, f"{saved_path}/{i}", optimizer=o)
        check.sharded(rt.sharded_state_dict())  # each DTensor holds this rank's Shard(0) chunk
    with check(Drop(out=1, losses=(0,))):
        del out1, loss0, acts1
    with check(Drop(out=5, losses=(4, 6))):
        del out5, loss4, loss6
    with check(Drop(out=6, losses=(5,))):
        del out6, loss5
    check.finish()


if __name__ == "__main__":
    sys.exit(run_reproduction(main, fault=FAULT))
