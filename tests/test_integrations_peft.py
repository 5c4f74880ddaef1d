"""LoRA on a sharded tiny Llama (2 gloo ranks): train, save the adapter, reload it into plain PEFT.

Each rank trains on half of every global batch; a plain PEFT model trains in
one process on the whole batch. :func:`paramfsm.integrations.peft.save_adapter`
writes the adapter from the sharded model; a plain ``PeftModel.from_pretrained``
of a fresh base model loads it, and its logits must equal the sharded model's
and the plain run's. PEFT's own ``save_pretrained`` without a state dict
raises ``NotGathered`` on the sharded model, which is why the helper exists.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch

import paramfsm


@pytest.fixture(scope="module")
def ranks2(in_process2):
    """This file's two ranks are threads of the test process (``gloo_ranks.py``), where ``make mutate`` sees
    them; a test that needs processes of its own asks for ``suite_ranks2``."""
    return in_process2


transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

from paramfsm.integrations import peft as sharded_peft  # noqa: E402 - after the skips

VOCAB, SEQ, PER_RANK, WORLD, STEPS = 64, 8, 2, 2, 3
PROMPT = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(9))


def base_model():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB,
                                      max_position_embeddings=32, tie_word_embeddings=False,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(config)


def lora_model(modules_to_save=None):
    config = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"],
                             init_lora_weights="gaussian",  # B nonzero: the first step already moves logits
                             modules_to_save=modules_to_save)
    torch.manual_seed(1)
    return peft.get_peft_model(base_model(), config)


def batches():
    tokens = torch.randint(1, VOCAB, (STEPS, PER_RANK * WORLD, SEQ), generator=torch.Generator().manual_seed(3))
    return list(tokens)


def train(model, rows):
    """AdamW over the trainable parameters; ``rows`` picks this process's part of each global batch."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for batch in batches():
        part = batch[rows]
        opt.zero_grad()
        model(input_ids=part, labels=part).loss.backward()
        opt.step()


def sharded_job(rank, world, modules_to_save=None, fallback=False):
    model = lora_model(modules_to_save)
    rt = paramfsm.shard(model)
    train(model, slice(rank * PER_RANK, (rank + 1) * PER_RANK))
    model.eval()
    with torch.no_grad():
        logits = model(PROMPT).logits
    with tempfile.TemporaryDirectory() as scratch:
        where = [scratch]
        torch.distributed.broadcast_object_list(where, src=0)
        out = os.path.join(where[0], "adapter")
        try:
            model.save_pretrained(out)
            own_save = "no error"
        except paramfsm.NotGathered as exc:
            own_save = type(exc).__name__
        if fallback:  # every tensor of the model, of which PEFT keeps the adapter's
            sharded_peft.save_adapter(rt, out, state_dict=rt.full_state_dict(rank0_only=True))
        else:
            sharded_peft.save_adapter(rt, out)
        files = sorted(os.listdir(out))
        loaded = peft.PeftModel.from_pretrained(base_model(), out).eval()
        with torch.no_grad():
            loaded_logits = loaded(PROMPT).logits
        torch.distributed.barrier()  # rank 0's folder stays until every rank has read it
    trainable = sharded_peft.trainable_state_dict(rt, rank0_only=True)
    rt.close()
    return {"logits": logits, "loaded_logits": loaded_logits, "files": files, "own_save": own_save,
            "trainable": sorted(trainable)}


def plain_job(rank, world, modules_to_save=None, rows=slice(None)):
    """Plain PEFT in one process, on ``rows`` of every global batch (all of them: the global batch)."""
    model = lora_model(modules_to_save)
    train(model, rows)
    model.eval()
    with torch.no_grad():
        logits = model(PROMPT).logits
    with tempfile.TemporaryDirectory() as out:
        model.save_pretrained(out)
        files = sorted(os.listdir(out))
    keys = sorted(name for name, p in model.named_parameters() if p.requires_grad)
    return {"logits": logits, "files": files, "trainable": keys}


@pytest.mark.slow  # over 5 s on two cores: make test-slow
def test_lora_adapter_saved_from_shards_reloads_into_plain_peft(ranks2, ranks1):
    ours, other = ranks2.run(sharded_job)
    (plain,) = ranks1.run(plain_job)
    untrained = lora_model().eval()
    with torch.no_grad():
        start = untrained(PROMPT).logits
    assert (plain["logits"] - start).abs().max() > 1e-2, "training must move the logits for the test to see it"
    for report in (ours, other):
        assert report["own_save"] == "NotGathered"
        assert report["files"] == plain["files"], report["files"]
        assert (report["loaded_logits"] - report["logits"]).abs().max() < 1e-6
        assert torch.allclose(report["loaded_logits"], plain["logits"], atol=1e-5)
    assert ours["trainable"] == plain["trainable"] and len(plain["trainable"]) == 8
    assert other["trainable"] == [], "rank0_only: the other ranks keep no full tensor"


@pytest.mark.parametrize("fallback", [False, True], ids=["save_adapter", "full_state_dict"])
def test_an_adapter_with_modules_to_save_is_saved_and_reloads_into_plain_peft(ranks2, ranks1, fallback):
    """``modules_to_save=["lm_head"]``: PEFT lists the wrapped head's keys from the live module, which raised
    NotGathered on rank 0 while rank 1 waited in the barrier (see [Note: PEFT lists some keys from the live
    module]). The trained head and LoRA weights reload into plain PEFT with plain PEFT's logits."""
    ours, other = ranks2.run(sharded_job, ["lm_head"], fallback, timeout=120)
    (plain,) = ranks1.run(plain_job, ["lm_head"])
    assert any("modules_to_save" in key for key in plain["trainable"]), plain["trainable"]
    for report in (ours, other):
        assert report["files"] == plain["files"], report["files"]
        assert (report["loaded_logits"] - report["logits"]).abs().max() < 1e-6
        assert torch.allclose(report["loaded_logits"], plain["logits"], atol=1e-5)
    assert ours["trainable"] == plain["trainable"]


def not_peft_job(rank, world):
    rt = paramfsm.shard(base_model())
    try:
        sharded_peft.save_adapter(rt, "unused")
    except paramfsm.ParamFSMError as exc:
        return str(exc)
    finally:
        rt.close()


def test_save_adapter_of_a_model_without_adapters_names_what_to_do(ranks1):
    (message,) = ranks1.run(not_peft_job)
    assert "LlamaForCausalLM is not a PEFT model" in message and "get_peft_model" in message, message
    assert "rank 0" in message


def failed_write_job(rank, world, folder):
    import time

    model = lora_model()
    rt = paramfsm.shard(model)
    target = os.path.join(folder, "a-file-not-a-folder")
    if rank == 0:
        open(target, "w").close()  # rank 0, the writer, cannot make its folder there
    torch.distributed.barrier()
    start = time.monotonic()
    try:
        sharded_peft.save_adapter(rt, target)
        outcome = "no error"
    except Exception as exc:  # noqa: BLE001 - rank 0 raises PEFT's own error, the others ParamFSMError
        outcome = f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - start
    rt.close()
    return outcome, seconds


def test_a_save_adapter_that_fails_on_the_writer_raises_on_every_rank(ranks2, tmp_path):
    """Rank 0 writes alone; its failure used to leave the other ranks in the barrier after it."""
    (writer, writer_s), (other, other_s) = ranks2.run(failed_write_job, str(tmp_path), timeout=120)
    assert writer != "no error" and "ParamFSMError" not in writer.split(":")[0], writer
    assert other.startswith("ParamFSMError: save_adapter to ") and "failed on rank 0" in other, other
    assert max(writer_s, other_s) < 30
