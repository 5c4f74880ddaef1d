"""Sliced safetensors loading (:mod:`paramfsm.integrations.safetensors_slices`) run in the test process.

The files are written by ``safetensors.torch.save_file`` (or by hand, for the
damaged ones), and what the sharded model holds afterwards is compared with
the file's own tensors as ``safetensors.torch.load_file`` reads them, converted
as ``tensor.to(dtype)`` converts them. The headers are checked before any
value is written: every refused load leaves the model's values as they were.
Everything runs as rank 0 of a one-rank group (:mod:`one_rank`).
"""

from __future__ import annotations

import io
import json
import logging
import struct

import pytest
import torch
from one_rank import one_rank  # noqa: F401  (fixture)
from safetensors.torch import load_file, save_file
from torch import nn

import paramfsm
from paramfsm.errors import ParamFSMError
from paramfsm.integrations import safetensors_slices
from paramfsm.integrations.safetensors_slices import DTYPES, Entry, headers, load_files, read


class Tied(nn.Module):
    """A linear layer, a batch norm (persistent float and integer buffers) and an output tied to the input."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.mid = nn.Linear(4, 6)
        self.out = nn.Linear(4, 4, bias=False)
        self.out.weight = self.inp.weight
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def forward(self, x):
        return self.out(self.norm(self.inp(x))).sum() + self.mid(x).sum()


def _model(seed: int = 0) -> Tied:
    torch.manual_seed(seed)
    return Tied()


def _checkpoint(seed: int = 1, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Another model's state dict, with distinct buffer values, the tied weight under its first key only."""
    state = {k: v.clone() for k, v in _model(seed).state_dict().items() if k != "out.weight"}
    state["norm.running_mean"] = torch.arange(4.0) + 0.5
    state["norm.running_var"] = torch.arange(4.0) + 2.0
    state["norm.num_batches_tracked"] = torch.tensor(7)
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}


def _state(rt) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in rt.full_state_dict().items()}


def _write(path, tensors: dict[str, torch.Tensor]) -> str:
    save_file(tensors, str(path))
    return str(path)


def _write_raw(path, table: dict, data: bytes) -> str:
    """A file in the safetensors layout (8-byte length, JSON header, data) from a header table given by hand."""
    header = json.dumps(table).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return str(path)


def _expect_file(rt, tensors: dict[str, torch.Tensor], dtype=torch.float32) -> None:
    """The model holds ``tensors`` (the tied weight under both keys), each converted to the model's dtype."""
    got = _state(rt)
    want = dict(tensors, **{"out.weight": tensors["inp.weight"]})
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    for key, value in want.items():
        expected = value.to(dtype) if value.is_floating_point() else value
        assert got[key].dtype == expected.dtype and torch.equal(got[key], expected), key


def test_a_file_loads_every_parameter_and_persistent_buffer(one_rank, tmp_path):
    model = _model()
    rt = paramfsm.shard(model)
    tensors = _checkpoint()
    load_files(rt, [_write(tmp_path / "model.safetensors", tensors)], "ckpt")
    _expect_file(rt, load_file(str(tmp_path / "model.safetensors")))
    assert torch.equal(model.norm.running_mean, torch.arange(4.0) + 0.5)
    assert int(model.norm.num_batches_tracked) == 7
    # The loaded model computes what plain torch computes with the file's values.
    ref = _model(5)
    ref.load_state_dict(dict(tensors, **{"out.weight": tensors["inp.weight"]}))
    x = torch.randn(3, 4)
    model.eval(), ref.eval()
    assert torch.allclose(model(x), ref(x))
    rt.detach()


def test_the_tensors_may_be_split_over_several_files(one_rank, tmp_path):
    rt = paramfsm.shard(_model())
    tensors = _checkpoint(seed=2)
    names = sorted(tensors)
    first = _write(tmp_path / "a.safetensors", {k: tensors[k] for k in names[:3]})
    second = _write(tmp_path / "b.safetensors", {k: tensors[k] for k in names[3:]})
    load_files(rt, [first, second], "split")
    _expect_file(rt, tensors)
    rt.detach()


def test_a_tied_parameter_loads_from_whichever_of_its_keys_the_file_holds(one_rank, tmp_path):
    rt = paramfsm.shard(_model())
    tensors = _checkpoint(seed=3)
    tensors["out.weight"] = tensors.pop("inp.weight")
    load_files(rt, [_write(tmp_path / "m.safetensors", tensors)], "tied")
    got = _state(rt)
    assert torch.equal(got["inp.weight"], tensors["out.weight"]) and torch.equal(got["out.weight"],
                                                                                 tensors["out.weight"])
    rt.detach()


@pytest.mark.parametrize("stored, model_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16),
                                                 (torch.float16, torch.float64)])
def test_another_dtype_is_converted_as_tensor_to_converts_it(one_rank, tmp_path, stored, model_dtype):
    rt = paramfsm.shard(_model().to(model_dtype))
    tensors = _checkpoint(seed=4, dtype=stored)
    load_files(rt, [_write(tmp_path / "m.safetensors", tensors)], "cast")
    _expect_file(rt, tensors, model_dtype)
    rt.detach()


def test_tensors_the_model_lacks_are_ignored_and_logged(one_rank, tmp_path, caplog):
    rt = paramfsm.shard(_model())
    unused = [f"extra.{i}" for i in range(6)]
    tensors = dict(_checkpoint(seed=5), **{name: torch.ones(2) for name in unused})
    with caplog.at_level(logging.INFO, logger="paramfsm.integrations.safetensors_slices"):
        load_files(rt, [_write(tmp_path / "m.safetensors", tensors)], "extra-dir")
    _expect_file(rt, {k: v for k, v in tensors.items() if k not in unused})
    assert [r.getMessage() for r in caplog.records] == [
        f"load of extra-dir: 6 tensors the model does not have are ignored: {unused[:5]}"]
    rt.detach()


def _refused(rt, files, where="bad-dir") -> str:
    """Load ``files``, expect ParamFSMError, check that no value changed; the message."""
    before = _state(rt)
    with pytest.raises(ParamFSMError) as info:
        load_files(rt, files, where)
    after = _state(rt)
    assert all(torch.equal(after[k], v) for k, v in before.items()), "a refused load wrote values"
    return str(info.value)


def test_a_missing_key_is_named_and_nothing_is_loaded(one_rank, tmp_path):
    rt = paramfsm.shard(_model())
    tensors = _checkpoint()
    del tensors["mid.bias"], tensors["inp.weight"]
    message = _refused(rt, [_write(tmp_path / "m.safetensors", tensors)])
    assert message == ("cannot load 'bad-dir' into the sharded Tied (rank 0); nothing was loaded. No tensor for: "
                       "['inp.weight / out.weight', 'mid.bias']. Check that the checkpoint was saved from this "
                       "model class and config (keys are the model's own state-dict keys)"), message
    rt.detach()


def test_a_wrong_shape_of_the_same_size_is_named_for_a_parameter_and_a_buffer(one_rank, tmp_path):
    rt = paramfsm.shard(_model())
    tensors = _checkpoint()
    tensors["mid.weight"] = tensors["mid.weight"].t().contiguous()
    tensors["norm.running_var"] = tensors["norm.running_var"].view(2, 2)
    message = _refused(rt, [_write(tmp_path / "m.safetensors", tensors)])
    assert message == ("cannot load 'bad-dir' into the sharded Tied (rank 0); nothing was loaded. Wrong shape: "
                       "[\"'norm.running_var' is [2, 2] in m.safetensors, the model's buffer is [4]\", "
                       "\"'mid.weight' is [4, 6] in m.safetensors, the model's parameter is [6, 4]\"]. Check that "
                       "the checkpoint was saved from this model class and config (keys are the model's own "
                       "state-dict keys)"), message
    rt.detach()


def test_the_first_five_problems_are_named(one_rank, tmp_path):
    rt = paramfsm.shard(_model())
    message = _refused(rt, [_write(tmp_path / "m.safetensors", {"unrelated": torch.ones(1)})])
    assert ("['inp.weight / out.weight', 'inp.bias', 'norm.weight', 'norm.bias', 'norm.running_mean']."
            in message), message
    assert "running_var" not in message, message
    flat = {k: v.reshape(-1, 1) for k, v in _checkpoint().items()}  # every tensor in a wrong shape
    message = _refused(rt, [_write(tmp_path / "flat.safetensors", flat)])
    assert message.count("in flat.safetensors") == 5 and "'norm.running_mean' is [4, 1]" in message, message
    rt.detach()


def test_a_load_while_parameters_are_gathered_is_refused_naming_them(one_rank, tmp_path):
    model = _model()
    rt = paramfsm.shard(model)
    path = _write(tmp_path / "m.safetensors", _checkpoint())
    with rt.gathered(model.mid):
        message = _refused(rt, [path], "busy-dir")
    assert message == ("cannot load 'busy-dir' while parameters are gathered: ['mid.weight', 'mid.bias']; "
                       "call it between iterations"), message
    with rt.gathered(model):
        message = _refused(rt, [path], "busy-dir")
    assert "gathered: ['inp.weight', 'inp.bias', 'norm.weight', 'norm.bias', 'mid.weight']; " in message, message
    load_files(rt, [path], "after")  # released: the same load goes through
    _expect_file(rt, _checkpoint())
    rt.detach()


def test_a_model_built_on_the_meta_device_is_guarded_until_loaded(one_rank, tmp_path):
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Tied()
    rt = paramfsm.shard(model, device="cpu")
    with pytest.raises(ParamFSMError):
        model(torch.randn(2, 4))
    tensors = _checkpoint(seed=6)
    load_files(rt, [_write(tmp_path / "m.safetensors", tensors)], "meta")
    _expect_file(rt, tensors)
    with pytest.raises(ParamFSMError, match=r"buffers \['scratch'\] were built on the meta device"):
        model(torch.randn(2, 4))  # a non-persistent buffer is in no checkpoint
    model.scratch.zero_()
    ref = Tied()
    ref.load_state_dict(dict(tensors, **{"out.weight": tensors["inp.weight"]}))
    x = torch.randn(3, 4)
    assert torch.allclose(model(x), ref(x))
    rt.detach()


# ---------------------------------------------------------------------- headers


def test_headers_give_each_tensors_place_and_skip_the_metadata(tmp_path):
    a, b = torch.arange(6, dtype=torch.float32).view(2, 3), torch.arange(5, dtype=torch.int16)
    path = str(tmp_path / "h.safetensors")
    save_file({"a": a, "b": b}, path, metadata={"format": "pt"})
    found = headers([path])
    assert set(found) == {"a", "b"}
    with open(path, "rb") as handle:
        size = struct.unpack("<Q", handle.read(8))[0]
        table = json.loads(handle.read(size))
    for key, tensor in (("a", a), ("b", b)):
        entry = found[key]
        assert entry == Entry(path, tuple(tensor.shape), tensor.dtype, 8 + size + table[key]["data_offsets"][0], key)
        with open(path, "rb") as handle:
            handle.seek(entry.offset)
            raw = handle.read(tensor.numel() * tensor.element_size())
        assert torch.equal(torch.frombuffer(bytearray(raw), dtype=tensor.dtype).view(tensor.shape), tensor)


def test_every_dtype_safetensors_writes_is_read_back_with_its_values(tmp_path):
    tensors = {name: (torch.arange(6) % 2).to(dtype).view(2, 3) for name, dtype in DTYPES.items()}
    path = _write(tmp_path / "dtypes.safetensors", tensors)
    with open(path, "rb") as handle:
        table = json.loads(handle.read(struct.unpack("<Q", handle.read(8))[0]))
    assert {key: info["dtype"] for key, info in table.items() if key != "__metadata__"} == \
        {name: name for name in DTYPES}  # each name is the one safetensors writes for that dtype
    found = headers([path])
    with open(path, "rb", buffering=0) as handle:
        for name, tensor in tensors.items():
            got = read(handle, found[name], 0, 6)
            assert got.dtype == tensor.dtype and torch.equal(got.view(torch.uint8), tensor.reshape(-1).view(
                torch.uint8)), name


def test_a_file_whose_header_does_not_parse_is_named(tmp_path):
    path = tmp_path / "junk.safetensors"
    path.write_bytes(struct.pack("<Q", 5) + b"{nope" + b"\0" * 8)
    with pytest.raises(ParamFSMError, match="junk.safetensors' is not a safetensors file"):
        headers([str(path)])


def test_an_unknown_dtype_is_named(tmp_path):
    path = _write_raw(tmp_path / "d.safetensors", {"w": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}},
                      b"\0")
    with pytest.raises(ParamFSMError) as info:
        headers([path])
    assert "tensor 'w' has dtype F4, which paramfsm cannot read" in str(info.value)


def test_a_byte_range_that_disagrees_with_dtype_and_shape_is_damage(tmp_path):
    path = _write_raw(tmp_path / "d.safetensors", {"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [8, 28]}},
                      b"\0" * 28)
    with pytest.raises(ParamFSMError) as info:
        headers([path], rank=3)
    assert str(info.value) == (f"'{path}' is damaged: its header gives tensor 'w' (F32, [2, 3]) 20 bytes, where that "
                               "dtype and shape take 24 (rank 3); nothing was loaded. Save the checkpoint again")
    with pytest.raises(ParamFSMError, match=r"take 24 \(rank 0\)"):
        headers([path])


def test_a_truncated_file_is_named_before_anything_is_read(one_rank, tmp_path):
    table = {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}
    exact = _write_raw(tmp_path / "exact.safetensors", table, b"\0" * 16)
    assert headers([exact])["w"].shape == (4,)  # a file that ends with its last tensor is whole
    path = _write_raw(tmp_path / "t.safetensors", table, b"\0" * 15)
    header = len(json.dumps(table).encode())
    with pytest.raises(ParamFSMError) as info:
        headers([path], rank=2)
    assert (f"'{path}' is truncated: tensor 'w' ends at byte {8 + header + 16} but the file has {8 + header + 15} "
            "bytes (rank 2)") in str(info.value), str(info.value)
    rt = paramfsm.shard(_model())
    full = _write(tmp_path / "m.safetensors", _checkpoint())
    data = open(full, "rb").read()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:-1])
    assert "is truncated" in _refused(rt, [str(cut)])
    rt.detach()


# ---------------------------------------------------------------------- read


def test_read_returns_any_range_of_the_flattened_tensor(tmp_path):
    tensor = torch.randn(5, 7)
    path = _write(tmp_path / "r.safetensors", {"t": tensor})
    entry = headers([path])["t"]
    flat = tensor.reshape(-1)
    with open(path, "rb", buffering=0) as handle:
        for lo, hi in ((0, 35), (3, 11), (34, 35), (9, 9)):
            got = read(handle, entry, lo, hi)
            assert got.dtype == torch.float32 and torch.equal(got, flat[lo:hi]), (lo, hi)
        into = torch.full((8,), -1.0)
        assert read(handle, entry, 10, 18, into=into) is into and torch.equal(into, flat[10:18])
        half = torch.zeros(8, dtype=torch.float16)
        read(handle, entry, 20, 28, into=half)
        assert torch.equal(half, flat[20:28].to(torch.float16))
        strided = torch.zeros(16)[::2]  # not contiguous: read into a buffer, then copied in
        read(handle, entry, 1, 9, into=strided)
        assert torch.equal(strided, flat[1:9])


def test_a_file_that_shrinks_during_the_read_is_named(tmp_path):
    tensor = torch.arange(8.0)
    path = _write(tmp_path / "s.safetensors", {"t": tensor})
    entry = headers([path])["t"]
    with open(path, "r+b") as handle:
        handle.truncate(entry.offset + 12)
    with open(path, "rb", buffering=0) as handle:
        assert torch.equal(read(handle, entry, 0, 3), tensor[:3])
        with pytest.raises(ParamFSMError) as info:
            read(handle, entry, 0, 8)
    assert str(info.value) == (f"'{path}' ended inside tensor 't' while it was read, though its header fit the "
                               "file's size: the file changed during the load; load it again once it is complete")


class Trickle(io.RawIOBase):
    """A file that returns at most three bytes a read, as a pipe or a network file system may."""

    def __init__(self, path):
        self.inner = open(path, "rb", buffering=0)

    def readable(self):
        return True

    def seek(self, offset, whence=0):
        return self.inner.seek(offset, whence)

    def readinto(self, buffer):
        return self.inner.readinto(memoryview(buffer)[:3])

    def close(self):
        self.inner.close()
        super().close()


def test_short_reads_are_continued(tmp_path):
    tensor = torch.randn(9)
    path = _write(tmp_path / "t.safetensors", {"t": tensor})
    with Trickle(path) as handle:
        assert torch.equal(read(handle, headers([path])["t"], 1, 8), tensor[1:8])


def test_a_load_that_fails_part_way_keeps_the_model_guarded(one_rank, tmp_path, monkeypatch):
    """The file shrinks after its header was read: the read raises, and a forward refuses the mixed values."""
    model = _model()
    rt = paramfsm.shard(model)
    path = _write(tmp_path / "m.safetensors", _checkpoint())
    read_headers = safetensors_slices.headers

    def then_shrink(files, rank=0):
        found = read_headers(files, rank)
        with open(path, "r+b") as handle:
            handle.truncate(max(entry.offset for entry in found.values()))
        return found

    monkeypatch.setattr(safetensors_slices, "headers", then_shrink)
    with pytest.raises(ParamFSMError, match="ended inside tensor"):
        load_files(rt, [path], "shrinking-dir")
    with pytest.raises(ParamFSMError) as info:
        model(torch.randn(2, 4))
    assert "loading 'shrinking-dir' failed part-way" in str(info.value), str(info.value)
    rt.detach()
