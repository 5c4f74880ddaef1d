"""Same model on every rank (:mod:`paramfsm.sharding.rank_agreement`), checked in the test process.

The descriptions, fingerprints and first differences are plain functions of
a model, tested against hand-computed values. :func:`agree` itself needs
several ranks: here they are threads of the test process, each rank one
thread in torch's threaded process group (the one
``torch.testing._internal.distributed`` runs its own multi-rank tests on),
so that ``make mutate`` sees the check. ``tests/test_rank_agreement.py``
runs it through ``paramfsm.shard`` on spawned gloo ranks.
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from paramfsm.errors import ModelMismatch
from paramfsm.sharding.rank_agreement import RanksDiffer, agree, describe, fingerprint, first_difference
from threaded_ranks import on_ranks

CPU, META = torch.device("cpu"), torch.device("meta")

#: The ranks build their models one at a time: the seeded default generator is shared by the threads.
BUILDING = threading.Lock()


def _stack(widths=(4, 4, 3), seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*(nn.Linear(a, b) for a, b in zip(widths, widths[1:])))


def _tied() -> nn.Module:
    model = nn.Module()
    model.a = nn.Linear(3, 3, bias=False)
    model.b = nn.Linear(3, 3)
    model.b.weight = model.a.weight
    return model


# ---------------------------------------------------------------------- pure functions


def test_describe_lists_every_parameter_with_its_shape_dtype_and_tying():
    model = _tied()
    model.c = nn.Linear(2, 5).to(torch.float64)
    assert describe(model) == [
        ("a.weight", (3, 3), "torch.float32", ""),
        ("b.weight", (3, 3), "torch.float32", "a.weight"),
        ("b.bias", (3,), "torch.float32", ""),
        ("c.weight", (5, 2), "torch.float64", ""),
        ("c.bias", (5,), "torch.float64", ""),
    ]


def test_the_fingerprint_weights_each_parameter_by_its_place():
    model = nn.Module()
    model.a = nn.Parameter(torch.tensor([1.0, 2.0]))
    model.b = nn.Parameter(torch.tensor([-3.0]))
    # (i + 1) * sum + L1 norm, over parameters i = 0, 1: (1 * 3 + 3) + (2 * -3 + 3) = 3.
    assert fingerprint(model) == 3.0
    swapped = nn.Module()
    swapped.a = nn.Parameter(torch.tensor([-3.0]))
    swapped.b = nn.Parameter(torch.tensor([1.0, 2.0]))
    assert fingerprint(swapped) == (1 * -3 + 3) + (2 * 3 + 3)


def test_the_fingerprint_skips_meta_and_integer_parameters_but_keeps_their_places():
    model = nn.Module()
    model.count = nn.Parameter(torch.tensor([5, 6]), requires_grad=False)
    model.a = nn.Parameter(torch.tensor([2.0, -1.0]))
    with torch.device("meta"):
        model.m = nn.Parameter(torch.empty(4))
    # Only 'a' counts, as parameter #1: 2 * 1 + 3.
    assert fingerprint(model) == 5.0
    with torch.device("meta"):
        assert fingerprint(nn.Linear(3, 3)) == 0.0
    assert fingerprint(nn.Module()) == 0.0


def test_the_fingerprint_is_exact_in_float64_for_half_precision_values():
    model = nn.Module()
    model.h = nn.Parameter(torch.full((3,), 0.1, dtype=torch.float16))
    value = float(torch.tensor(0.1, dtype=torch.float16).double())
    assert fingerprint(model) == pytest.approx(3 * value + 3 * value, rel=1e-15)


def test_the_first_difference_names_a_parameter_and_what_differs():
    mine = describe(_stack())
    assert first_difference(mine, describe(_stack((4, 5, 3)))) == \
        "parameter '0.weight' has shape (4, 4) here and (5, 4) there"
    assert first_difference(mine, describe(_stack().to(torch.float64))) == \
        "parameter '0.weight' has dtype torch.float32 here and torch.float64 there"
    renamed = [("0.weight", (4, 4), "torch.float32", ""), ("x.bias", (4,), "torch.float32", "")]
    assert first_difference(mine, renamed) == "parameter #1 is '0.bias' here and 'x.bias' there"
    tied, untied = describe(_tied()), [("a.weight", (3, 3), "torch.float32", ""),
                                       ("b.weight", (3, 3), "torch.float32", ""),
                                       ("b.bias", (3,), "torch.float32", "")]
    assert first_difference(tied, untied) == "parameter 'b.weight' has tying a.weight here and untied there"
    assert first_difference(untied, tied) == "parameter 'b.weight' has tying untied here and a.weight there"


def test_the_first_difference_of_a_longer_model_names_the_first_extra_parameter():
    short, long = describe(_stack()), describe(_stack((4, 4, 3, 2)))
    assert first_difference(long, short) == \
        "6 parameters here and 4 there; the first extra one, '2.weight', exists only here"
    assert first_difference(short, long) == \
        "4 parameters here and 6 there; the first extra one, '2.weight', exists only there"
    assert first_difference(short, list(short)) == "their descriptions differ"


# ---------------------------------------------------------------------- agree, on threaded ranks


def _values(model) -> list[torch.Tensor]:
    return [t.detach().clone() for t in list(model.parameters()) + list(model.buffers())]


def _agreeing(world: int, build, groups=lambda: [None], sync: bool = False):
    """Every rank builds ``build(rank)`` and runs agree: (values afterwards, errors, RanksDiffer messages)."""
    def job(rank):
        with BUILDING:
            model = build(rank)
        agree(model, groups(), META if any(p.is_meta for p in model.parameters()) else CPU,
              sync_module_states=sync)
        return _values(model)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        results, errors = on_ranks(world, job)
    return results, errors, [str(w.message) for w in caught if issubclass(w.category, RanksDiffer)]


def test_the_same_model_with_the_same_values_passes_silently():
    results, errors, differ = _agreeing(2, lambda rank: _stack(seed=0))
    assert errors == [None, None] and differ == []
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_different_values_warn_on_every_rank_naming_the_ranks_that_differ():
    results, errors, differ = _agreeing(3, lambda rank: _stack(seed=1 if rank == 1 else 0))
    assert errors == [None] * 3 and len(differ) == 3, (errors, differ)
    assert differ == [
        "paramfsm.shard: the ranks hold the same model with different values (ranks [1] differ from rank 0), so "
        "each rank would keep its slice of its own values and the model trained would be stitched together from "
        "several. What to do: seed every rank alike before building the model (torch.manual_seed(seed), the same "
        "seed everywhere), or pass paramfsm.shard(model, sync_module_states=True) to start from rank 0's values; "
        "if you load weights afterwards (rt.load_full_state_dict), ignore this warning."] * 3
    assert all(torch.equal(a, b) for a, b in zip(results[0], results[2]))  # nothing is changed
    assert not torch.equal(results[0][0], results[1][0])


def test_models_with_negative_fingerprints_are_compared_too():
    def build(rank):
        model = _stack(seed=0)
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(-1.0 - rank)
        return model

    assert fingerprint(build(0)) < 0
    _, errors, differ = _agreeing(2, build)
    assert errors == [None, None] and len(differ) == 2 and "ranks [1] differ" in differ[0], (errors, differ)


def test_models_on_the_meta_device_are_compared_by_structure_and_their_real_buffers_synchronised():
    """Parameters on meta (no values yet), buffers already real, as accelerate.init_empty_weights leaves them."""
    def build(rank):
        with torch.device("meta"):
            model = _stack((4, 4, 3) if rank < 2 else (4, 4, 2))
        model.register_buffer("steps", torch.full((2,), float(rank)))
        return model

    results, errors, differ = _agreeing(2, build, sync=True)
    assert errors == [None, None] and differ == [], (errors, differ)
    assert all(torch.equal(values[-1], torch.zeros(2)) for values in results), results
    _, errors, _ = _agreeing(3, build, sync=True)
    assert all(isinstance(e, ModelMismatch) for e in errors), errors


def test_sync_module_states_gives_every_rank_rank_0s_values_without_a_warning():
    def build(rank):
        model = _stack(seed=rank)
        model.append(nn.BatchNorm1d(3))
        model[-1].running_mean.fill_(float(rank))
        return model

    results, errors, differ = _agreeing(3, build, sync=True)
    assert errors == [None] * 3 and differ == [], (errors, differ)
    reference = _values(build(0))
    for values in results:
        assert all(torch.equal(a, b) for a, b in zip(values, reference))


def test_different_models_raise_on_every_rank_naming_the_first_difference():
    _, errors, _ = _agreeing(2, lambda rank: _stack((4, 4, 3) if rank == 0 else (4, 6, 3)))
    assert all(isinstance(e, ModelMismatch) for e in errors), errors
    assert str(errors[0]).startswith("paramfsm.shard: rank 0 and rank 1 hold different models: parameter "
                                     "'0.weight' has shape (4, 4) here and (6, 4) there."), str(errors[0])
    assert str(errors[1]).startswith("paramfsm.shard: rank 1 and rank 0 hold different models: parameter "
                                     "'0.weight' has shape (6, 4) here and (4, 4) there."), str(errors[1])
    assert str(errors[0]).endswith(
        "Every rank must build the same model (the same layer count, widths, dtypes and tied weights) before "
        "paramfsm.shard; build it from the same configuration on every rank."), str(errors[0])


def test_a_rank_whose_model_differs_is_named_by_the_others():
    _, errors, _ = _agreeing(3, lambda rank: _stack((4, 4, 3) if rank != 2 else (4, 4, 3, 1)))
    assert all(isinstance(e, ModelMismatch) for e in errors), errors
    assert "rank 0 and rank 2 hold different models: 4 parameters here and 6 there" in str(errors[0])
    assert "rank 1 and rank 2 hold different models" in str(errors[1])
    assert "rank 2 and rank 0 hold different models: 6 parameters here and 4 there" in str(errors[2])


def test_different_models_raise_under_sync_module_states_before_any_broadcast():
    """Rank 1 unties a weight: broadcasting first would pair rank 0's two tensors with rank 1's three."""
    def build(rank):
        model = _tied()
        if rank == 1:
            model.b.weight = nn.Parameter(model.a.weight.detach().clone())
        return model

    _, errors, _ = _agreeing(2, build, sync=True)
    assert all(isinstance(e, ModelMismatch) for e in errors), errors
    assert "parameter 'b.weight' has tying a.weight here and untied there" in str(errors[0]), str(errors[0])


def test_each_group_is_checked_and_synchronised_from_its_own_first_rank():
    """Four ranks in two shard groups {0, 1} and {2, 3}: each group starts from its own first rank's values."""
    pairs = {}

    def groups():
        made = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        pairs[dist.get_rank()] = made[dist.get_rank() // 2]
        return [pairs[dist.get_rank()]]

    results, errors, differ = _agreeing(4, lambda rank: _stack(seed=rank), groups, sync=True)
    assert errors == [None] * 4 and differ == [], (errors, differ)
    first, second = _values(_stack(seed=0)), _values(_stack(seed=2))
    assert all(torch.equal(a, b) for a, b in zip(results[1], first))
    assert all(torch.equal(a, b) for a, b in zip(results[3], second))
    assert not torch.equal(results[1][0], results[3][0])


def test_a_group_of_one_rank_checks_nothing():
    """Two ranks with different models, each in a group of its own: no collective, no error."""
    def groups():
        made = [dist.new_group([0]), dist.new_group([1])]
        return [made[dist.get_rank()]]

    _, errors, differ = _agreeing(2, lambda rank: _stack((4, 4 + rank, 3), seed=rank), groups)
    assert errors == [None, None] and differ == []


def test_a_mismatch_inside_one_group_is_named_with_the_ranks_of_that_group():
    """Groups {0, 1} and {2, 3}: rank 3's model differs from rank 2's; ranks 0 and 1 agree and go on."""
    def groups():
        made = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        return [made[dist.get_rank() // 2]]

    _, errors, _ = _agreeing(4, lambda rank: _stack((4, 4, 3) if rank != 3 else (4, 5, 3)), groups)
    assert errors[:2] == [None, None], errors
    assert all(isinstance(e, ModelMismatch) for e in errors[2:]), errors
    assert "rank 0 and rank 1 hold different models: parameter '0.weight' has shape (4, 4) here" in str(errors[2])
    assert "rank 1 and rank 0 hold different models: parameter '0.weight' has shape (5, 4) here" in str(errors[3])
