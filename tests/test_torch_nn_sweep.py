"""Every parameterised module of ``torch.nn``, under the default units, trains 3 steps on 2 gloo ranks
like plain torch on the global batch: with one unit per parameter-owning module (``min_unit_bytes=0``,
as in the rest of the suite) and with the real default (64 KiB: these modules are smaller, so the whole
model is the root unit).

One job on the shared rank pool runs every case (spawning is what costs); the
parametrised test reads its result. Each module sits inside a wrapper with no
parameters of its own, so the root is a unit that owns nothing, as in most
models. BatchNorm normalises with each rank's own batch and keeps running
statistics per rank, as under DDP: its reference averages the gradients of
the ranks' local batches, and its running statistics equal a plain module's
fed this rank's batch. ``nn.Embedding(max_norm=...)`` cannot work (it
renormalises rows of a gathered copy in place) and is refused at ``shard``.
"""

from __future__ import annotations

import copy
import traceback

import pytest
import torch
from patterns_common import Pair
from torch import nn

import paramfsm
from paramfsm.engine.storage.default_units import MIN_UNIT_BYTES
from paramfsm.testing import rank_slice

N = 4  # rows per rank
#: ``min_unit_bytes`` of each pass: one unit per module, and the real default.
SETTINGS = (0, MIN_UNIT_BYTES)


def _floats(*shape):
    return lambda gen, world: (torch.randn(N * world, *shape, generator=gen),)


def _tokens(*shape, vocab=10):
    return lambda gen, world: (torch.randint(0, vocab, (N * world, *shape), generator=gen),)


def _pair_of(a, b):
    return lambda gen, world: (torch.randn(N * world, *a, generator=gen), torch.randn(N * world, *b, generator=gen))


def _lazy_linear():
    lazy = nn.LazyLinear(4)
    lazy(torch.zeros(1, 6))  # materialised: a lazy module must have run once before shard
    return lazy


def _transformer_layer(decoder=False):
    cls = nn.TransformerDecoderLayer if decoder else nn.TransformerEncoderLayer
    return cls(8, 2, dim_feedforward=16, dropout=0.0, batch_first=True)


#: name -> (module factory, inputs(generator, world), per-rank batch statistics)
CASES = {
    "Linear": (lambda: nn.Linear(6, 4), _floats(6), False),
    "Bilinear": (lambda: nn.Bilinear(6, 5, 4), _pair_of((6,), (5,)), False),
    "LazyLinear": (_lazy_linear, _floats(6), False),
    "Conv1d": (lambda: nn.Conv1d(3, 4, 3), _floats(3, 8), False),
    "Conv2d": (lambda: nn.Conv2d(3, 4, 3), _floats(3, 6, 6), False),
    "Conv3d": (lambda: nn.Conv3d(2, 3, 3), _floats(2, 4, 4, 4), False),
    "ConvTranspose1d": (lambda: nn.ConvTranspose1d(3, 4, 3), _floats(3, 6), False),
    "ConvTranspose2d": (lambda: nn.ConvTranspose2d(3, 4, 3), _floats(3, 4, 4), False),
    "ConvTranspose3d": (lambda: nn.ConvTranspose3d(2, 3, 2), _floats(2, 3, 3, 3), False),
    "Embedding": (lambda: nn.Embedding(10, 6, padding_idx=0), _tokens(5), False),
    "EmbeddingBag": (lambda: nn.EmbeddingBag(10, 6, mode="mean"), _tokens(4), False),
    "RNN": (lambda: nn.RNN(6, 5, batch_first=True), _floats(3, 6), False),
    "LSTM": (lambda: nn.LSTM(6, 5, num_layers=2, batch_first=True), _floats(3, 6), False),
    "GRU": (lambda: nn.GRU(6, 5, batch_first=True, bidirectional=True), _floats(3, 6), False),
    "MultiheadAttention": (lambda: nn.MultiheadAttention(8, 2, batch_first=True), _floats(3, 8), False),
    "TransformerEncoderLayer": (_transformer_layer, _floats(3, 8), False),
    "TransformerDecoderLayer": (lambda: _transformer_layer(decoder=True), _pair_of((3, 8), (4, 8)), False),
    "TransformerEncoder": (lambda: nn.TransformerEncoder(_transformer_layer(), 2, enable_nested_tensor=False),
                           _floats(3, 8), False),
    "TransformerDecoder": (lambda: nn.TransformerDecoder(_transformer_layer(decoder=True), 2),
                           _pair_of((3, 8), (4, 8)), False),
    "Transformer": (lambda: nn.Transformer(8, 2, 1, 1, 16, dropout=0.0, batch_first=True),
                    _pair_of((3, 8), (4, 8)), False),
    "LayerNorm": (lambda: nn.LayerNorm(6), _floats(3, 6), False),
    "GroupNorm": (lambda: nn.GroupNorm(2, 4), _floats(4, 5), False),
    "RMSNorm": (lambda: nn.RMSNorm(6), _floats(3, 6), False),
    "PReLU": (lambda: nn.PReLU(4), _floats(4, 3), False),
    "BatchNorm1d": (lambda: nn.BatchNorm1d(6), _floats(6), True),
    "BatchNorm2d": (lambda: nn.BatchNorm2d(3), _floats(3, 4, 4), True),
}


class Wrap(nn.Module):
    """The module under test inside a parent that owns no parameters; the first output is the result."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, *inputs):
        if isinstance(self.module, nn.MultiheadAttention):
            inputs = inputs * 3  # self-attention: query, key and value
        out = self.module(*inputs)
        return out[0] if isinstance(out, tuple) else out


def _case(name: str, rank: int, world: int, min_unit_bytes: int) -> str:
    build, inputs, per_rank = CASES[name]
    torch.manual_seed(0)
    model = Wrap(build())
    local_stats = copy.deepcopy(model.module) if per_rank else None
    pair = Pair(model, rank, world, min_unit_bytes=min_unit_bytes)
    if min_unit_bytes:
        assert len(pair.rt.units) == 1, f"{name}: {pair.rt.describe_units()}"
    for step in range(3):
        batch = inputs(torch.Generator().manual_seed(step), world)
        mine = [rank_slice(t, rank, world) for t in batch]
        pair.zero_grad()
        pair.model(*mine).float().pow(2).mean().backward()
        if per_rank:  # as under DDP: each rank's batch statistics, gradients averaged over ranks
            loss = sum(pair.ref.model(*[rank_slice(t, r, world) for t in batch]).pow(2).mean()
                       for r in range(world)) / world
            local_stats(*mine)
        else:
            loss = pair.ref.model(*batch).float().pow(2).mean()
        loss.backward()
        pair.check_grads(f"{name} step {step}", atol=1e-5)
        pair.step(f"{name} step {step}")
    if per_rank:
        for buffer, want in zip(pair.model.module.buffers(), local_stats.buffers()):
            assert torch.equal(buffer, want), f"{name}: running statistics differ from this rank's own"
    pair.finish()
    return "ok"


def sweep_job(rank, world):
    results = {}
    for name in CASES:
        for min_unit_bytes in SETTINGS:
            try:
                results[name, min_unit_bytes] = _case(name, rank, world, min_unit_bytes)
            except Exception:  # noqa: BLE001 - reported per case by the test
                results[name, min_unit_bytes] = traceback.format_exc(limit=-4)
    try:
        paramfsm.shard(Wrap(nn.Embedding(10, 6, max_norm=1.0)))
        results["max_norm"] = "no error"
    except paramfsm.ParamFSMError as exc:
        results["max_norm"] = str(exc)
    return results


@pytest.fixture(scope="module")
def sweep(ranks2):
    return ranks2.run(sweep_job, timeout=300)


@pytest.mark.parametrize("min_unit_bytes", SETTINGS, ids=["per-module", "default"])
@pytest.mark.parametrize("name", list(CASES))
def test_torch_nn_module_trains_like_plain_torch(sweep, name, min_unit_bytes):
    for rank, results in enumerate(sweep):
        got = results[name, min_unit_bytes]
        assert got == "ok", f"rank {rank}:\n{got}"


def test_embedding_max_norm_is_refused(sweep):
    for results in sweep:
        message = results["max_norm"]
        assert "'module'" in message and "max_norm" in message and "renorm" in message, message
