"""A full disk at the first offloaded optimizer step changes nothing, on every rank, and the step can be retried.

Under ``Offload(optimizer="disk")`` the optimizer state is created by the first ``step()``. Its tier space
was reserved unit by unit as the step went, so a disk that filled there raised after some units had stepped
(parameters neither as they were nor one step on), left state no later step could page, and the rank whose disk
had room stepped on alone. Now the space is reserved before any unit steps and the ranks agree
(see [Note: a first step that cannot finish changes nothing] in ``paramfsm.optim.step_space``).
"""

from __future__ import annotations

import errno
import os

import pytest
import torch

import paramfsm
from paramfsm.errors import OffloadError
from paramfsm.testing.models import mlp

STEPS = 3


def _model():
    torch.manual_seed(0)
    return mlp(width=16, depth=4, d_in=8, d_out=4)


def _batch(step):
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 + step))


def _full(fd, offset, length):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def full_disk_job(rank, world, folder, full_on):
    """Train STEPS steps with AdamW; the first step's disk is full on the ranks in ``full_on``, then freed."""
    model = _model()
    rt = paramfsm.shard(model, offload=paramfsm.Offload(optimizer="disk", path=folder)) if world else None
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    calls = []
    opt.register_step_pre_hook(lambda *args: calls.append("pre"))
    refused = None
    for step in range(STEPS):
        x = _batch(step).chunk(max(world, 1))[rank]
        model(x).pow(2).mean().backward()
        if step == 0 and world:
            before = {k: v.clone() for k, v in rt.full_state_dict().items()}
            real = os.posix_fallocate
            if rank in full_on:
                os.posix_fallocate = _full
            try:
                opt.step()
            except OffloadError as exc:
                refused = str(exc)
            finally:
                os.posix_fallocate = real
            after = rt.full_state_dict()
            unchanged = all(torch.equal(after[k], before[k]) for k in before)
            if refused is not None:
                refused = (refused, unchanged, len(opt.state), list(calls))
                opt.step()  # the retry, once there is room
        else:
            opt.step()
        opt.zero_grad()
    full = rt.full_state_dict() if rt is not None else model.state_dict()
    if rt is not None:
        rt.close()
    return refused, {k: v.clone() for k, v in full.items()}


@pytest.mark.parametrize("full_on", [(0,), (0, 1)], ids=["one-rank", "every-rank"])
def test_a_full_disk_at_the_first_step_changes_nothing_and_a_retry_matches_plain_torch(ranks2, tmp_path, full_on):
    _, plain = full_disk_job(0, 0, None, ())
    for rank, (refused, full) in enumerate(ranks2.run(full_disk_job, str(tmp_path), full_on, timeout=120)):
        assert refused is not None, f"rank {rank} stepped while a rank's disk was full"
        message, unchanged, states, calls = refused
        assert "No space left on device" in message and "rank 0" in message and "Nothing was stepped" in message, \
            message
        if rank in full_on:
            assert unchanged, f"rank {rank}: the refused step changed parameters"
        assert states == 0, f"rank {rank}: the refused step created optimizer state for {states} parameters"
        assert calls == [], f"rank {rank}: the refused step ran the optimizer's pre-hook"
        for key, want in plain.items():
            torch.testing.assert_close(full[key], want, atol=1e-6, rtol=1e-5, msg=f"rank {rank}: {key}")
