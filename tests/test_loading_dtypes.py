"""Sliced loading of safetensors files of another dtype or layout, on 2 gloo ranks, against plain torch.

``load_pretrained`` reads each rank's slice of every tensor straight from the
file. A checkpoint stored in another dtype than the model's (bf16 weights into
an fp32 model, fp32 weights into a bf16 one) must load as transformers'
``from_pretrained`` loads it: the stored tensor converted with ``.to(dtype)``,
on every rank, for parameters (sharded) and buffers (whole) alike, whether the
model was built eagerly or on the meta device. A tensor with the right number
of elements but another shape (a transposed weight) must raise "Wrong shape"
on every rank, naming the parameter, and write nothing; so must a truncated
file ("is truncated", from the header and the file's size), where a short
read would fail only on the rank whose slice lies in the missing bytes.

Each rank job agrees on every load's outcome (one small all-gather of the
error messages) before it runs a collective, so a load that fails on one rank
only is reported as such instead of hanging the other rank.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

import paramfsm
from paramfsm import ParamFSMError

safetensors_torch = pytest.importorskip("safetensors.torch")
pytest.importorskip("transformers")


class Net(nn.Module):
    """Odd sizes (7 x 5 = 35 elements: uneven shards, padded), buffers of two dtypes, a bias-free head."""

    def __init__(self, dtype=None):
        super().__init__()
        self.lin1 = nn.Linear(5, 7, dtype=dtype)
        self.norm = nn.LayerNorm(7, dtype=dtype)
        self.bn = nn.BatchNorm1d(7, dtype=dtype)
        self.head = nn.Linear(7, 3, bias=False, dtype=dtype)

    def forward(self, x):
        return self.head(self.bn(torch.relu(self.norm(self.lin1(x)))))


def inputs(dtype) -> torch.Tensor:
    return torch.randn(4, 5, generator=torch.Generator().manual_seed(7)).to(dtype)


def checkpoint(dtype) -> dict[str, torch.Tensor]:
    """A state dict of ``Net`` whose values are all non-trivial (not representable exactly in bf16)."""
    gen = torch.Generator().manual_seed(11)
    state = {k: torch.randn(v.shape, generator=gen, dtype=torch.float64).to(dtype) if v.is_floating_point()
             else torch.tensor(5, dtype=v.dtype) for k, v in Net().state_dict().items()}
    state["bn.running_var"] = state["bn.running_var"].abs() + 0.5
    return state


def _load(rt, directory) -> tuple[str | None, list]:
    """``load_pretrained`` on this rank: (its error message or None, every rank's, in rank order).

    Collective (one all-gather of strings), so that no rank goes on to a collective while another failed.
    """
    from paramfsm.integrations.hf import load_pretrained

    try:
        load_pretrained(rt, directory)
        mine = None
    except ParamFSMError as exc:
        mine = str(exc)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return mine, everyone


def _values(rt, model) -> dict[str, torch.Tensor]:
    """Every parameter (gathered, collective) and buffer of the sharded model, by state-dict key."""
    out = {name: rt.full_param(name) for name, _ in model.named_parameters()}
    out.update({name: b.detach().clone() for name, b in model.named_buffers()})
    return out


def dtypes_job(rank, world, root):
    """Three loads of another dtype (eager and meta-built), one of a transposed weight, one of a truncated file."""
    out = {"loads": {}}
    for case, model_dtype, build_on_meta in (("bf16", torch.float32, False), ("bf16", torch.float32, True),
                                             ("fp32", torch.bfloat16, True)):
        torch.manual_seed(0)
        if build_on_meta:
            with torch.device("meta"):
                model = Net(model_dtype)
        else:
            model = Net(model_dtype)
        rt = paramfsm.shard(model)
        what = f"{case} file into a {'meta-built' if build_on_meta else 'eager'} {model_dtype} model"
        error, everyone = _load(rt, os.path.join(root, case))
        if not any(everyone):
            model.eval()
            with torch.no_grad():
                out["loads"][what] = (None, _values(rt, model), model(inputs(model_dtype)))
        else:
            out["loads"][what] = (error or f"only other ranks failed: {everyone}", None, None)
        rt.close()

    torch.manual_seed(0)
    model = Net()
    rt = paramfsm.shard(model)
    before = _values(rt, model)
    error, everyone = _load(rt, os.path.join(root, "transposed"))
    kept = torch.equal(before["lin1.weight"], rt.full_param("lin1.weight")) if all(everyone) else None
    out["transposed"] = (error, everyone, kept)
    out["truncated"] = _load(rt, os.path.join(root, "truncated"))
    rt.close()
    return out


def test_load_of_another_dtype_converts_like_plain_torch_and_transposed_raises(ranks2, tmp_path):
    for case, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        os.makedirs(tmp_path / case)
        safetensors_torch.save_file(checkpoint(dtype), str(tmp_path / case / "model.safetensors"))
    transposed = checkpoint(torch.float32)
    transposed["lin1.weight"] = transposed["lin1.weight"].t().contiguous()  # [5, 7]: 35 elements, wrong shape
    os.makedirs(tmp_path / "transposed")
    safetensors_torch.save_file(transposed, str(tmp_path / "transposed" / "model.safetensors"))
    os.makedirs(tmp_path / "truncated")
    whole = (tmp_path / "fp32" / "model.safetensors").read_bytes()
    (tmp_path / "truncated" / "model.safetensors").write_bytes(whole[:-6])  # the last tensor loses its tail

    expected = {}
    for case, model_dtype in (("bf16", torch.float32), ("fp32", torch.bfloat16)):
        stored = safetensors_torch.load_file(str(tmp_path / case / "model.safetensors"))
        plain = Net(model_dtype)
        own = plain.state_dict()
        converted = {k: v.to(own[k].dtype) for k, v in stored.items()}
        plain.load_state_dict(converted)
        plain.eval()
        with torch.no_grad():
            expected[(case, model_dtype)] = (converted, plain(inputs(model_dtype)))

    for rank, out in enumerate(ranks2.run(dtypes_job, str(tmp_path))):
        assert len(out["loads"]) == 3, out["loads"].keys()
        for what, (error, values, logits) in out["loads"].items():
            assert error is None, f"rank {rank}, {what}: the load raised: {error}"
            want, want_logits = expected[(what.split()[0], torch.bfloat16 if "bfloat16" in what else torch.float32)]
            for key, value in want.items():
                got = values[key]
                assert got.dtype == value.dtype, f"rank {rank}, {what}: '{key}' is {got.dtype}, not {value.dtype}"
                assert torch.equal(got, value), \
                    f"rank {rank}, {what}: '{key}' differs from load_file(...)['{key}'].to({value.dtype})"
            assert torch.equal(logits, want_logits), f"rank {rank}, {what}: the forward differs from plain torch"
        error, everyone, kept = out["transposed"]
        assert error is not None, f"rank {rank}: a transposed lin1.weight (35 elements, [5, 7]) loaded without " \
                                  f"error; every rank: {everyone}"
        assert "Wrong shape" in error and "'lin1.weight' is [5, 7]" in error and "is [7, 5]" in error, error
        assert f"(rank {rank})" in error and "nothing was loaded" in error, error
        assert all(everyone), f"rank {rank}: not every rank raised: {everyone}"
        assert kept, f"rank {rank}: the failed load changed lin1.weight"
        error, everyone = out["truncated"]
        assert all(everyone), f"rank {rank}: a truncated file did not raise on every rank: {everyone}"
        assert "is truncated" in error and "'norm.weight'" in error and f"(rank {rank})" in error, error


def test_a_header_that_disagrees_with_its_byte_ranges_raises(tmp_path):
    """A header whose shape does not fit its tensor's bytes is refused before any read (on every rank alike)."""
    import json
    import struct

    from paramfsm.integrations.safetensors_slices import headers

    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file(checkpoint(torch.float32), str(path))
    data = path.read_bytes()
    size = struct.unpack("<Q", data[:8])[0]
    table = json.loads(data[8:8 + size])
    table["norm.weight"]["shape"] = [8]  # 7 float32 values stored, 8 claimed
    header = json.dumps(table, separators=(",", ":")).encode().ljust(size)
    assert len(header) == size
    path.write_bytes(data[:8] + header + data[8 + size:])
    with pytest.raises(ParamFSMError, match=r"is damaged: its header gives tensor 'norm.weight' \(F32, \[8\]\) "
                                            r"28 bytes, where that dtype and shape take 32 \(rank 3\)"):
        headers([str(path)], rank=3)
