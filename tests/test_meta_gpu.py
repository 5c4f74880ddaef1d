"""A model built on the meta device, sharded with ``device="cuda"`` and initialised there (``make gpu-check``).

``rt.init_weights()`` draws from the CUDA generator of the shards' device, as
``reset_parameters()`` of the same model on that device does: the parameters
must be bit-identical. Skipped without a CUDA device.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paramfsm.verify.launch import RankPool

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def build() -> nn.Module:
    model = nn.Sequential(nn.Embedding(13, 7), nn.Linear(7, 9), nn.LayerNorm(9), nn.Linear(9, 13, bias=False))
    return model


def meta_job(rank, world):
    import paramfsm

    with torch.device("meta"):
        model = build()
    rt = paramfsm.shard(model, device="cuda")
    torch.manual_seed(5)
    rt.init_weights()
    got = {n: rt.full_param(n).cpu() for n, _ in model.named_parameters()}
    devices = {rec.shard.device.type for rec in rt._by_id.values()}
    rt.close()
    plain = build().to("cuda")
    torch.manual_seed(5)
    with torch.no_grad():
        for module in plain.modules():
            if callable(getattr(module, "reset_parameters", None)):
                module.reset_parameters()
    return got, {n: p.detach().cpu() for n, p in plain.named_parameters()}, devices


def test_meta_build_initialises_on_the_gpu_like_plain_torch():
    with RankPool(1, timeout=300, device="cuda") as pool:
        got, want, devices = pool.run(meta_job)[0]
    assert devices == {"cuda"}
    for name, value in want.items():
        assert torch.equal(got[name], value), f"{name}: init_weights on CUDA differs from plain init"
