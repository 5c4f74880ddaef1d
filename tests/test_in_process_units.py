"""Partitioning (:mod:`paramfsm.engine.storage.units`), checked in the test process without a process group.

Each rank's shard of a parameter is its slice of the flattened parameter, zero-padded to a
multiple of the world size; records and units are built from the model's own names (tied
weights held by every unit that registers them); ``by_size`` makes a module a unit once its
unowned parameters add up to ``min_bytes``; ``units=`` is checked with messages that say
what it takes. All of it is pure: any rank and world size can be checked in one process.
"""

from __future__ import annotations

import copy
import gc
import os

import pytest
import torch
import torch.utils.deterministic
from one_rank import one_rank  # noqa: F401  (fixture)
from torch import nn

import paramfsm
from paramfsm import State
from paramfsm.engine.storage.units import (ACCEPTED, ParamRecord, UnitModules, build_units, by_size,
                                           check_partitionable, let_go, make_shard, owner_unit,
                                           UnmatchedUnits, select_unit_modules, units_within)
from paramfsm.errors import ArgumentError, ArgumentTypeError, ParamFSMError
from paramfsm.verify.checks import state_invariants

#: Mutation testing calls every mutated function through a trampoline, frames that ``stacklevel`` does not
#: count: where a warning points is checked in plain test runs only.
PLAIN_RUN = "MUTANT_UNDER_TEST" not in os.environ


@pytest.fixture
def nan_empty():
    """Uninitialised memory reads NaN, so a test sees which elements ``make_shard`` really wrote."""
    previous = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(previous[0])
    torch.utils.deterministic.fill_uninitialized_memory = previous[1]


@pytest.mark.parametrize("numel, world, rank, expected", [
    (10, 3, 0, [0, 1, 2, 3]), (10, 3, 1, [4, 5, 6, 7]), (10, 3, 2, [8, 9, 0, 0]),
    (5, 4, 2, [4, 0]), (5, 4, 3, [0, 0]), (6, 1, 0, [0, 1, 2, 3, 4, 5]),
])
def test_a_shard_is_the_ranks_slice_of_the_flat_parameter_zero_padded(nan_empty, numel, world, rank, expected):
    param = nn.Parameter(torch.arange(float(numel)))
    shard, shard_numel = make_shard(param, rank, world)
    assert shard_numel == len(expected) == -(-numel // world)
    assert isinstance(shard, nn.Parameter) and shard.is_leaf and shard.requires_grad
    assert shard.tolist() == [float(v) for v in expected]


def test_a_shard_keeps_the_dtype_and_requires_grad_and_copies_the_values():
    param = nn.Parameter(torch.tensor([1.5, 2.5, 3.5], dtype=torch.float16), requires_grad=False)
    shard, _ = make_shard(param, 0, 2)
    assert shard.dtype == torch.float16 and not shard.requires_grad and shard.tolist() == [1.5, 2.5]
    shard.data.add_(1)
    assert param.tolist() == [1.5, 2.5, 3.5], "the shard is a copy"


@pytest.mark.parametrize("numel, world, rank, written", [(10, 3, 0, 4), (10, 3, 2, 2), (5, 4, 3, 0), (5, 4, 2, 1)])
def test_a_meta_parameters_shard_is_allocated_on_the_device_with_zero_padding(nan_empty, numel, world, rank, written):
    param = nn.Parameter(torch.empty(numel, device="meta"))
    shard, shard_numel = make_shard(param, rank, world, torch.device("cpu"))
    assert shard.device.type == "cpu" and shard.numel() == shard_numel
    assert shard[:written].isnan().all(), "the values are not set (uninitialised until loaded)"
    assert shard[written:].eq(0).all(), "the padding past the parameter's end is zero"


def test_let_go_empties_a_parameter_keeping_its_identity_dtype_and_requires_grad():
    real = nn.Parameter(torch.ones(3, dtype=torch.float64), requires_grad=False)
    let_go(real, None)
    assert real.numel() == 0 and real.dtype == torch.float64 and not real.requires_grad
    meta = nn.Parameter(torch.empty(4, dtype=torch.float16, device="meta"))
    before = id(meta)
    let_go(meta, torch.device("cpu"))
    assert id(meta) == before and not meta.is_meta and meta.device.type == "cpu"
    assert meta.numel() == 0 and meta.dtype == torch.float16 and meta.requires_grad


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 2)
        self.norm = nn.LayerNorm(2)
        self.head = nn.Linear(2, 5, bias=False)
        self.head.weight = self.emb.weight


def test_build_units_shards_each_parameter_once_and_every_unit_registering_it_holds_it():
    torch.manual_seed(0)
    model = Tied()
    flat = model.emb.weight.detach().reshape(-1).clone()
    units, records = build_units(model, [nn.Embedding, nn.Linear], rank=1, world=2)
    assert [(u.index, u.name, u.reason) for u in units] == [(0, "<root>", "root"), (1, "emb", "units="),
                                                            (2, "head", "units=")]
    rec = records[id(model.emb.weight)]
    assert isinstance(rec, ParamRecord) and len(records) == 3
    assert rec.names == ("emb.weight", "head.weight") and rec.units == (units[1], units[2]) and rec.unit == "emb"
    assert rec.shape == (5, 2) and rec.numel == 10 and rec.shard_numel == 5 and rec.nbytes == 40
    assert rec.requires_grad and rec.param is model.emb.weight
    assert torch.equal(rec.shard.detach(), flat[5:]), "rank 1 of 2 holds the second half"
    norm = records[id(model.norm.weight)]
    assert norm.unit == "<root>" and norm.units == (units[0],) and norm.shard_numel == 1
    assert [r.name for r in units[0].records] == ["norm.weight", "norm.bias"]
    assert [u.nbytes for u in units] == [16, 40, 40]
    assert repr(units[1]) == "<Unit 1 emb params=1>"
    assert repr(rec) == "<ParamRecord emb.weight NOT_AVAILABLE holds=0>"
    assert model.emb.weight.numel() == 10, "kept unless release=True"


def test_a_unit_without_parameters_is_not_built_but_the_root_always_is():
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2)))
    units, _ = build_units(model, lambda name, module: name in ("0", "0.0"), rank=0, world=1)
    assert [(u.index, u.name, len(u.records)) for u in units] == [(0, "<root>", 0), (1, "0.0", 2)]


def test_a_parameter_registered_twice_on_one_module_is_one_record_of_its_unit():
    model = nn.Sequential(nn.Linear(2, 2))
    model[0].again = model[0].weight
    units, records = build_units(model, [nn.Linear], rank=0, world=1)
    assert [r.names for r in units[1].records] == [("0.weight", "0.again"), ("0.bias",)]
    assert len(records) == 2


def test_release_drops_each_full_parameter_and_a_meta_model_gets_its_shards_on_the_device():
    model = nn.Sequential(nn.Linear(4, 4))
    units, records = build_units(model, None, rank=0, world=2, release=True)
    assert model[0].weight.numel() == 0 and records[id(model[0].weight)].shard.numel() == 8
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(4, 4))
    _, records = build_units(meta, None, rank=1, world=2, device=torch.device("cpu"))
    rec = records[id(meta[0].bias)]
    assert not meta[0].bias.is_meta and meta[0].bias.numel() == 0, "a meta parameter is always released"
    assert rec.shard.device.type == "cpu" and rec.shard_numel == 2 and rec.shape == (4,)


def test_integer_parameters_are_refused_naming_them():
    model = nn.Module()
    model.steps = nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)
    with pytest.raises(ParamFSMError) as info:
        check_partitionable(model)
    assert str(info.value) == ("parameter 'steps' has dtype torch.int64; paramfsm partitions floating-point "
                               "parameters only (register integer tensors as buffers)")
    check_partitionable(nn.Linear(2, 2))


def test_owner_unit_is_the_nearest_enclosing_unit():
    assert owner_unit("a.b.weight", ["a"]) == "a"
    assert owner_unit("a.b.weight", ["a", "a.b"]) == "a.b"
    assert owner_unit("a.b.weight", ["b"]) == ""
    assert owner_unit("weight", ["a"]) == ""


def test_units_within_are_the_units_of_the_modules_and_below():
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    units, _ = build_units(model, [nn.Linear], rank=0, world=1)
    names = lambda *modules: [u.name for u in units_within(model, units, modules)]  # noqa: E731
    assert names() == names(model) == ["<root>", "0", "1.0", "1.1"]
    assert names(model[1]) == ["1.0", "1.1"] and names(model[1][1]) == ["1.1"] and names(model[0], model[1][0]) == [
        "0", "1.0"]


def test_by_size_makes_a_module_of_exactly_min_bytes_a_unit():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))  # 80 and 40 bytes
    assert by_size(40).select(model) == {"0", "1"}
    assert by_size(80).select(model) == {"0"}
    assert by_size(81).select(model) == set(), "the root takes what is left"
    nested = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    assert by_size(80).select(nested) == {"0.0"}, "the 40 bytes left under '0' are too few"
    assert by_size(120).select(nested) == {"0"}, "the unowned bytes under a module add up"
    assert by_size(121).select(nested) == set()


def test_by_size_counts_a_tied_weight_once():
    model = Tied()  # emb.weight 40 bytes, tied to head.weight; norm 16 bytes
    assert by_size(40).select(model) == {"emb"}
    assert by_size(16).select(model) == {"emb", "norm"}


def test_by_size_reasons_repr_and_default():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    chosen = select_unit_modules(model, by_size(min_bytes=80))
    assert list(chosen) == ["", "0"] and chosen.reasons == {"": "root", "0": "by_size(min_bytes=80)"}
    assert chosen.merged == {}
    assert by_size().min_bytes == 1 << 20 and repr(by_size(5)) == "by_size(min_bytes=5)"
    assert by_size(1).min_bytes == 1


@pytest.mark.parametrize("bad, kind", [(0, ArgumentError), (-3, ArgumentError), (True, ArgumentTypeError),
                                       (2.0, ArgumentTypeError), ("1M", ArgumentTypeError)])
def test_by_size_refuses_anything_but_a_positive_int(bad, kind):
    with pytest.raises(kind) as info:
        by_size(bad)
    assert type(info.value) is kind
    assert str(info.value) == f"by_size(min_bytes={bad!r}): expected a positive number of bytes"


def test_predicates_classes_and_a_ready_choice():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    chosen = select_unit_modules(model, lambda name, module: name == "2")
    assert list(chosen) == ["", "2"] and chosen.reasons == {"": "root", "2": "units="} and chosen.merged == {}
    assert list(select_unit_modules(model, nn.Linear)) == ["", "0", "2"]
    assert list(select_unit_modules(model, [model[2], nn.ReLU])) == ["", "1", "2"]
    assert isinstance(chosen, UnitModules) and select_unit_modules(model, chosen) is chosen


def _refusal(units, model=None) -> tuple[type, str]:
    with pytest.raises(ParamFSMError) as info:
        select_unit_modules(model if model is not None else nn.Sequential(nn.Linear(2, 2)), units)
    return type(info.value), str(info.value)


def test_names_and_modules_are_refused_saying_what_to_pass():
    assert _refusal("lin") == (ArgumentTypeError, f"units='lin': {ACCEPTED}, not names. To make the module named "
                               "'lin' one unit, pass units=lambda name, module: name == 'lin'")
    assert _refusal(["lin"]) == (ArgumentTypeError, f"units=: the entry 'lin' is a name; {ACCEPTED}. To make the "
                                 "module named 'lin' one unit, use the entry lambda name, module: name == 'lin'")
    lin = nn.Linear(2, 3)
    assert _refusal(lin) == (ArgumentTypeError, f"units=Linear(in_features=2, out_features=3, bias=True): "
                             f"{ACCEPTED}; pass units=[module] to make this module one unit, or "
                             "units=list(module.children()) for one unit per child")
    assert _refusal(nn.Sequential(lin))[1].startswith("units=<a Sequential module>: ")


def test_other_entries_are_refused_naming_their_type():
    assert _refusal(3) == (ArgumentTypeError, f"units=3: {ACCEPTED}")
    assert _refusal([]) == (ArgumentError, "units=[] names no module: pass units=None for the default units, or "
                            "units=lambda name, module: False to make the whole model one unit")
    assert _refusal([int]) == (ArgumentTypeError, "units=: the entry int is a class but not a module class "
                               f"(an nn.Module subclass); {ACCEPTED}")
    assert _refusal([nn.Linear, 3]) == (ArgumentTypeError, f"units=: the entry 3 (of type int) is none of these: "
                                        f"{ACCEPTED}")


class Elsewhere(nn.Module):
    """A class the test models do not contain."""


class Wide(nn.Module):
    """A module whose one-line repr is ``width`` characters long."""

    def __init__(self, width: int):
        super().__init__()
        self.width = width

    def extra_repr(self) -> str:
        return "x" * (self.width - len("Wide()"))


def test_a_list_matching_nothing_is_refused_naming_the_entries_and_the_classes_present():
    def pick(name, module):
        return False

    kind, message = _refusal([Elsewhere, pick, Wide(80), Wide(81)])
    assert kind is ArgumentError
    assert message == (
        f"units=[Elsewhere, {pick.__qualname__}, Wide({'x' * 74}), <a Wide module>] matches no module of the model "
        "(Sequential): no module of the model is an instance of Elsewhere; "
        f"Wide({'x' * 74}) is not one of the model's own modules (a copy, or another model's module, is not); "
        "<a Wide module> is not one of the model's own modules (a copy, or another model's module, is not). "
        "The whole model would be one unit, gathered whole, which saves no memory. What to do: name classes the "
        "model contains (those owning parameters: Linear), modules of this model itself, or a predicate "
        "(qualified_name, module) -> bool; units=None keeps the default units")
    assert "(those owning parameters: none)" in _refusal([Elsewhere], nn.Sequential(nn.ReLU()))[1]


def test_one_entry_matching_nothing_among_others_warns_at_the_shard_call(one_rank):
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.warns(UnmatchedUnits) as told:
        rt = paramfsm.shard(model, units=[nn.Linear, Elsewhere])
    rt.close()
    assert len(told) == 1 and (told[0].filename == __file__ or not PLAIN_RUN)
    assert str(told[0].message) == (
        "units=: no module of the model is an instance of Elsewhere, so that entry has no effect and the other "
        "entries choose the units. What to do: remove it, or name a class the model contains or one of its own "
        "modules")



def test_a_module_registered_under_two_names_is_one_unit_under_its_first_name():
    model = nn.Sequential(nn.Linear(2, 2))
    model.again = model[0]
    assert list(select_unit_modules(model, [nn.Linear])) == ["", "0"]
    units, records = build_units(model, [nn.Linear], rank=0, world=1)
    assert [u.name for u in units] == ["<root>", "0"] and len(records) == 2
    assert [r.names for r in units[1].records] == [("0.weight", "again.weight"), ("0.bias", "again.bias")]


def test_a_list_entry_predicate_is_given_the_name_and_the_module():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    chosen = select_unit_modules(model, [lambda name, module: name == "2" and isinstance(module, nn.Linear)])
    assert list(chosen) == ["", "2"]


class Picker:
    """A callable object as a ``units=`` entry: it has no ``__qualname__``, so messages show its repr."""

    def __call__(self, name, module):
        return False

    def __repr__(self) -> str:
        return "Picker()"


def test_a_refusal_names_a_callable_object_by_its_repr_and_every_class_owning_parameters():
    model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    kind, message = _refusal([Elsewhere, Picker()], model)
    assert kind is ArgumentError
    assert message.startswith("units=[Elsewhere, Picker()] matches no module of the model (Sequential): ")
    assert "(those owning parameters: LayerNorm, Linear)" in message


def test_a_meta_parameters_shard_and_emptied_parameter_keep_its_dtype_and_requires_grad():
    param = nn.Parameter(torch.empty(5, dtype=torch.float16, device="meta"), requires_grad=False)
    shard, _ = make_shard(param, 1, 2, torch.device("cpu"))
    assert shard.dtype == torch.float16 and not shard.requires_grad
    let_go(param, torch.device("cpu"))
    assert param.dtype == torch.float16 and not param.requires_grad and param.numel() == 0


def test_by_size_counts_nothing_of_a_chosen_child_in_its_parent():
    """``0.1`` (40 bytes) stays with ``0``; ``0.0`` (80 bytes) is a unit and adds nothing to ``0``."""
    nested = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))
    assert by_size(41).select(nested) == {"0.0"}
    assert by_size(40).select(nested) == {"0.0", "0.1"}


def test_a_frozen_parameter_is_sharded_and_closed_with_the_rest(one_rank):
    """A parameter that never required grad has no gradient hooks; closing the runtime restores it."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model[0].weight.requires_grad_(False)
    expected = copy.deepcopy(model.state_dict())
    rt = paramfsm.shard(model, min_unit_bytes=0)
    assert not rt.record("0.weight").requires_grad
    closed = rt.close()
    assert type(closed[0].weight) is nn.Parameter and not closed[0].weight.requires_grad
    assert all(torch.equal(closed.state_dict()[k], v) for k, v in expected.items())


def test_a_freshly_sharded_model_meets_the_specs_invariants(one_rank):
    """Nothing is gathered, staged or pending yet: every record satisfies what its state requires."""
    rt = paramfsm.shard(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), min_unit_bytes=0)
    assert set(rt.states().values()) == {State.NOT_AVAILABLE}
    assert state_invariants(rt) == []
    rt.close()


def test_a_retained_graph_keeps_its_units_deferred_until_it_is_collected(one_rank):
    """``retain="defer"`` (the default): after ``backward(retain_graph=True)`` the parameters wait for the next
    backward over the graph; when the graph is collected they are released."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    rt = paramfsm.shard(model, min_unit_bytes=0)
    loss = model(torch.ones(3, 2)).sum()
    loss.backward(retain_graph=True)
    assert set(rt.states().values()) == {State.DEFERRED_RELEASE}
    del loss
    gc.collect()
    assert set(rt.states().values()) == {State.NOT_AVAILABLE}
    rt.close()
