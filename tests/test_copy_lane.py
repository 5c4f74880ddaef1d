"""The copy lane of a host tier (``Offload(copy_stream=True)``), its ordering checked on the CPU.

On CUDA the pager's host-tier copies run on a stream of their own ([Note: the copy lane] in
``paramfsm.engine.effects.paging``). Here the lane is ``RecordingStreams``: its side work runs only when a
ticket at or after it is joined, like a device stream that lags the host, so a read installed without a
join holds an empty buffer, a tier read before the write it follows holds the old value, and a working
storage freed while its copy is pending would be copied from freed memory. Each test fails on such a
mistake; the last trains against plain torch with every host tier's pager on the lane.
"""

from __future__ import annotations

import pytest
import torch
from one_rank import one_rank  # noqa: F401  (fixture)

import paramfsm
from paramfsm.engine.effects.paging import MAX_WRITES_IN_FLIGHT, Pager
from paramfsm.engine.effects.streams import PAGE, RecordingStreams
from paramfsm.engine.storage import paged
from paramfsm.engine.storage.tiers import HostTier


class Value:
    """A stand-in placement: one tensor under one key, at a version."""

    kind, unit = "optim", "unit"

    def __init__(self, name: str, tensor: torch.Tensor, version: int = 1):
        self.name, self.tensor, self.version = name, tensor, version

    def values(self):
        return ((self.name, self.tensor),)


def _pager():
    lane = RecordingStreams()
    return Pager(HostTier(rank=0, pin_memory=False), rank=0, lane=lane), lane


def _page_out_and_in(pager, value):
    pager.write_tier([value])
    pager.drop_resident([value])
    assert paged.is_paged_out(value.tensor)
    pager.start_read([value])
    pager.finish_read([value])


def test_a_page_in_on_the_lane_is_joined_before_the_value_is_installed():
    pager, lane = _pager()
    original = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    value = Value("a", original.clone())
    _page_out_and_in(pager, value)
    assert torch.equal(value.tensor, original)
    page = [(call, ticket) for call, lane_name, ticket in lane.log if lane_name == PAGE]
    write, read = [ticket for call, ticket in page if call == "launch"]
    assert write < read  # the read follows the write on the lane
    assert page.index(("join", read)) > page.index(("run", read))


def test_a_pending_write_keeps_the_working_storage_it_copies():
    pager, lane = _pager()
    value = Value("a", torch.full((64,), 3.0))
    pager.write_tier([value])
    pager.drop_resident([value])  # the working storage is freed by the tensor; the ticket keeps an alias
    churn = [torch.full((64,), -1.0) for _ in range(8)]  # allocations that could reuse freed memory
    assert lane.queues[PAGE], "the write runs only when joined"
    pager.start_read([value])
    pager.finish_read([value])
    assert torch.equal(value.tensor, torch.full((64,), 3.0)), churn[0][:1]


def test_pending_writes_are_bounded_and_a_peek_sees_the_latest():
    pager, lane = _pager()
    values = [Value(f"v{i}", torch.full((16,), float(i))) for i in range(MAX_WRITES_IN_FLIGHT + 3)]
    for value in values:
        pager.write_tier([value])
    assert len(pager._writes) <= MAX_WRITES_IN_FLIGHT
    last = values[-1]
    peeked = pager.peek(last, last.name, last.tensor)
    assert torch.equal(peeked, torch.full((16,), float(len(values) - 1)))
    last.tensor.add_(1)  # a new value written to the same slot: the earlier pending write is joined first
    last.version += 1
    pager.write_tier([last])
    pager.drop_resident([last])
    pager.start_read([last])
    pager.finish_read([last])
    assert torch.equal(last.tensor, torch.full((16,), float(len(values))))
    pager.close()
    assert not pager._writes and not lane.queues[PAGE]


def _train(model, opt, steps=3):
    torch.manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()


def _build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 8))


def test_training_with_the_host_tier_on_a_lagging_lane_matches_plain_torch(one_rank):
    reference = _build()
    _train(reference, torch.optim.Adam(reference.parameters(), lr=0.05))
    model = _build()
    rt = paramfsm.shard(model, min_unit_bytes=0,
                        offload=paramfsm.Offload(optimizer="cpu", grads="cpu", copy_stream=True))
    lanes = []
    for pager in rt.offload.pagers.values():
        assert pager.lane is None  # the flag does nothing on the CPU, where the host tier is read in place
        pager.lane = RecordingStreams()
        lanes.append(pager.lane)
    _train(model, torch.optim.Adam(model.parameters(), lr=0.05))
    assert any(("run", PAGE) == entry[:2] for lane in lanes for entry in lane.log)
    got = rt.full_state_dict()
    rt.close()
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(got[key], value, rtol=1e-6, atol=1e-7, msg=key)


def test_copy_stream_must_be_a_flag():
    with pytest.raises(paramfsm.ArgumentTypeError):
        paramfsm.Offload(optimizer="cpu", copy_stream="yes")
