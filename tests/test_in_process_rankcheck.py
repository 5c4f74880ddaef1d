"""The rank-order check (:mod:`paramfsm.engine.effects.rankcheck`), in the test process.

What a user meets is the RankDesync message: which ranks issued which
collective, for which unit and step, and the module to make one unit. The
tags are bytes in a float buffer, so their round trip is checked in every
dtype a bucket can have. ``tests/test_rank_desync_default.py`` and
``tests/test_failures.py`` reach the same code through spawned gloo ranks;
here it runs where ``make mutate`` sees it, the header's all-gather on
threaded ranks (``threaded_ranks``).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paramfsm.engine.effects import rankcheck
from paramfsm.engine.effects.gloo.agreement import HEADER
from paramfsm.engine.storage.default_units import one_unit
from paramfsm.errors import RankDesync
from threaded_ranks import on_ranks

NAMES = ("<root>", "layers.0", "layers.1")
FIELD = st.integers(min_value=0, max_value=(1 << 32) - 1)
ADVICE_HEAD = ("if a data-dependent branch runs a module on some ranks only, or more often on some (a mixture of "
               "experts, an early exit, a loss that reads another output head on each rank), make the module "
               "enclosing the branch one unit, so every rank gathers and reduces it whole: ")


def _rows(*tags, dtype=torch.float32) -> torch.Tensor:
    return torch.stack([rankcheck.encode(tag, dtype, "cpu") for tag in tags])


def test_a_tag_is_its_fields_little_endian_bytes():
    assert rankcheck.TAG_NUMEL == 16
    assert rankcheck.encode((1, 258, 0x01020304, 0), torch.float32, "cpu").tolist() == [
        1, 0, 0, 0, 2, 1, 0, 0, 4, 3, 2, 1, 0, 0, 0, 0]
    assert rankcheck.encode((7, 0, 0, 0), torch.bfloat16, "cpu").dtype == torch.bfloat16


@settings(max_examples=60, deadline=None)
@given(tags=st.lists(st.tuples(FIELD, FIELD, FIELD, FIELD), min_size=1, max_size=4),
       dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]))
def test_every_rank_s_tag_comes_back_from_the_bucket_in_every_dtype(tags, dtype):
    assert rankcheck.decode(_rows(*tags, dtype=dtype)) == [tuple(tag) for tag in tags]


def test_the_same_tag_on_every_rank_passes():
    assert rankcheck.check_encoded(_rows((5, 3, 1, 100), (5, 3, 1, 100)), 0, NAMES) is None


def test_a_different_unit_names_both_ranks_collectives_and_the_model_to_make_one_unit():
    with pytest.raises(RankDesync) as caught:
        rankcheck.check_encoded(_rows((5, 3, 1, 100), (5, 3, 2, 100)), 0, NAMES)
    err = caught.value
    assert (err.rank, err.unit, err.step) == (0, "layers.0", 3)
    assert err.detail == ("ranks [0, 1] issued different collectives (rank 0: all-gather #5 for unit 'layers.0' at "
                          "step 3 (100 elements per rank); rank 1: all-gather #5 for unit 'layers.1' at step 3 "
                          "(100 elements per rank))")
    assert str(err).endswith(ADVICE_HEAD + "here the model itself, which holds 'layers.0' and 'layers.1': "
                             "paramfsm.shard(model, units=[type(model)])")
    assert str(err).startswith("rank desync detected on rank 0 at step 3, unit 'layers.0': ")


def test_each_rank_reports_its_own_collective_and_every_rank_that_differs_from_it():
    rows = _rows((5, 3, 1, 100), (5, 3, 1, 100), (6, 4, 2, 50))
    with pytest.raises(RankDesync) as caught:
        rankcheck.check_encoded(rows, 2, NAMES)
    err = caught.value
    assert (err.rank, err.unit, err.step) == (2, "layers.1", 4)
    assert err.detail.startswith("ranks [0, 1, 2] issued different collectives (")
    assert "rank 2: all-gather #6 for unit 'layers.1' at step 4 (50 elements per rank))" in err.detail
    with pytest.raises(RankDesync) as first:
        rankcheck.check_encoded(rows, 0, NAMES)
    assert first.value.detail.startswith("ranks [0, 2] issued")


def test_a_unit_index_past_the_names_is_shown_by_number():
    with pytest.raises(RankDesync) as caught:
        rankcheck.check_encoded(_rows((1, 0, 9, 4), (1, 0, 0, 4)), 0, NAMES)
    assert caught.value.unit == "#9"
    assert "for unit '#9'" in caught.value.detail and "for unit '<root>'" in caught.value.detail


def test_the_advice_names_the_module_enclosing_the_branch():
    names = ("<root>", "model.layers.3.mlp", "model.layers.3.attn")
    with pytest.raises(RankDesync) as caught:
        rankcheck.check_encoded(_rows((2, 1, 1, 8), (2, 1, 2, 8)), 1, names)
    assert str(caught.value).endswith(
        ADVICE_HEAD + f"probably 'model.layers.3': paramfsm.shard(model, units={one_unit('model.layers.3')}) "
        "or units=[its class]")


def test_the_root_in_a_desync_points_at_the_model_itself():
    with pytest.raises(RankDesync) as caught:
        rankcheck.check_encoded(_rows((2, 1, 0, 8), (2, 1, 0, 9)), 0, NAMES)
    assert str(caught.value).endswith(ADVICE_HEAD + "here the model itself: paramfsm.shard(model, units=[type(model)])")


@pytest.mark.parametrize("names, enclosing", [
    (["model.layers.3.mlp", "model.layers.4"], "model.layers.3"),
    (["blocks.0", "blocks.1"], ""),
    (["a", "b"], ""),
    (["encoder.block", "decoder.block.ff"], "decoder.block"),
    (["experts.2.w1", "head"], "experts.2"),
    (["<root>"], None),
    (["<full parameter 'w'>", "<all-reduce of the gradient norm>"], None),
    ([], None),
])
def test_the_enclosing_module_is_the_deepest_parent_past_containers(names, enclosing):
    assert rankcheck.enclosing_module(names) == enclosing


def _header(named, kind, exchanges, nbytes, run, number, step, unit, elements):
    row = dict(named=named, kind=kind, exchanges=exchanges, digest=0, bytes=nbytes, run=run, prediction=0,
               number=number, step=step, unit=unit, elements=elements)
    return [row[name] for name in HEADER]


def test_a_refused_exchange_says_how_many_exchanges_each_rank_had():
    rows = torch.tensor([_header(1, rankcheck.GATHER, 1, 400, 0, 7, 2, 1, 100),
                         _header(1, rankcheck.GATHER, 2, 400, 0, 7, 2, 2, 100)])
    err = rankcheck.refused(rows, 1, NAMES, "all-gather", 2)
    assert (err.rank, err.unit, err.step) == (1, "layers.1", 2)
    assert err.detail == (
        "ranks [0, 1] issued different collectives (rank 0: all-gather #7 for unit 'layers.0' at step 2 (100 "
        "elements per rank) in 1 exchange; rank 1: all-gather #7 for unit 'layers.1' at step 2 (100 elements per "
        "rank) in 2 exchanges)")


def test_a_refused_exchange_that_names_no_unit_shows_its_bytes_and_whether_the_runs_differ():
    rows = torch.tensor([_header(0, rankcheck.REDUCE, 1, 64, 0, 0, 0, 0, 0),
                         _header(1, rankcheck.GATHER, 1, 400, 3, 9, 5, 2, 100)])
    err = rankcheck.refused(rows, 0, NAMES, "reduce-scatter", 11)
    assert (err.rank, err.unit, err.step) == (0, "reduce-scatter", 11)
    assert err.detail == (
        "ranks [0, 1] issued different collectives (rank 0: reduce-scatter of 64 bytes per peer that names no unit "
        "(a full tensor's gather) (after other collectives than the other ranks'); rank 1: all-gather #9 for "
        "unit 'layers.1' at step 5 (100 elements per rank) (after other collectives than the other ranks'))")


def test_an_unknown_kind_in_a_refused_header_stands_for_this_rank_s_collective():
    rows = torch.tensor([_header(1, 0, 1, 8, 0, 1, 1, 1, 2), _header(1, 0, 1, 8, 0, 1, 1, 2, 2)])
    err = rankcheck.refused(rows, 0, NAMES, "reduce-scatter", 1)
    assert "rank 0: reduce-scatter #1 for unit 'layers.0'" in err.detail


def _headers(fields_of, what_of, waits):
    def job(rank):
        def wait(work):
            waits.append(rank)
            work.wait()
        rankcheck.check_header(fields_of(rank), rank, 2, None, NAMES, what_of(rank), wait)
        return "passed"
    return on_ranks(2, job)


def test_a_header_that_agrees_passes_on_every_rank_through_the_given_wait():
    waits: list = []
    results, errors = _headers(lambda rank: (3, 1, 2, -1), lambda rank: "all-gather", waits)
    assert errors == [None, None] and results == ["passed", "passed"]
    assert sorted(waits) == [0, 1]


def test_a_header_that_differs_raises_on_every_rank_naming_each_rank_s_kind():
    results, errors = _headers(lambda rank: (3, 1, 2, 10),
                               lambda rank: "all-gather" if rank == 0 else "reduce-scatter", [])
    assert results == [None, None]
    assert all(isinstance(err, RankDesync) for err in errors), errors
    lines = ("rank 0: all-gather #3 for unit 'layers.1' at step 1 (10 elements per rank); rank 1: reduce-scatter #3 "
             "for unit 'layers.1' at step 1 (10 elements per rank)")
    assert [err.detail for err in errors] == [f"ranks [0, 1] issued different collectives ({lines})"] * 2
    assert [err.rank for err in errors] == [0, 1]


def test_a_header_names_the_step_each_rank_is_at():
    results, errors = _headers(lambda rank: (3, rank, 0, 10), lambda rank: "all-gather", [])
    assert [(err.step, err.unit) for err in errors] == [(0, "<root>"), (1, "<root>")]


def test_values_are_kept_per_group_and_none_stands_for_the_default_group():
    def job(rank):
        import torch.distributed as dist
        from paramfsm.engine.effects.groups import PerGroup, _on, _plain_wait

        kept = PerGroup()
        other = dist.new_group([0, 1])
        kept.set(None, "world's")
        kept.set(other, rank, key="rank")
        waiter = object()
        return (kept.get(dist.group.WORLD), kept.get(None, "rank", "none"), kept.get(other, "rank"),
                kept.get(other), kept.get(other, default="nothing"), _on(torch.zeros(1), waiter) is waiter,
                _on(torch.zeros(1), None) is _plain_wait)

    results, errors = on_ranks(2, job)
    assert errors == [None, None]
    assert results == [("world's", "none", rank, None, "nothing", True, True) for rank in range(2)]


def test_a_unit_index_just_past_the_names_is_shown_by_number():
    with pytest.raises(RankDesync) as caught:
        rankcheck.check_encoded(_rows((1, 0, len(NAMES), 4), (1, 0, 0, 4)), 0, NAMES)
    assert caught.value.unit == f"#{len(NAMES)}"


def test_the_root_beside_a_module_still_names_the_module():
    names = ("<root>", "model.layers.3.mlp")
    with pytest.raises(RankDesync) as caught:
        rankcheck.check_encoded(_rows((2, 1, 0, 8), (2, 1, 1, 8)), 0, names)
    assert f"probably 'model.layers.3': paramfsm.shard(model, units={one_unit('model.layers.3')})" in str(caught.value)


def test_full_tensors_alone_get_no_advice_about_units():
    names = ("<full parameter 'w'>", "<full gradient 'w'>")
    with pytest.raises(RankDesync) as caught:
        rankcheck.check_encoded(_rows((2, 1, 0, 8), (2, 1, 1, 8)), 0, names)
    assert str(caught.value).endswith("make branch decisions from values that are identical on all ranks.")


def test_a_refused_exchange_that_names_no_unit_leaves_it_out_of_the_advice():
    rows = torch.tensor([_header(0, rankcheck.GATHER, 1, 64, 0, 0, 0, 0, 0),
                         _header(1, rankcheck.GATHER, 1, 400, 0, 9, 5, 2, 100)])
    err = rankcheck.refused(rows, 1, NAMES, "all-gather", 5)
    assert str(err).endswith(ADVICE_HEAD + "here the model itself, which holds 'layers.1': "
                             "paramfsm.shard(model, units=[type(model)])")
    assert "(after other collectives" not in err.detail


def test_collectives_of_the_same_run_are_not_said_to_follow_others():
    rows = torch.tensor([_header(1, rankcheck.GATHER, 1, 400, 2, 7, 2, 1, 100),
                         _header(1, rankcheck.GATHER, 1, 400, 2, 8, 2, 2, 100)])
    err = rankcheck.refused(rows, 0, NAMES, "all-gather", 2)
    assert "after other collectives" not in err.detail and "exchange" not in err.detail


def test_a_header_of_a_collective_it_does_not_know_names_it_as_the_caller_does():
    results, errors = _headers(lambda rank: (3, 1, 2, 10), lambda rank: "broadcast" if rank == 0 else "all-gather", [])
    assert all(isinstance(err, RankDesync) for err in errors), errors
    assert errors[0].detail.startswith("ranks [0, 1] issued different collectives (rank 0: broadcast #3 for unit")
    assert "rank 1: all-gather #3" in errors[0].detail


def test_a_group_never_set_gives_the_default():
    from paramfsm.engine.effects.groups import PerGroup

    def job(rank):
        return PerGroup().get(None, "key", default=rank + 10)

    results, errors = on_ranks(2, job)
    assert errors == [None, None] and results == [10, 11]
