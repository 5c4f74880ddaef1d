"""The executor's stream logic on the CPU, through a stand-in device that lags the host.

:class:`RecordingStreams` defers every piece of side work until it is joined,
as a real device stream lags the host. So the training loop only matches plain
torch if the executor joins each gather before it installs parameters and each
reduce before it accumulates shard gradients; the sabotage tests remove each
join in turn and see the comparison fail. The log then shows ordering, FIFO
lanes, prefetch running ahead of compute, and bounded tickets in flight.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from paramfsm.engine.effects import executor as executor_module
from paramfsm.engine.effects.executor import MAX_REDUCES_IN_FLIGHT
from paramfsm.engine.effects.streams import GATHER, PAGE, REDUCE, HostStreams, RecordingStreams, streams_for
from paramfsm.verify.launch import RankFailure
from paramfsm.testing.scenarios import two_loss_job


def test_recording_streams_defer_until_joined_in_lane_order():
    streams = RecordingStreams()
    ran = []
    first = streams.launch(GATHER, lambda x: ran.append(x) or x * 2, 1)
    second = streams.launch(GATHER, lambda x: ran.append(x) or x * 2, 2)
    other = streams.launch(REDUCE, lambda: ran.append("r") or "r")
    assert ran == [] and first.result is None
    assert streams.join(second) == 4
    assert ran == [1, 2], "joining a later ticket runs the earlier ones on its lane first"
    assert streams.join(first) == 2 and ran == [1, 2], "a ticket runs once"
    assert streams.join(other) == "r"
    assert [c for c in streams.log if c[0] == "run"] == [("run", GATHER, 0), ("run", GATHER, 1), ("run", REDUCE, 2)]
    assert streams.max_in_flight == {GATHER: 2, REDUCE: 1, PAGE: 0}


def test_host_streams_run_at_once_and_cpu_gets_them():
    host = HostStreams()
    ticket = host.launch(REDUCE, lambda a, b: a + b, 2, 3)
    assert ticket.result == 5 and host.join(ticket) == 5
    assert isinstance(streams_for(torch.device("cpu")), HostStreams)
    assert not HostStreams.asynchronous and RecordingStreams.asynchronous


def _check_log(log) -> dict:
    """Every ticket: launched once, run once, joined once, in that order; lanes run FIFO."""
    where: dict[tuple[str, int], int] = {}
    for i, (call, lane, number) in enumerate(log):
        if call == "note":
            continue
        key = (call, number)
        assert key not in where, f"{call} of ticket {number} twice"
        where[key] = i
    numbers = {n for call, _, n in log if call != "note"}
    for n in numbers:
        assert where[("launch", n)] < where[("run", n)] < where[("join", n)], f"ticket {n} out of order"
    for lane in (GATHER, REDUCE):
        launched = [n for call, ln, n in log if call == "launch" and ln == lane]
        run = [n for call, ln, n in log if call == "run" and ln == lane]
        assert run == launched, f"{lane} lane ran out of launch order"
    return where


@pytest.mark.parametrize("retain", ["defer", "regather"])
def test_two_losses_match_plain_torch_with_a_lagging_device(ranks2, retain):
    # Small buckets: several gathers per pass (so prefetch has something to run ahead on)
    # and several reduce-scatters per backward (so the in-flight bound is reached).
    job = partial(two_loss_job, streams=RecordingStreams(), bucket_bytes=2048)
    reports = ranks2.run(job, "cpu", retain, 3)
    for report in reports:
        streams = report["stream_set"]
        assert report["grad_err"] < 1e-5 and report["param_err"] < 1e-5
        where = _check_log(streams.log)
        gathers = [n for call, lane, n in streams.log if call == "launch" and lane == GATHER]
        assert streams.max_in_flight[REDUCE] == MAX_REDUCES_IN_FLIGHT
        # Prefetch runs ahead of compute: some gather is launched before a block computes and
        # joined only after it (the device overlaps the two).
        ahead = [n for n in gathers if any(call == "note" for call, *_ in streams.log[where[("launch", n)]:where[("join", n)]])]
        assert ahead, "no gather spans a block's compute: prefetch does not run ahead"
        if retain == "defer":
            assert report["gathers_second_backward"] == [0, 0, 0]


def _sabotaged_job(rank, world, lane):
    """The same loop with the executor's join on one lane skipped (a removed wait)."""
    if lane == GATHER:
        def wait_gather(self, gather):
            outs = gather.ticket.result if gather.ticket is not None else None
            gather.ticket = None
            if outs is not None:
                for rec, out in zip(gather.records, outs):
                    rec.staged = out
        executor_module.Executor.wait_gather = wait_gather
    else:
        def join_reduce(self, ticket):
            return ticket.result[0] if ticket.result is not None else torch.zeros(0)
        executor_module.Executor._join_reduce = join_reduce
    return two_loss_job(rank, world, "cpu", "defer", 2, streams=RecordingStreams(), bucket_bytes=2048)


@pytest.mark.slow  # over 5 s on two cores: make test-slow
@pytest.mark.parametrize("lane", [GATHER, REDUCE])
def test_a_removed_join_fails_the_comparison(lane):
    """Each join is load-bearing: without it the loop errors or diverges from plain torch."""
    from paramfsm.verify.launch import RankPool

    with RankPool(2, timeout=120) as pool, pytest.raises(RankFailure, match="_sabotaged_job"):
        pool.run(_sabotaged_job, lane)


def test_one_rank_through_collectives(ranks1):
    """The path ``make gpu-check`` drives on one GPU (collectives forced at world 1), checked here on gloo."""
    job = partial(two_loss_job, streams=RecordingStreams(), collectives=True, bucket_bytes=2048)
    report = ranks1.run(job, "cpu", "defer", 2)[0]
    assert report["grad_err"] < 1e-5 and report["param_err"] < 1e-5
    assert report["all_gathers"] > 0, "forced collectives issued no all-gather"
    _check_log(report["stream_set"].log)
