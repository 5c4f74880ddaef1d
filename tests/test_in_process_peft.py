"""``paramfsm.integrations.peft`` on one rank, in the test process (``one_rank``).

The jobs of ``tests/test_integrations_peft.py`` (two gloo ranks) run here on a
world-1 group, against plain PEFT trained on the same rows, so ``make mutate``
sees ``save_adapter`` and ``trainable_state_dict``: the adapter written from
the shards reloads into plain PEFT with plain PEFT's logits, with and without
``modules_to_save`` and through a full state dict, and each refusal names
what to do.
"""

from __future__ import annotations

import os

import pytest
import torch

import paramfsm

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from one_rank import one_rank  # noqa: E402,F401 - the fixture
from paramfsm.integrations import peft as sharded_peft  # noqa: E402 - after the skips
from test_integrations_peft import (  # noqa: E402 - the jobs both files run
    PER_RANK, PROMPT, base_model, failed_write_job, lora_model, not_peft_job, plain_job, sharded_job, train,
)

ROWS = slice(0, PER_RANK)  # rank 0's rows of every global batch: what one rank trains on


@pytest.mark.parametrize("modules_to_save, fallback", [(None, False), (["lm_head"], False), (["lm_head"], True)],
                         ids=["lora", "modules_to_save", "full_state_dict"])
def test_the_adapter_saved_from_shards_reloads_into_plain_peft(one_rank, modules_to_save, fallback):
    ours, plain = sharded_job(0, 1, modules_to_save, fallback), plain_job(0, 1, modules_to_save, ROWS)
    untrained = lora_model(modules_to_save).eval()
    with torch.no_grad():
        assert (plain["logits"] - untrained(PROMPT).logits).abs().max() > 1e-2, "training must move the logits"
    assert ours["own_save"] == "NotGathered"
    assert ours["files"] == plain["files"], ours["files"]
    assert (ours["loaded_logits"] - ours["logits"]).abs().max() < 1e-6
    assert torch.allclose(ours["loaded_logits"], plain["logits"], atol=1e-5)
    assert ours["trainable"] == plain["trainable"]
    assert len(plain["trainable"]) == (8 if modules_to_save is None else 9)


def test_the_trainable_state_dict_holds_the_trained_values_only(one_rank):
    model = lora_model()
    rt = paramfsm.shard(model)
    train(model, ROWS)
    full = sharded_peft.trainable_state_dict(rt)
    plain = lora_model()
    train(plain, ROWS)
    want = {name: p.detach() for name, p in plain.named_parameters() if p.requires_grad}
    assert sorted(full) == sorted(want)
    for name, value in want.items():
        assert torch.allclose(full[name], value, atol=1e-6), name
    rt.close()


def test_a_model_without_adapters_is_refused_naming_what_to_do(one_rank):
    message = not_peft_job(0, 1)
    assert "LlamaForCausalLM is not a PEFT model" in message and "get_peft_model" in message, message
    assert "rank 0" in message


def test_a_write_that_fails_raises_the_writer_s_own_error(one_rank, tmp_path):
    outcome, seconds = failed_write_job(0, 1, str(tmp_path))
    assert outcome != "no error" and "ParamFSMError" not in outcome.split(":")[0], outcome
    assert seconds < 30


def test_saving_to_a_fresh_folder_writes_what_plain_peft_writes(one_rank, tmp_path):
    model = lora_model()
    rt = paramfsm.shard(model)
    sharded_peft.save_adapter(rt, str(tmp_path / "a" / "b"))
    assert sorted(os.listdir(tmp_path / "a" / "b")) == plain_job(0, 1, None, ROWS)["files"]
    rt.close()


def test_the_refusals_say_what_to_do(one_rank, tmp_path):
    rt = paramfsm.shard(base_model())
    with pytest.raises(paramfsm.ParamFSMError) as caught:
        sharded_peft.save_adapter(rt, tmp_path)
    assert str(caught.value) == (
        "save_adapter: the sharded LlamaForCausalLM is not a PEFT model (rank 0); shard the PeftModel "
        "(paramfsm.shard(get_peft_model(base, config))), or save a plain model with save_pretrained(d, "
        "state_dict=rt.full_state_dict(rank0_only=True))")
    rt.close()
    model = lora_model()
    for p in model.parameters():
        p.requires_grad_(False)
    rt = paramfsm.shard(model)
    with pytest.raises(paramfsm.ParamFSMError) as caught:
        sharded_peft.save_adapter(rt, tmp_path)
    assert str(caught.value) == (
        "save_adapter: 'PeftModel' has no trainable parameter to save (rank 0); an adapter is saved "
        "from its trainable parameters (was the model frozen after get_peft_model?)")
    assert os.listdir(tmp_path) == []
    rt.close()


def test_peft_s_own_options_pass_through(one_rank, tmp_path):
    model = lora_model()
    rt = paramfsm.shard(model)
    sharded_peft.save_adapter(rt, tmp_path / "bin", safe_serialization=False)
    assert sorted(os.listdir(tmp_path / "bin")) == ["README.md", "adapter_config.json", "adapter_model.bin"]
    rt.close()


def test_the_trainable_state_dict_on_rank_0_is_on_the_cpu_and_skips_frozen_tensors(one_rank):
    model = lora_model()
    rt = paramfsm.shard(model)
    full = sharded_peft.trainable_state_dict(rt, rank0_only=True)
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert full and not set(full) & frozen
    assert all(value.device.type == "cpu" for value in full.values())
    assert all(torch.equal(full[name], rt.full_param(name)) for name in full)
    rt.close()


def test_the_writer_logs_what_it_writes(one_rank, tmp_path, caplog):
    rt = paramfsm.shard(lora_model())
    with caplog.at_level("INFO", logger="paramfsm.integrations.peft"):
        sharded_peft.save_adapter(rt, tmp_path / "a")
    assert [r.getMessage() for r in caplog.records if r.name == "paramfsm.integrations.peft"] == [
        f"writing 8 adapter tensors to {tmp_path / 'a'}"]
    rt.close()


def test_a_plain_module_is_refused_as_not_peft(one_rank, tmp_path):
    rt = paramfsm.shard(torch.nn.Linear(4, 4))
    with pytest.raises(paramfsm.ParamFSMError, match=r"save_adapter: the sharded Linear is not a PEFT model"):
        sharded_peft.save_adapter(rt, tmp_path)
    rt.close()
