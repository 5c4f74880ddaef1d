"""What a sharded model reports and starts from, on 2 gloo ranks, against plain torch.

* ``p.nbytes`` of a parameter at rest answers for the full (logical) tensor,
  as ``p.shape`` and ``p.numel()`` do (like a DTensor), in fp32 and bf16, before
  and after a training step: memory estimates written as
  ``sum(p.nbytes for p in model.parameters())`` stay right after ``shard``.
* ``shard(model, sync_module_states=True)`` broadcasts rank 0's buffers as well
  as its parameters (as DDP and FSDP do): BatchNorm running statistics set
  differently on each rank become rank 0's, and the model then trains like
  plain torch started from rank 0's state.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

import paramfsm
from paramfsm.testing import rank_slice


def sizes(model: nn.Module) -> dict[str, tuple]:
    """(nbytes, numel, shape, nbytes of .data) of every parameter, as a user reads them."""
    return {n: (p.nbytes, p.numel(), tuple(p.shape), p.data.nbytes) for n, p in model.named_parameters()}


def nbytes_job(rank, world):
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 7), nn.Linear(7, 3)).to(dtype)  # 35 and 21 elements: uneven shards
        plain = sizes(model)
        rt = paramfsm.shard(model)
        at_rest = sizes(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(4, 5, dtype=dtype)).sum().backward()
        opt.step()
        after_step = sizes(model)
        shard_bytes = {n: rt.record(n).shard.nbytes for n, _ in model.named_parameters()}
        out[str(dtype)] = (plain, at_rest, after_step, shard_bytes, sum(p.nbytes for p in model.parameters()))
        rt.close()
    return out


def test_nbytes_at_rest_is_the_full_size(ranks2):
    for rank, out in enumerate(ranks2.run(nbytes_job)):
        for dtype, (plain, at_rest, after_step, shard_bytes, total) in out.items():
            assert at_rest == plain, f"rank {rank}, {dtype}: (nbytes, numel, shape, data.nbytes) after shard " \
                                     f"{at_rest}, plain torch {plain}"
            assert after_step == plain, f"rank {rank}, {dtype}: after a step {after_step}, plain torch {plain}"
            assert total == sum(row[0] for row in plain.values()), (rank, dtype, total)
            assert all(shard_bytes[n] < plain[n][0] for n in plain), f"shards are not smaller: {shard_bytes}"


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 8)
        self.bn = nn.BatchNorm1d(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.relu(self.bn(self.lin(x))))


def set_running_stats(model: Net, seed: int) -> None:
    """Running statistics (and step count) of ``seed``'s own, as if trained apart on each rank."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.bn.running_mean.copy_(torch.randn(8, generator=gen))
        model.bn.running_var.copy_(torch.rand(8, generator=gen) + 0.5)
        model.bn.num_batches_tracked.fill_(10 + seed)


def buffers_job(rank, world):
    """Same parameters on every rank, running statistics by rank; eval-mode training uses those statistics."""
    torch.manual_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    set_running_stats(model, seed=100 + rank)
    set_running_stats(reference, seed=100)  # rank 0's state, on every rank
    rt = paramfsm.shard(model, sync_module_states=True)
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    want = {n: b.clone() for n, b in reference.named_buffers()}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    model.eval()  # BatchNorm normalises with the running statistics: the gradients depend on the buffers
    reference.eval()
    gen = torch.Generator().manual_seed(5)
    for _ in range(2):
        x = torch.randn(4 * world, 6, generator=gen)
        opt.zero_grad()
        ref_opt.zero_grad()
        model(rank_slice(x, rank, world)).pow(2).mean().backward()
        reference(x).pow(2).mean().backward()
        opt.step()
        ref_opt.step()
    worst = max(float((rt.full_param(n) - p).abs().max()) for n, p in reference.named_parameters())
    rt.close()
    return buffers, want, worst


def test_sync_module_states_broadcasts_buffers(ranks2):
    results = ranks2.run(buffers_job)
    for rank, (buffers, want, _) in enumerate(results):
        for name, value in want.items():
            assert torch.equal(buffers[name], value), \
                f"rank {rank}: buffer '{name}' after shard(sync_module_states=True) is {buffers[name].tolist()}, " \
                f"rank 0's is {value.tolist()}"
    for rank, (_, _, worst) in enumerate(results):
        assert worst < 1e-6, f"rank {rank}: parameters differ from plain torch started from rank 0's state by {worst}"
