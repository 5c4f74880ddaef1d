"""The residency effects of :class:`paramfsm.engine.effects.paging.Pager` over the host and the disk tier on the
CPU: what each effect moves, the bytes it counts, the thread a disk read runs on, and the refusal of a tier copy
older than its value. The copy lane's side (CUDA only) is tested through ``RecordingStreams`` in
``tests/test_copy_lane.py``.
"""

from __future__ import annotations

import errno
import os
import threading

import pytest
import torch

from paramfsm.engine.effects.paging import Pager
from paramfsm.engine.schedule.residency import Paged
from paramfsm.engine.storage import paged
from paramfsm.engine.storage.tiers import DiskTier, HostTier
from paramfsm.errors import OffloadError, StaleOffloadCopy


def _tier(where: str, tmp_path):
    return HostTier(3, pin_memory=True) if where == "cpu" else DiskTier(tmp_path, 3, "w")


def _placement(pager: Pager, *values: torch.Tensor) -> Paged:
    """One placement over ``values`` (a parameter's optimizer state has several tensors)."""
    return Paged("block.w", "block", "optim", lambda: [(("w", i), v) for i, v in enumerate(values)], pager, "w")


@pytest.mark.parametrize("where", ["cpu", "disk"])
def test_a_value_written_dropped_and_read_back_is_the_value_written(where, tmp_path):
    pager = Pager(_tier(where, tmp_path), 3)
    first, second = torch.arange(6.0), torch.arange(4, dtype=torch.int64) * 7
    p = _placement(pager, first, second)
    p.version = 5
    pager.write_tier([p])
    assert pager.bytes_written == 6 * 4 + 4 * 8 and pager.tier.slots[("w", 0)].version == 5
    first.add_(100.0)  # the working copy moves on; the tier keeps what was written
    pager.drop_resident([p])
    assert paged.is_paged_out(first) and paged.is_paged_out(second)
    assert torch.equal(pager.peek(p, ("w", 0), first), torch.arange(6.0)), "peek reads the tier copy"
    peeked = pager.peek(p, ("w", 1), second)
    assert peeked.dtype == torch.int64 and torch.equal(peeked, torch.arange(4, dtype=torch.int64) * 7)
    assert paged.is_paged_out(first), "and pages nothing in"
    pager.start_read([p])
    pager.finish_read([p])
    assert not paged.is_paged_out(first) and torch.equal(first, torch.arange(6.0))
    assert torch.equal(second, torch.arange(4, dtype=torch.int64) * 7)
    assert pager.bytes_read == pager.bytes_written
    pager.finish_read([p])  # nothing in flight: nothing to do
    pager.close()


def test_a_disk_read_runs_on_the_page_in_thread_and_close_waits_for_it(tmp_path):
    tier = DiskTier(tmp_path, 3, "w")
    pager = Pager(tier, 3, lane=object())  # a lane is for a host tier's CUDA copies: the disk tier takes none
    assert pager.lane is None
    value = torch.arange(1 << 16, dtype=torch.float32)
    p = _placement(pager, value)
    pager.write_tier([p])
    pager.drop_resident([p])
    seen, read = [], tier.read
    tier.read = lambda *args: (seen.append(threading.current_thread().name), read(*args))[1]
    pager.start_read([p])
    path = tier.path
    pager.close()
    assert seen == ["paramfsm-page-in-3_0"], "read off the caller's thread, and waited for at close"
    assert not path.exists(), "close removes the tier's file"


@pytest.mark.parametrize("where", ["cpu", "disk"])
def test_a_tier_copy_older_than_its_value_is_refused_and_nothing_is_read(where, tmp_path):
    pager = Pager(_tier(where, tmp_path), 3)
    value = torch.ones(4)
    p = _placement(pager, value)
    pager.write_tier([p])
    pager.drop_resident([p])
    p.version += 1  # the value changed after its last write to the tier: that write-back was lost
    with pytest.raises(StaleOffloadCopy) as info:
        pager.peek(p, ("w", 0), value)
    pager.start_read([p])
    with pytest.raises(StaleOffloadCopy) as again:
        pager.finish_read([p])
    for message in (str(info.value), str(again.value)):
        assert message == (
            "the optimizer state of parameter 'block.w' (unit 'block', rank 3) was about to be read from a tier "
            "copy of version 0, older than its working value (version 1): a write-back was lost. Nothing was read. "
            "What to do: this is a bug in paramfsm's offload schedule; report it with the trace dump.")
    assert paged.is_paged_out(value), "the stale copy was not installed"
    pager.close()


def test_a_page_in_under_inference_mode_gives_back_a_normal_tensor(tmp_path):
    """An evaluation under ``torch.inference_mode()`` may page a value in; training uses it afterwards."""
    pager = Pager(_tier("cpu", tmp_path), 3)
    value = torch.ones(4)
    p = _placement(pager, value)
    pager.write_tier([p])
    pager.drop_resident([p])
    with torch.inference_mode():
        pager.start_read([p])
        pager.finish_read([p])
    assert not paged.working(value).is_inference()
    pager.close()


@pytest.mark.parametrize("what", ["write", "read"])
def test_a_failing_disk_names_the_parameter_it_was_moving(what, tmp_path, monkeypatch):
    pager = Pager(DiskTier(tmp_path, 3, "w"), 3)
    value = torch.ones(4)
    p = _placement(pager, value)
    if what == "read":
        pager.write_tier([p])
        pager.drop_resident([p])

    def fail(*args):
        raise OSError(errno.EIO, "input/output error")

    monkeypatch.setattr(os, "pwrite" if what == "write" else "preadv", fail)
    with pytest.raises(OffloadError, match=f"could not {what} 16 bytes of 'block.w' \\(rank 3\\)"):
        pager.write_tier([p]) if what == "write" else (pager.start_read([p]), pager.finish_read([p]))
    monkeypatch.undo()
    pager.close()


def test_a_value_that_changed_size_is_refused_by_name(tmp_path):
    pager = Pager(_tier("cpu", tmp_path), 3)
    held = [torch.ones(4)]
    p = Paged("block.w", "block", "shard", lambda: [("w", held[0])], pager, "w")
    pager.write_tier([p])
    held[0] = torch.ones(5)
    with pytest.raises(OffloadError, match="'block.w' now has 20 bytes, but its offload slot holds 16"):
        pager.write_tier([p])
