"""``paramfsm.shard``'s argument checks: a wrong ``units=`` entry or a wrong number is refused up front.

A ``units=`` list that matches nothing in the model would make the whole
model one unit (gathered whole: no memory saved), and a number of the wrong
type would fail later, in training. Each check raises before anything is
partitioned, with an error that names the argument (or the entry) and says
what it takes; the model is left as it was. Type errors are
:class:`paramfsm.ArgumentTypeError` (a ``TypeError``), range errors
:class:`paramfsm.ArgumentError` (a ``ValueError``); both are
``paramfsm.ParamFSMError``. The checks run on a one-rank group in the test
process (:mod:`one_rank`).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from one_rank import one_rank  # noqa: F401  (fixture)
from torch import nn

import paramfsm
from paramfsm.testing.models import mlp

#: The exact class each builtin kind of argument error must be.
EXACT = {ValueError: "ArgumentError", TypeError: "ArgumentTypeError"}


class Elsewhere(nn.Module):
    """A module class the test model does not contain."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return mlp(width=6, depth=3, d_in=4, d_out=2)


def refused(kind: type, model: nn.Module | None = None, **kwargs) -> str:
    """Shard with ``kwargs``, expect the exact argument error of ``kind``, check the model is untouched; the message."""
    model = model if model is not None else _model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(kind) as info:
        paramfsm.shard(model, **kwargs)
    assert type(info.value) is getattr(paramfsm, EXACT[kind]), type(info.value)
    assert isinstance(info.value, paramfsm.ParamFSMError)
    after = dict(model.named_parameters())
    assert all(torch.equal(after[name], value) for name, value in before.items()), "the model was partitioned"
    return str(info.value)


def test_a_module_class_the_model_lacks_is_refused_naming_it(one_rank):
    message = refused(ValueError, units=[Elsewhere])
    assert "units=" in message and "Elsewhere" in message and "whole model" in message, message


def test_a_class_that_is_not_a_module_class_is_refused_naming_it(one_rank):
    message = refused(TypeError, units=[int])
    assert "units=" in message and "int" in message and "nn.Module subclass" in message, message


def test_a_name_is_refused_with_the_predicate_that_selects_it(one_rank):
    for units in (["block"], "block"):
        message = refused(TypeError, units=units)
        assert "'block'" in message and "lambda name, module: name == 'block'" in message, message


def test_a_module_of_another_model_matches_nothing(one_rank):
    message = refused(ValueError, units=[Elsewhere().fc])
    assert "units=" in message and "Linear(in_features=2, out_features=2" in message, message


def test_a_partly_matching_list_warns_naming_the_entry_that_matches_nothing(one_rank):
    model = _model()
    other = Elsewhere()
    with pytest.warns(UserWarning) as told:
        rt = paramfsm.shard(model, units=[nn.Linear, Elsewhere, model[0], other.fc])
    try:
        assert [u.name for u in rt.units] == ["<root>", "0", "2", "4"]
    finally:
        rt.close()
    assert [type(w.message).__name__ for w in told] == ["UnmatchedUnits"] * 2, told
    first, second = (str(w.message) for w in told)
    assert "units=" in first and "instance of Elsewhere" in first and "no effect" in first, first
    assert "Linear(in_features=2, out_features=2" in second and "no effect" in second, second
    assert told[0].filename == __file__, "the warning points at the shard() call"


def test_classes_instances_and_predicates_mix_in_one_list(one_rank):
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rt = paramfsm.shard(model, units=[model[0], lambda name, module: name == "4"])
    try:
        assert [u.name for u in rt.units] == ["<root>", "0", "4"]
    finally:
        rt.close()


@pytest.mark.parametrize("units", [paramfsm.by_size(min_bytes=1 << 30), lambda name, module: False, nn.Linear])
def test_size_policies_predicates_and_a_bare_class_are_accepted(one_rank, units):
    model = _model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rt = paramfsm.shard(model, units=units)
    try:
        expected = ["<root>", "0", "2", "4"] if units is nn.Linear else ["<root>"]
        assert [u.name for u in rt.units] == expected
    finally:
        rt.close()


@pytest.mark.parametrize(("kwargs", "kind", "expected"), [
    ({"max_deferred_bytes": -1}, ValueError, "None or a number of bytes >= 0"),
    ({"max_deferred_bytes": "1MB"}, TypeError, "None or a number of bytes >= 0"),
    ({"max_deferred_bytes": 1.5}, TypeError, "None or a number of bytes >= 0"),
    ({"prefetch": -1}, ValueError, "a number of buckets >= 0"),
    ({"prefetch": True}, TypeError, "a number of buckets >= 0"),
    ({"prefetch": 1.0}, TypeError, "a number of buckets >= 0"),
    ({"bucket_bytes": -1}, ValueError, "a number of bytes >= 0"),
    ({"bucket_bytes": "1MB"}, TypeError, "a number of bytes >= 0"),
    ({"collective_timeout": 0}, ValueError, "None or a finite number of seconds > 0"),
    ({"collective_timeout": float("inf")}, ValueError, "None or a finite number of seconds > 0"),
    ({"collective_timeout": "60"}, TypeError, "None or a finite number of seconds > 0"),
    ({"param_dtype": torch.int64}, ValueError, "None or a floating-point torch.dtype"),
    ({"param_dtype": "bfloat16"}, TypeError, "torch.bfloat16"),
    ({"reduce_dtype": torch.complex64}, ValueError, "None or a floating-point torch.dtype"),
    ({"trace": -1}, ValueError, "a number of records to keep"),
    ({"trace": 1.5}, TypeError, "a number of records to keep"),
    ({"trace": ""}, ValueError, "a JSON Lines path"),
    ({"retain": "keep"}, ValueError, "'defer' or 'regather'"),
    ({"retain": None}, TypeError, "'defer' or 'regather'"),
    ({"strict": "yes"}, TypeError, "True or False"),
    ({"debug": 1}, TypeError, "True or False"),
    ({"sync_module_states": None}, TypeError, "True or False"),
    ({"spec": 3}, TypeError, "a path"),
    ({"reshard_after_forward": "no"}, TypeError, "a predicate"),
], ids=lambda value: repr(value) if isinstance(value, dict) else None)
def test_a_wrong_argument_is_refused_naming_it(one_rank, kwargs, kind, expected):
    (name, value), = kwargs.items()
    message = refused(kind, **kwargs)
    assert f"{name}={value!r}" in message and expected in message, message


def test_a_trace_path_that_is_a_directory_is_refused_before_partitioning(one_rank, tmp_path):
    message = refused(ValueError, trace=tmp_path)
    assert "trace=" in message and "is a directory" in message, message


def test_the_edge_values_are_accepted_and_a_refused_model_can_be_sharded_after(one_rank):
    model = _model()
    refused(ValueError, model, prefetch=-1)
    rt = paramfsm.shard(model, max_deferred_bytes=0, prefetch=0, bucket_bytes=0, collective_timeout=5, trace=0,
                        param_dtype=torch.float64, reduce_dtype=torch.float32)
    try:
        model(torch.randn(3, 4)).sum().backward()
        assert all(p.grad is not None for p in rt.shard_parameters())
    finally:
        rt.close()


def test_every_argument_after_the_model_is_keyword_only(one_rank):
    """DESIGN §4: ``shard(model, *, ...)``. A positional group or units list (an FSDP1 habit) is refused by Python
    before anything is partitioned."""
    import inspect

    model = _model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with pytest.raises(TypeError, match="positional"):
        paramfsm.shard(model, None)
    assert all(torch.equal(dict(model.named_parameters())[n], v) for n, v in before.items())
    params = list(inspect.signature(paramfsm.shard).parameters.values())[1:]
    assert params and all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params), params
