"""The offload tiers (:mod:`paramfsm.engine.storage.tiers`), in the test process.

A tier copy must come back bit for bit, in every dtype, in the slot it was
placed in, whatever the disk does (short writes and reads), and a disk that
cannot hold it must fail with a message naming the value, the rank and the
fix. The offload suites (``tests/test_offload*.py``) drive the tiers from
spawned ranks; here ``make mutate`` sees them.
"""

from __future__ import annotations

import errno
import os

import pytest
import torch

from paramfsm.engine.storage import tiers
from paramfsm.engine.storage.tiers import ALIGN, DiskTier, HostTier, RehearsalTier, Slot
from paramfsm.errors import OffloadError

VALUES = {
    "w": torch.arange(10, dtype=torch.float32) / 3,
    "m": torch.tensor([1 / 3, -2.25, 1e-300], dtype=torch.float64),  # not exact in float32
    "b": torch.arange(7, dtype=torch.bfloat16),
    "i": torch.arange(5000, dtype=torch.int16),
}


@pytest.fixture
def disk(tmp_path):
    """``disk(rank=0)``: a disk tier in the test's folder, closed (its file removed) after the test."""
    made = []

    def make(rank: int = 0):
        made.append(DiskTier(tmp_path, rank))
        return made[-1]
    yield make
    for tier in made:
        tier.close()


def _round_trip(tier) -> None:
    slots = {key: tier.place(key, value, f"p.{key}") for key, value in VALUES.items()}
    for version, (key, value) in enumerate(VALUES.items()):
        tier.write(slots[key], value, version, f"p.{key}")
        assert slots[key].version == version
    for key, value in VALUES.items():  # read after every write: no slot overlaps another
        out = torch.full_like(value, 9)
        tier.read(slots[key], out, f"p.{key}")
        assert torch.equal(out, value), key


def test_a_new_slot_is_unwritten():
    assert Slot(8).version == -1 and Slot(8).offset == 0 and Slot(8).host is None


def test_host_tier_copies_come_back_bit_for_bit_and_count_their_bytes():
    tier = HostTier(rank=1, pin_memory=False)
    assert tier.where == "cpu" and not tier.pin and tier.nbytes == 0
    _round_trip(tier)
    assert tier.nbytes == sum(v.numel() * v.element_size() for v in VALUES.values())
    assert tier.place("w", VALUES["w"], "p.w") is tier.place("w", torch.zeros(10), "p.w")
    tier.close()
    assert tier.slots == {} and tier.nbytes == 0


def test_host_tier_keeps_its_own_copy():
    tier = HostTier(0, pin_memory=False)
    value = torch.ones(4)
    slot = tier.place("k", value, "x")
    tier.write(slot, value, 3, "x")
    value.add_(1)
    out = torch.zeros(4)
    tier.read(slot, out, "x")
    assert out.tolist() == [1.0] * 4


def test_a_value_that_changed_size_is_refused_naming_it():
    for tier in (HostTier(0, pin_memory=False), RehearsalTier("disk", 0)):
        tier.place("k", torch.zeros(4), "layer.weight")
        with pytest.raises(OffloadError) as caught:
            tier.place("k", torch.zeros(5), "layer.weight")
        assert str(caught.value).startswith("'layer.weight' now has 20 bytes, but its offload slot holds 16: ")
        assert "What to do: keep shapes and dtypes of offloaded parameters and optimizer state fixed" in str(
            caught.value)
        with pytest.raises(OffloadError):
            tier.place("k", torch.zeros(4, dtype=torch.float64), "layer.weight")


def test_a_rehearsal_tier_counts_sizes_and_versions_and_allocates_nothing():
    tier = RehearsalTier("disk", 2)
    assert tier.where == "disk" and tier.rank == 2
    meta = torch.empty(1000, dtype=torch.float16, device="meta")
    slot = tier.place("k", meta, "x")
    assert slot.host is None and slot.nbytes == 2000 and tier.nbytes == 2000
    tier.reserve(1 << 40, "x")
    tier.write(slot, meta, 4, "x")
    tier.read(slot, meta, "x")
    assert slot.version == 4 and tier.nbytes == 2000


def test_disk_tier_round_trip_with_page_aligned_slots(tmp_path):
    tier = DiskTier(tmp_path / "nested" / "dir", rank=3, first_owner="p.w")
    assert tier.where == "disk" and tier.path.parent == tmp_path / "nested" / "dir"
    assert tier.path.name.startswith("paramfsm-offload-rank3-")
    _round_trip(tier)
    offsets = [tier.slots[key].offset for key in VALUES]
    assert offsets == [0, ALIGN, 2 * ALIGN, 3 * ALIGN]  # the int16 one holds 10000 bytes: three pages
    assert tier.nbytes == 3 * ALIGN + 3 * ALIGN
    assert os.path.getsize(tier.path) == tier.nbytes
    assert tier.place("w", VALUES["w"], "p.w") is tier.slots["w"]
    tier.close()
    assert not tier.path.exists() and tier.slots == {} and tier.fd == -1
    tier.close()  # a second close is harmless


def test_disk_tier_reserves_past_its_slots(disk):
    tier = disk()
    tier.place("a", torch.zeros(3), "a")
    tier.reserve(3 * ALIGN, "later")
    assert os.path.getsize(tier.path) == 4 * ALIGN
    assert tier.nbytes == ALIGN  # reserved space is not a slot's
    tier.reserve(0, "nothing")
    assert os.path.getsize(tier.path) == 4 * ALIGN
    empty = tier.place("e", torch.zeros(0), "e")
    assert empty.nbytes == 0 and empty.offset == ALIGN and tier.nbytes == ALIGN


def test_disk_tier_carries_on_after_short_writes_and_reads(monkeypatch, disk):
    tier = disk()
    pwrite, preadv = os.pwrite, os.preadv
    calls = {"write": 0, "read": 0}

    def short_pwrite(fd, data, offset):
        calls["write"] += 1
        return pwrite(fd, data[:3], offset)

    def short_preadv(fd, buffers, offset):
        calls["read"] += 1
        return preadv(fd, [buffers[0][:5]], offset)

    value = torch.arange(6, dtype=torch.float32)
    slot = tier.place("k", value, "k")
    monkeypatch.setattr(tiers.os, "pwrite", short_pwrite)
    tier.write(slot, value, 1, "k")
    monkeypatch.setattr(tiers.os, "preadv", short_preadv)
    out = torch.zeros(6)
    tier.read(slot, out, "k")
    assert torch.equal(out, value)
    assert calls == {"write": 8, "read": 5}  # 24 bytes, 3 at a time and 5 at a time


def test_a_disk_that_takes_nothing_more_fails_the_write_keeping_the_working_copy(monkeypatch, disk):
    tier = disk(1)
    value = torch.ones(8)
    slot = tier.place("k", value, "blocks.0.weight")
    writes = iter([4, 0])
    monkeypatch.setattr(tiers.os, "pwrite", lambda fd, data, offset: next(writes))
    with pytest.raises(OffloadError) as caught:
        tier.write(slot, value, 1, "blocks.0.weight")
    message = str(caught.value)
    assert message.startswith(f"could not write 32 bytes of 'blocks.0.weight' (rank 1) in the offload file "
                              f"'{tier.path}': no space left on device. ")
    assert "The working copy is kept, so no value is lost or stale. What to do: free space there or choose " \
           "a folder on a larger disk (paramfsm.Offload(path=...))." in message
    assert slot.version == -1


def test_a_file_that_ends_early_fails_the_read(monkeypatch, disk):
    tier = disk()
    slot = tier.place("k", torch.ones(8), "opt.exp_avg")
    monkeypatch.setattr(tiers.os, "preadv", lambda fd, buffers, offset: 0)
    with pytest.raises(OffloadError) as caught:
        tier.read(slot, torch.zeros(8), "opt.exp_avg")
    message = str(caught.value)
    assert message.startswith(f"could not read 32 bytes of 'opt.exp_avg' (rank 0) in the offload file "
                              f"'{tier.path}': the offload file ended early. The working copy is kept")
    assert "What to do: check the folder and its disk (paramfsm.Offload(path=...) chooses another)." in message


@pytest.mark.parametrize("code, full", [(errno.ENOSPC, True), (errno.EDQUOT, True), (errno.EIO, False)])
def test_a_full_disk_fails_at_placement_with_nothing_written(monkeypatch, disk, code, full):
    tier = disk()

    def refuse(fd, offset, length):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(tiers.os, "posix_fallocate", refuse)
    with pytest.raises(OffloadError) as caught:
        tier.place("k", torch.ones(8), "emb.weight")
    message = str(caught.value)
    assert message.startswith(f"could not reserve 32 bytes of 'emb.weight' (rank 0) in the offload file "
                              f"'{tier.path}': {os.strerror(code)}. Nothing was written to it. What to do: ")
    assert ("free space there" in message) == full
    assert tier.slots == {} and tier.nbytes == 0
    with pytest.raises(OffloadError, match="could not reserve 4096 bytes of 'step'"):
        tier.reserve(ALIGN, "step")


def test_a_folder_that_cannot_be_created_names_the_value_and_the_fix(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    with pytest.raises(OffloadError) as caught:
        DiskTier(blocker / "sub", 2, "head.weight")
    message = str(caught.value)
    assert message.startswith(f"cannot create the offload file for 'head.weight' (rank 2) in '{blocker / 'sub'}': "
                              "Not a directory. What to do:")
    assert "What to do: pass paramfsm.Offload(path=...) a folder this process can write" in message


def test_opening_a_folder_removes_files_runs_that_ended_left(tmp_path, caplog, disk):
    left = tmp_path / "paramfsm-offload-rank0-pid1-dead.bin"
    left.write_bytes(b"x" * 2 * ALIGN)
    with caplog.at_level("WARNING", logger="paramfsm.engine.storage.tiers"):
        disk()
    assert not left.exists()
    assert [r.getMessage() for r in caplog.records] == [
        f"rank 0 removed 1 offload file(s), 8192 bytes, that runs which ended without closing left in {tmp_path}"]
