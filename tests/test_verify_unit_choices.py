"""verify checks the configuration users run: each program draws its unit choice, and its reproduction says it.

``Subject``'s unit settings default to ``shard()``'s, the draws cover a unit per module, the 64 KiB merge
whatever the environment says, one unit and ``by_size``, and ``shard()``'s own bucket size; a subject with
units of its own draws only its own and one unit. Each choice cuts ``sized_lm`` as it says.
"""

from __future__ import annotations

import pytest
from hypothesis import find

from paramfsm.engine.storage.units import select_unit_modules
from paramfsm.testing.subjects import experts_lm, sized_lm
from paramfsm.verify.loop_helpers import unit_arguments
from paramfsm.verify.ops import UNIT_CHOICES, Config, Program, Shape
from paramfsm.verify.programs import configs
from paramfsm.verify.reproduction import render
from paramfsm.verify.subject import Subject


def test_a_subject_defaults_to_shards_own_units():
    assert Subject.__attrs_attrs__.min_unit_bytes.default is None


@pytest.mark.parametrize("choice", UNIT_CHOICES)
def test_every_unit_choice_is_drawn_and_shards_as_it_says(choice, monkeypatch):
    monkeypatch.setenv("PARAMFSM_MIN_UNIT_BYTES", "0")  # "merged" must merge whatever the environment says
    drawn = find(configs(Shape(modules=("a", "b"))), lambda c: c.units == choice)
    assert drawn.units == choice
    subject = sized_lm()
    kwargs = unit_arguments(subject, Config(units=choice))
    units = [name for name in select_unit_modules(subject.model, kwargs["units"], kwargs["min_unit_bytes"])]
    expected = {"default": ["", "embed", "blocks.0.0", "blocks.0.2", "blocks.1.0", "blocks.1.2", "norm"],  # env 0
                "per_module": ["", "embed", "blocks.0.0", "blocks.0.2", "blocks.1.0", "blocks.1.2", "norm"],
                "merged": ["", "embed"], "one": [""]}
    if choice in expected:
        assert units == expected[choice], units
    else:  # by_size: fewer units than one per module, more than one
        assert 1 < len(units) < 7, units
    script = render(Program(Config(units=choice), ()), "paramfsm.testing.subjects:sized_lm", seed=0, per_rank=2,
                    message="the failure", world=2)
    assert f"units={choice!r}" in script
    assert {"default": "min_unit_bytes=subject.min_unit_bytes", "per_module": "min_unit_bytes=0",
            "merged": "min_unit_bytes=65536", "one": "units=lambda name, module: False",
            "by_size": "units=paramfsm.by_size(min_bytes=2048)"}[choice] in script


@pytest.mark.slow
def test_a_subject_with_units_of_its_own_draws_them_and_one_unit_only():
    shape = Shape(modules=("a",), own_units=True)
    assert find(configs(shape), lambda c: c.units == "one").units == "one"
    with pytest.raises(Exception):
        find(configs(shape), lambda c: c.units not in ("default", "one"))
    assert experts_lm().units is not None
    assert find(configs(shape), lambda c: c.bucket_bytes == 8 << 20).bucket_bytes == 8 << 20  # shard()'s own
