"""The runtime on a CUDA device: side streams ordered by events, NCCL, the seed loop against plain torch,
also with side lanes slowed down so that a missing wait shows.

Skipped without a CUDA device. ``make gpu-check`` runs these with the kernel
tests (``pytest -m gpu``).
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from paramfsm.engine.effects.streams import GATHER, REDUCE, DeviceStreams, streams_for
from paramfsm.verify.launch import RankPool
from paramfsm.testing.scenarios import two_loss_job

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SLOW_LANE_CYCLES = 50_000_000  # tens of milliseconds of GPU spinning: compute would overtake an unordered lane


def test_compute_waits_for_a_slow_lane():
    streams = streams_for(torch.device("cuda"))
    assert isinstance(streams, DeviceStreams)
    source = torch.full((1 << 20,), 3.0, device="cuda")

    def slow_copy(src):
        torch.cuda._sleep(SLOW_LANE_CYCLES)
        return src * 2

    ticket = streams.launch(GATHER, slow_copy, source)
    out = streams.join(ticket)
    assert torch.equal(out, torch.full_like(source, 6.0)), "compute read the lane's result before it was ready"


def test_a_lane_waits_for_compute_before_reading():
    streams = DeviceStreams(torch.device("cuda"))
    data = torch.zeros(1 << 20, device="cuda")
    torch.cuda._sleep(SLOW_LANE_CYCLES)  # compute is busy ...
    data.fill_(5.0)                       # ... then produces the lane's input
    out = streams.join(streams.launch(REDUCE, lambda t: t.sum(), data))
    assert out.item() == 5.0 * data.numel()


def test_tickets_keep_their_arguments_until_joined():
    streams = DeviceStreams(torch.device("cuda"))
    grads = torch.ones(1 << 16, device="cuda")
    ticket = streams.launch(REDUCE, lambda g: g.sum(), grads)
    assert ticket.args[0] is grads
    streams.join(ticket)
    assert ticket.args == () and ticket.event is None


@pytest.fixture(scope="module")
def nccl1():
    with RankPool(1, timeout=300, device="cuda") as pool:
        yield pool


@pytest.mark.parametrize("retain", ["defer", "regather"])
@pytest.mark.parametrize("collectives", [False, True], ids=["local", "nccl"])
def test_two_losses_on_one_gpu(nccl1, retain, collectives):
    job = partial(two_loss_job, collectives=collectives, dim=64, depth=3, bucket_bytes=64 << 10, atol=1e-4)
    report = nccl1.run(job, "cuda", retain, 3)[0]
    assert report["backend"] == "nccl"
    assert report["streams"] == "DeviceStreams"
    assert (report["all_gathers"] > 0) == collectives
    assert report["grad_err"] < 1e-4 and report["param_err"] < 1e-4


@pytest.mark.parametrize("norm_type", [0.0, 2.0, float("inf")])
def test_clip_on_the_device(norm_type):
    """The accumulator and the all-reduce input live on the gradients' device."""
    from paramfsm.optim import grad_norm

    gen = torch.Generator(device="cuda").manual_seed(0)
    ours = [torch.nn.Parameter(torch.zeros(n, device="cuda")) for n in (7, 13)]
    theirs = [torch.nn.Parameter(torch.zeros(n, device="cuda")) for n in (7, 13)]
    for a, b in zip(ours, theirs):
        a.grad = torch.randn(a.shape, device="cuda", generator=gen)
        b.grad = a.grad.clone()
    total = grad_norm.clip_grad_norm_(ours, 0.5, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(theirs, 0.5, norm_type)
    assert total.device.type == "cuda" and torch.allclose(total, expected, rtol=1e-5)
    assert all(torch.allclose(a.grad, b.grad, rtol=1e-5) for a, b in zip(ours, theirs))


class SlowLanes(DeviceStreams):
    """CUDA lanes whose every piece of side work first spins the GPU, so each lane lags compute by
    tens of milliseconds: compute that reads a gathered parameter, or a reduced gradient, without
    waiting at ``join`` reads memory the lane has not written yet."""

    def launch(self, lane, fn, *args):
        def slow(*inputs):
            torch.cuda._sleep(SLOW_LANE_CYCLES)
            return fn(*inputs)

        return super().launch(lane, slow, *args)


def slow_lanes_job(rank, world, retain):
    streams = SlowLanes(torch.device("cuda"))
    report = two_loss_job(rank, world, "cuda", retain, 2, streams=streams, collectives=True, dim=64, depth=3,
                          bucket_bytes=64 << 10, atol=1e-4)
    report.pop("stream_set")  # CUDA streams do not travel back to the test process
    return report


@pytest.mark.parametrize("retain", ["defer", "regather"])
def test_training_with_lagging_lanes_matches_plain_torch(nccl1, retain):
    """Every join must make compute wait for its lane: with lanes that lag (the gathers NCCL runs while
    the GPU is busy with compute, on a real run), gradients and parameters still match plain torch
    after every backward and step. Removing a join's wait (``DeviceStreams.join``, or a join the
    executor skips before it reads a gathered bucket) makes compute read unwritten buffers here."""
    report = nccl1.run(slow_lanes_job, retain)[0]
    assert report["streams"] == "SlowLanes" and report["all_gathers"] > 0
    assert report["grad_err"] < 1e-4 and report["param_err"] < 1e-4
