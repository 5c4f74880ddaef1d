"""Torch's own ``opt.load_state_dict`` under offload: the loaded state is what the next step uses.

A loop that rolls back a bad step keeps ``copy.deepcopy(opt.state_dict())`` and loads it later. The load
replaces the optimizer's state tensors; under offload the backward's last unit pages in the first unit's
step values ahead of use, and before [Note: a placement stands for the tensors it was made for] that
page-in read the old tier copy into the new tensors: the step ran on the replaced state, with no error.
Each case trains like plain torch.
"""

from __future__ import annotations

import copy

import pytest
import torch

import paramfsm


@pytest.fixture(scope="module")
def ranks2(in_process2):
    """This file's two ranks are threads of the test process (``gloo_ranks.py``), where ``make mutate`` sees
    them; a test that needs processes of its own asks for ``suite_ranks2``."""
    return in_process2


PLACEMENTS = {"optimizer": dict(optimizer="disk"), "params and optimizer": dict(params="disk", optimizer="disk"),
              "everything on cpu": dict(params="cpu", grads="cpu", optimizer="cpu")}


def _build():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))


def _roll_back(model, opt, batches, rank=0, world=1, scale=1.0):
    """Step, keep the optimizer's state, step, load it back, step (each rank on its slice of the batch)."""
    def iteration(x):
        opt.zero_grad()
        (model(x.chunk(world)[rank]).pow(2).sum() * scale).backward()
        opt.step()
    iteration(batches[0])
    kept = copy.deepcopy(opt.state_dict())
    iteration(batches[1])
    opt.load_state_dict(kept)
    iteration(batches[2])


def reload_job(rank, world, folder, placement):
    torch.manual_seed(1)
    batches = [torch.randn(4, 8) for _ in range(3)]
    model = _build()
    rt = paramfsm.shard(model, offload=paramfsm.Offload(path=folder, **PLACEMENTS[placement]))
    _roll_back(model, torch.optim.Adam(model.parameters(), lr=0.1), batches, rank, world)
    out = rt.full_state_dict()
    rt.close()
    return out, batches


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_a_state_loaded_by_opt_load_state_dict_is_the_one_the_next_step_uses(ranks2, tmp_path, placement):
    for got, batches in ranks2.run(reload_job, str(tmp_path / "tier"), placement):
        reference = _build()
        reference_opt = torch.optim.Adam(reference.parameters(), lr=0.1)
        # paramfsm averages the ranks' gradients: plain torch's loss is the whole batch's over the world size.
        _roll_back(reference, reference_opt, batches, scale=1 / 2)
        for key, value in reference.state_dict().items():
            torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)
