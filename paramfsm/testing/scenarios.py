"""The seed loop as a rank job on any device: two losses, one retained graph, against plain torch.

``two_loss_job`` is what the stream tests (CPU, with
:class:`~paramfsm.engine.effects.streams.RecordingStreams`), the GPU tests and
``make gpu-check`` all run: every rank trains a small transformer for a few
steps with ``zero_grad(); l1.backward(retain_graph=True); zero_grad();
l2.backward(); step()`` and compares every gradient and every parameter with an
unsharded copy trained on the global batch in the same process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

import paramfsm
from paramfsm.core.fsm import default_table
from paramfsm.core.replay import replay
from paramfsm.testing.models import TinyTransformer
from paramfsm.testing.reference import Reference, assert_close_dicts, rank_slice, sharded_grads, sharded_params

VOCAB, SEQ, PER_RANK = 32, 8, 2


def batch(step: int, world: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``step``: identical on every rank."""
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (world * PER_RANK, SEQ), generator=gen)
    targets = torch.randint(0, VOCAB, (world * PER_RANK, SEQ), generator=gen)
    return tokens.to(device), targets.to(device)


def two_losses(out: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return F.cross_entropy(out.reshape(-1, VOCAB), targets.reshape(-1)), (out ** 2).mean()


def force_collectives(rt) -> None:
    """Make a one-rank runtime gather and reduce through real collectives, with prefetch plans.

    World 1 normally skips communication (the shard is the parameter). On a
    single GPU this drives the whole device path instead: packing kernels,
    NCCL, the gather and reduce streams. Call it before the first forward.
    """
    rt.executor.local = False
    rt.scheduler.prefetch.planning = True


def two_loss_job(rank, world, device="cpu", retain="defer", steps=3, *, streams=None, collectives=False,
                 dim=16, depth=2, bucket_bytes=1 << 20, atol=1e-5) -> dict:
    """Train, compare with plain torch after every backward and step; return errors and counts.

    ``streams``: a stream set to put in the executor before the first forward
    (e.g. a :class:`~paramfsm.engine.effects.streams.RecordingStreams`); it comes back
    in the report as ``"stream_set"`` for the caller to inspect, while
    ``"streams"`` always names the class in use. ``collectives``:
    see :func:`force_collectives` (for one rank).
    """
    torch.manual_seed(0)
    model = TinyTransformer(vocab=VOCAB, dim=dim, depth=depth, seq=SEQ).to(device)
    ref = Reference(model, lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9))
    rt = paramfsm.shard(model, retain=retain, trace=True, bucket_bytes=bucket_bytes)
    if collectives:
        force_collectives(rt)
    if streams is not None:
        rt.executor.streams = streams
        if hasattr(streams, "note"):  # mark each block's compute in the stream log
            for i, block in enumerate(model.blocks):
                block.register_forward_pre_hook(lambda *_, i=i: streams.note(f"block {i}"))
    opt = torch.optim.SGD(rt.shard_parameters(), lr=0.1, momentum=0.9)
    report = {"grad_err": 0.0, "param_err": 0.0, "gathers_second_backward": [],
              "streams": type(rt.executor.streams).__name__, "backend": dist.get_backend(rt.group)}
    for step in range(steps):
        tokens, targets = batch(step, world, device)
        l1, l2 = two_losses(model(rank_slice(tokens, rank, world)), rank_slice(targets, rank, world))
        r1, r2 = two_losses(ref.model(tokens), targets)
        for loss, ref_loss, keep in ((l1, r1, True), (l2, r2, False)):
            opt.zero_grad()
            ref.zero_grad()
            before = rt.counters["all_gathers"]
            loss.backward(retain_graph=keep)
            ref_loss.backward(retain_graph=keep)
            if not keep:
                report["gathers_second_backward"].append(rt.counters["all_gathers"] - before)
            err = assert_close_dicts(sharded_grads(rt, model), ref.grads(), atol=atol,
                                     what=f"rank {rank} step {step} {'first' if keep else 'second'} backward")
            report["grad_err"] = max(report["grad_err"], err)
        opt.step()
        ref.optimizer.step()
        err = assert_close_dicts(sharded_params(rt, model), ref.params(), atol=atol,
                                 what=f"rank {rank} params after step {step}")
        report["param_err"] = max(report["param_err"], err)
    problem = replay(rt.trace.records, default_table())
    assert problem is None, str(problem)
    assert rt.scheduler.audit.last == [], rt.scheduler.audit.last
    assert set(rt.states().values()) == {paramfsm.State.NOT_AVAILABLE}, rt.states()
    report["all_gathers"] = rt.counters["all_gathers"]
    if streams is not None:
        report["stream_set"] = streams  # given by the caller: back to it, with its log
    rt.close()
    return report
