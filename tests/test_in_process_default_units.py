"""The default units (:mod:`paramfsm.engine.storage.default_units`), checked in the test process.

Which modules of ``torch.nn`` transformer stacks, of models declaring ``_no_split_modules``
and of plain module trees become units, where the ``min_unit_bytes`` boundary lies (a module
of exactly that size is a unit), how ``$PARAMFSM_MIN_UNIT_BYTES`` is read, and the table of
``rt.describe_units()``. Sizes are worked out by hand from the layers' shapes (float32: 4
bytes an element). Pure functions: no process group.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paramfsm.engine.storage import default_units
from paramfsm.engine.storage.default_units import MIN_UNIT_BYTES, MIN_UNIT_BYTES_ENV, describe, one_unit
from paramfsm.engine.storage.units import Unit, build_units, select_unit_modules

WHOLE_ENCODER = "reads its children (TransformerEncoderLayer)"
WHOLE_DECODER = "reads its children (TransformerDecoderLayer)"


@pytest.fixture(autouse=True)
def real_default(monkeypatch):
    """The suite sets $PARAMFSM_MIN_UNIT_BYTES=0 (tests/conftest.py); these tests choose their own."""
    monkeypatch.delenv(MIN_UNIT_BYTES_ENV, raising=False)


def _encoder() -> nn.TransformerEncoder:
    layer = nn.TransformerEncoderLayer(64, 2, dim_feedforward=128, batch_first=True)
    return nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(64), enable_nested_tensor=False)


# One encoder layer: in_proj 3*64*64 + 3*64, out_proj 64*64 + 64, linear1 64*128 + 128,
# linear2 128*64 + 64, two norms 2 * 128: 33,472 elements, 133,888 bytes.
LAYER_BYTES = 133_888


def test_an_encoder_stack_gets_one_unit_per_layer_and_its_small_norm_joins_the_root():
    model = _encoder()
    assert sum(p.numel() * p.element_size() for p in model.layers[0].parameters()) == LAYER_BYTES
    chosen = select_unit_modules(model, None)
    assert list(chosen) == ["", "layers.0", "layers.1"]
    assert chosen.reasons == {"": "root", "layers.0": WHOLE_ENCODER, "layers.1": WHOLE_ENCODER}
    assert chosen.merged == {"": ["norm"]}, "the 512-byte norm is smaller than 64 KiB"
    unmerged = select_unit_modules(model, None, min_unit_bytes=0)
    assert list(unmerged) == ["", "layers.0", "layers.1", "norm"]
    assert unmerged.reasons["norm"] == "owns parameters" and unmerged.merged == {}


def test_a_layer_of_exactly_min_unit_bytes_is_a_unit_and_one_byte_more_merges_it():
    assert list(select_unit_modules(_encoder(), None, min_unit_bytes=LAYER_BYTES)) == ["", "layers.0", "layers.1"]
    merged = select_unit_modules(_encoder(), None, min_unit_bytes=LAYER_BYTES + 1)
    assert list(merged) == [""]
    assert merged.merged == {"": ["layers.0", "layers.1", "norm"]}, "a whole layer joins whole, in module order"


def test_decoder_layers_and_a_full_transformer_keep_their_layers_whole():
    layer = nn.TransformerDecoderLayer(16, 2, dim_feedforward=32, batch_first=True)
    chosen = select_unit_modules(nn.TransformerDecoder(layer, 2), None, min_unit_bytes=0)
    assert chosen.reasons == {"": "root", "layers.0": WHOLE_DECODER, "layers.1": WHOLE_DECODER}
    full = nn.Transformer(16, 2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=32, batch_first=True)
    chosen = select_unit_modules(full, None, min_unit_bytes=0)
    assert list(chosen) == ["", "encoder.layers.0", "encoder.norm", "decoder.layers.0", "decoder.norm"]
    assert chosen.reasons["encoder.layers.0"] == WHOLE_ENCODER and chosen.reasons["decoder.layers.0"] == WHOLE_DECODER


def test_attention_stays_whole_and_a_sibling_sharing_its_name_prefix_does_not():
    model = nn.Module()
    model.attn = nn.MultiheadAttention(8, 2)
    model.attn_out = nn.Linear(8, 8)
    chosen = select_unit_modules(model, None, min_unit_bytes=0)
    assert chosen.reasons == {"": "root", "attn": "reads its children (MultiheadAttention)",
                              "attn_out": "owns parameters"}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)


class Net(nn.Module):
    """Two blocks and a head; the test sets ``_no_split_modules`` on an instance."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(4, 2)


PER_LINEAR = ["", "blocks.0.a", "blocks.0.b", "blocks.1.a", "blocks.1.b", "head"]


@pytest.mark.parametrize("kind", [list, tuple, set, frozenset])
def test_declared_blocks_are_one_unit_each_in_any_container(kind):
    model = Net()
    model._no_split_modules = kind(["Block"])
    chosen = select_unit_modules(model, None, min_unit_bytes=0)
    assert chosen.reasons == {"": "root", "blocks.0": "_no_split_modules (Block)",
                              "blocks.1": "_no_split_modules (Block)", "head": "owns parameters"}


def test_only_names_declared_in_a_container_count_on_any_module():
    for declared in ("Block", [Block, 3]):  # a bare string, and entries that are not names
        model = Net()
        model._no_split_modules = declared
        assert list(select_unit_modules(model, None, min_unit_bytes=0)) == PER_LINEAR, declared
    model = Net()
    model.blocks._no_split_modules = ["Block"]  # declared below the root: it counts too
    assert list(select_unit_modules(model, None, min_unit_bytes=0)) == ["", "blocks.0", "blocks.1", "head"]


def test_a_declaration_wins_over_the_torch_nn_rule_and_a_small_block_merges_whole():
    class MyLayer(nn.TransformerEncoderLayer):
        pass

    model = nn.Sequential(MyLayer(8, 2, dim_feedforward=8))
    model._no_split_modules = ["MyLayer"]
    assert select_unit_modules(model, None, min_unit_bytes=0).reasons["0"] == "_no_split_modules (MyLayer)"
    small = Net()
    small._no_split_modules = ["Block"]  # each block: 2 * 80 bytes
    chosen = select_unit_modules(small, None)
    assert list(chosen) == [""] and chosen.merged == {"": ["blocks.0", "blocks.1", "head"]}


def test_a_model_declaring_its_own_class_is_one_unit():
    class Whole(nn.Module):
        _no_split_modules = ["Whole"]

        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)

    chosen = select_unit_modules(Whole(), None, min_unit_bytes=0)
    assert list(chosen) == [""] and chosen.reasons == {"": "root"} and chosen.merged == {}


def _parent_with_children(child_out: int) -> nn.Module:
    """A parent owning 40 bytes (10 elements) with two bias-free ``Linear(4, child_out)`` children."""
    parent = nn.Module()
    parent.own = nn.Parameter(torch.zeros(10))
    parent.x = nn.Linear(4, child_out, bias=False)
    parent.y = nn.Linear(4, child_out, bias=False)
    model = nn.Module()
    model.parent = parent
    return model


def test_small_children_add_their_bytes_to_the_parent_and_units_below_do_not():
    # Children of 4*2*4 = 32 bytes each, merged at 100: the parent counts 40 + 64 = 104 bytes.
    chosen = select_unit_modules(_parent_with_children(2), None, min_unit_bytes=100)
    assert list(chosen) == ["", "parent"] and chosen.merged == {"parent": ["parent.x", "parent.y"]}
    chosen = select_unit_modules(_parent_with_children(2), None, min_unit_bytes=105)
    assert list(chosen) == [""] and chosen.merged == {"": ["parent", "parent.x", "parent.y"]}
    # Children of 4*8*4 = 128 bytes are units: the parent keeps 40 bytes and joins the root.
    chosen = select_unit_modules(_parent_with_children(8), None, min_unit_bytes=100)
    assert list(chosen) == ["", "parent.x", "parent.y"] and chosen.merged == {"": ["parent"]}
    chosen = select_unit_modules(_parent_with_children(8), None, min_unit_bytes=41)
    assert list(chosen) == ["", "parent.x", "parent.y"], "a unit below adds nothing: 40 bytes are fewer than 41"


def test_merged_modules_are_listed_in_module_order_not_by_name():
    model = nn.Module()
    model.b = nn.Linear(1, 1)
    model.a = nn.Linear(1, 1)
    model.parent = nn.Linear(32, 32)
    model.parent.z = nn.Linear(1, 1)
    model.parent.y = nn.Linear(1, 1)
    chosen = select_unit_modules(model, None, min_unit_bytes=1000)
    assert chosen.merged == {"": ["b", "a"], "parent": ["parent.z", "parent.y"]}


def test_a_tied_weight_counts_in_each_module_registering_it():
    model = nn.Module()
    model.emb = nn.Embedding(10, 4)  # 160 bytes
    model.head = nn.Linear(4, 10, bias=False)
    model.head.weight = model.emb.weight
    assert list(select_unit_modules(model, None, min_unit_bytes=160)) == ["", "emb", "head"]
    assert list(select_unit_modules(model, None, min_unit_bytes=161)) == [""]


@pytest.mark.parametrize("text, expected", [("", MIN_UNIT_BYTES), ("   ", MIN_UNIT_BYTES), ("0", 0),
                                            (" 4096 ", 4096)])
def test_the_environment_variable_is_read_when_no_value_is_given(monkeypatch, text, expected):
    monkeypatch.setenv(MIN_UNIT_BYTES_ENV, text)
    assert default_units.min_unit_bytes() == expected
    assert default_units.min_unit_bytes(7) == 7 and default_units.min_unit_bytes(0) == 0


def test_the_default_without_the_variable_is_64_kib():
    assert default_units.min_unit_bytes() == MIN_UNIT_BYTES == 65_536


@pytest.mark.parametrize("text", ["-1", "64K", "1.5"])
def test_a_bad_environment_value_is_refused_naming_it(monkeypatch, text):
    monkeypatch.setenv(MIN_UNIT_BYTES_ENV, text)
    with pytest.raises(ValueError) as info:
        default_units.min_unit_bytes()
    assert str(info.value) == (f"PARAMFSM_MIN_UNIT_BYTES={text!r}: expected a number of bytes >= 0 "
                               "(0: no module merges)")


def test_one_unit_writes_a_predicate_that_makes_the_module_one_unit():
    assert one_unit("") == "lambda name, module: name == ''"
    text = one_unit("blocks.0")
    assert text == ("lambda name, module: name == 'blocks.0' or (not name.startswith('blocks.0.') "
                    "and any(True for _ in module.parameters(recurse=False)))")
    chosen = select_unit_modules(Net(), eval(text))
    assert list(chosen) == ["", "blocks.0", "blocks.1.a", "blocks.1.b", "head"]


HEADER = "unit  module  params  elements  bytes  why"


def test_describe_lays_out_the_units_as_a_table():
    model = nn.Sequential(nn.Linear(40, 40), *(nn.Linear(1, 1) for _ in range(9)))
    units, _ = build_units(model, select_unit_modules(model, None, min_unit_bytes=1000), rank=0, world=1)
    assert describe(units).splitlines() == [
        HEADER,
        "0     <root>  18      18        72     root; merged into it because smaller than min_unit_bytes: "
        "1, 2, 3, 4, 5, 6, 7, 8 and 1 more",
        "1     0       2       1,640     6,560  owns parameters",
    ]


def test_describe_names_up_to_eight_merged_modules_and_a_missing_reason_reads_owns_parameters():
    eight = [str(i) for i in range(8)]
    text = describe([Unit(0, "", nn.Module(), [], reason="root", merged=eight), Unit(1, "x", nn.Module(), [])])
    assert text.splitlines() == [
        HEADER,
        "0     <root>  0       0         0      root; merged into it because smaller than min_unit_bytes: "
        "0, 1, 2, 3, 4, 5, 6, 7",
        "1     x       0       0         0      owns parameters",
    ]
    ten = describe([Unit(0, "", nn.Module(), [], reason="root", merged=[str(i) for i in range(10)])])
    assert ten.endswith(": 0, 1, 2, 3, 4, 5, 6, 7 and 2 more")
