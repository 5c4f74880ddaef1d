"""The placeholder of an ungathered parameter (:mod:`paramfsm.engine.storage.placeholder`), on one rank.

At rest a parameter reports its full shape, size and bytes, while every operation on its values
raises ``NotGathered`` naming the parameter, its unit and what was done; inside its unit (or
``rt.gathered``) it is its plain class again and computes like plain torch. The sizes below are
the model's own: a ``Bilinear(3, 4, 2)`` in float64 has a (2, 3, 4) weight, 24 elements, 192 bytes.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn.functional as F
from one_rank import one_rank  # noqa: F401  (fixture)
from torch import nn

import paramfsm
from paramfsm import NotGathered
from paramfsm.engine.storage import placeholder
from paramfsm.engine.storage.placeholder import NotGatheredData, conceal, reveal, storage


@pytest.fixture
def sharded(one_rank):
    """A float64 Bilinear and a Linear, one unit each, sharded on one rank; with the plain model it was."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Bilinear(3, 4, 2), nn.Linear(2, 3)).double()
    ref = copy.deepcopy(model)
    rt = paramfsm.shard(model, min_unit_bytes=0)
    yield model, ref, rt
    rt.close()


def _raised(fn) -> NotGathered:
    with pytest.raises(NotGathered) as info:
        fn()
    return info.value


def test_an_ungathered_parameter_reports_its_full_metadata(sharded):
    model, ref, _ = sharded
    w = model[0].weight
    assert storage(w).numel() == 0, "only the shard is kept"
    assert w.shape == (2, 3, 4) and w.size() == (2, 3, 4)
    assert (w.size(0), w.size(1), w.size(-1), w.size(dim=2)) == (2, 3, 4, 4)
    assert w.dim() == w.ndimension() == w.ndim == 3
    assert w.numel() == w.nelement() == 24 and w.nbytes == 192
    assert w.dtype == torch.float64 and w.element_size() == w.itemsize == 8 and w.is_floating_point()
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in ref.parameters()) == 35
    assert w.requires_grad and w.is_leaf and w.grad is None and w.grad_fn is None and not w.retains_grad
    assert w.device.type == "cpu" and w.is_cpu and not w.is_cuda and not w.is_meta and w.layout == torch.strided
    assert not w.is_complex() and isinstance(w.data_ptr(), int) and isinstance(w._version, int)
    assert isinstance(w, nn.Parameter) and "NotGathered" in repr(w)
    w.register_hook(lambda grad: grad).remove()
    w.requires_grad_(False)
    assert not w.requires_grad
    w.requires_grad_(True)


def test_its_data_is_empty_storage_with_the_same_logical_shape_and_the_same_guard(sharded):
    model, _, _ = sharded
    w = model[0].weight
    data = w.data
    assert type(data) is NotGatheredData
    assert data.shape == (2, 3, 4) and data.numel() == 24 and data.nbytes == 192 and data.dim() == 3
    error = _raised(lambda: data.sum())
    assert (error.param, error.unit, error.rank, error.op) == ("0.weight", "0", 0, "TensorBase.sum")
    assert _raised(lambda: pickle.dumps(data)).op == "pickling (torch.save of the model)"


def test_the_guard_class_is_named_after_the_plain_one(sharded):
    model, _, rt = sharded
    w = model[0].weight
    guard = type(w)
    assert guard.__name__ == "NotGatheredPartitionedParameter" and guard.__module__ == placeholder.__name__
    assert guard.__doc__ == ("A PartitionedParameter whose data is not gathered on this rank "
                             "(see paramfsm.engine.storage.placeholder).")
    assert type(model[0].bias) is guard and type(model[1].weight) is guard, "one guard class per plain class"
    with rt.gathered(model[0]):
        assert type(w) is guard.__mro__[1] and type(w).__name__ == "PartitionedParameter"
    assert type(w) is guard


@pytest.mark.parametrize("use, op", [
    (lambda w: w.sum(), "TensorBase.sum"),
    (lambda w: w + 1, "TensorBase.add"),
    (lambda w: w[0], "TensorBase.__getitem__"),
    (lambda w: w.T, "the property .T"),
    (lambda w: w.mT, "the property .mT"),
    (lambda w: w.__cuda_array_interface__, "the property .__cuda_array_interface__"),
    (lambda w: torch.cat([w, w]), "_VariableFunctionsClass.cat"),
    (lambda w: torch.add(torch.ones(2, 3, 4, dtype=torch.float64), other=w), "_VariableFunctionsClass.add"),
    (lambda w: pickle.dumps(w), "pickling (torch.save of the model)"),
], ids=["method", "operator", "indexing", "T", "mT", "python-property", "list", "keyword", "pickle"])
def test_using_its_values_raises_naming_the_parameter_and_the_operation(sharded, use, op):
    model, _, _ = sharded
    error = _raised(lambda: use(model[0].weight))
    assert (error.param, error.unit, error.rank) == ("0.weight", "0", 0)
    assert error.op == op
    assert str(error).startswith(f"parameter '0.weight' (unit '0') is not gathered on rank 0: {error.op} was used")


def test_the_error_names_the_empty_operand_not_a_gathered_one(sharded):
    model, _, rt = sharded
    with rt.gathered(model[1]):
        error = _raised(lambda: torch.einsum("oi,kij->okj", model[1].weight, model[0].weight))
    assert error.param == "0.weight" and error.unit == "0"
    error = _raised(lambda: F.linear(torch.ones(1, 2, dtype=torch.float64), model[1].weight))
    assert (error.param, error.op) == ("1.weight", "linear")


def test_gathered_it_computes_like_plain_torch(sharded):
    model, ref, rt = sharded
    x1, x2 = torch.randn(5, 3, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    bilinear, linear = model
    out = linear(bilinear(x1, x2))
    expected = ref[1](ref[0](x1, x2))
    assert torch.allclose(out, expected, atol=1e-12)
    out.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    for name, p in ref.named_parameters():
        assert torch.allclose(rt.full_grad(name), p.grad, atol=1e-12), name
    with rt.gathered(bilinear):
        assert torch.equal(bilinear.weight * 1, ref[0].weight.detach())
        assert storage(bilinear.weight).shape == (2, 3, 4)


def test_conceal_and_reveal_switch_the_class_and_back():
    class lowercase(nn.Parameter):  # noqa: N801 - the guard class capitalises the first letter
        """Made here, so each run of the test makes its guard class anew."""

    p, q = lowercase(torch.zeros(2)), lowercase(torch.zeros(3))
    conceal(p)
    guard = type(p)
    assert guard.__name__ == "NotGatheredLowercase" and guard.__bases__ == (lowercase,)
    assert guard.__module__ == placeholder.__name__
    assert guard.__doc__ == ("A lowercase whose data is not gathered on this rank "
                             "(see paramfsm.engine.storage.placeholder).")
    with pytest.raises(NotGathered) as info:
        pickle.dumps(p)
    assert info.value.param == "<unknown>" and info.value.op == "pickling (torch.save of the model)"
    conceal(p)
    conceal(q)
    assert type(p) is guard and type(q) is guard, "concealed once; the guard class is made once"
    reveal(p)
    reveal(q)
    assert type(p) is lowercase and type(q) is lowercase and p.sum().item() == 0
    reveal(p)
    assert type(p) is lowercase


def test_setting_data_is_allowed(sharded):
    model, _, _ = sharded
    w = model[0].weight
    w.data = torch.empty(0, dtype=torch.float64)
    assert w.shape == (2, 3, 4) and storage(w).numel() == 0


def test_a_fresh_parameter_class_gets_a_guard_that_refuses_its_values(one_rank):
    class Fresh(nn.Parameter):
        """Made here, so each run of the test makes its guard class anew."""

    model = nn.Sequential(nn.Linear(2, 2))
    model[0].weight = Fresh(model[0].weight.detach())
    rt = paramfsm.shard(model, min_unit_bytes=0)
    w = model[0].weight
    assert isinstance(w, Fresh) and type(w).__name__.startswith("NotGathered")
    assert (_raised(lambda: w.sum()).op, _raised(lambda: pickle.dumps(w)).op) == (
        "TensorBase.sum", "pickling (torch.save of the model)")
    rt.close()


def test_the_error_names_the_empty_data_operand_not_a_gathered_parameter(sharded):
    model, _, rt = sharded
    with rt.gathered(model[1]):
        error = _raised(lambda: torch.einsum("oi,kij->okj", model[1].weight, model[0].weight.data))
    assert error.param == "0.weight"


def test_setting_a_property_that_is_not_metadata_raises_naming_it(sharded):
    """Only ``.data`` and the metadata properties may be set at rest; any other setter is refused by name
    (``volatile``: a setter torch still hands to the guard, though it no longer has any effect)."""
    model, _, _ = sharded
    w = model[0].weight
    error = _raised(lambda: setattr(w, "volatile", False))
    assert (error.param, error.unit, error.op) == ("0.weight", "0", "the property .volatile")
    assert storage(w).numel() == 0


def test_the_gradient_dtype_of_an_ungathered_parameter_is_read_but_never_set(sharded):
    """``p.grad_dtype`` is metadata (as ``p.dtype``): read at rest as plain torch reads it. Set, it would not
    reach the shard's gradient, whose dtype the reduce-scatter decides: refused by name."""
    model, _, _ = sharded
    w = model[0].weight
    assert w.grad_dtype == torch.nn.Linear(2, 2, dtype=w.dtype).weight.grad_dtype == w.dtype
    error = _raised(lambda: setattr(w, "grad_dtype", torch.float64))
    assert (error.param, error.op) == ("0.weight", "the property .grad_dtype")
    assert w.grad_dtype == w.dtype and storage(w).numel() == 0
