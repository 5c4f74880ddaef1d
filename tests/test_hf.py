"""Hugging Face models on 2 gloo ranks, built from tiny configs with random weights (no hub access).

GPT-2 (tied LM head) and Llama (untied) each train the two-loss retained-graph
loop with the Trainer's optimizer recipe (AdamW over ``named_parameters()``,
weight decay off for biases and norms) against plain torch; the full state
dict goes through ``save_pretrained`` / ``from_pretrained`` and gives the same
logits; ``generate()`` under ``no_grad`` gives the same tokens as the plain model.
``rt.generate`` with a different prompt and length per rank matches the plain
model per prompt; ``save_pretrained(state_dict=rt.full_state_dict())`` of GPT-2
and BERT writes the same file as a plain save, one all-gather per parameter.
(The Trainer is tested in test_hf_trainer.py.)
"""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch

import paramfsm
from paramfsm import State
from paramfsm.testing import Reference, assert_close_dicts, rank_slice, sharded_params

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, PER_RANK = 64, 8, 2
ADAM = {"lr": 1e-2, "eps": 1e-3}  # see [Note: Adam's eps in comparisons] in test_torch_edges.py


def build(kind: str):
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                         bos_token_id=0, eos_token_id=0)
        return transformers.GPT2LMHeadModel(config)
    if kind == "bert":
        config = transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=32,
                                         hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return transformers.BertForMaskedLM(config)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB,
                                      max_position_embeddings=32, tie_word_embeddings=False,
                                      bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(config)


def trainer_groups(model, weight_decay=0.1):
    """What transformers.Trainer builds: decay by name, off for biases and norm weights."""
    no_decay = {n for n, _ in model.named_parameters() if n.endswith("bias") or "norm" in n or "ln_" in n}
    return [
        {"params": [p for n, p in model.named_parameters() if n not in no_decay], "weight_decay": weight_decay},
        {"params": [p for n, p in model.named_parameters() if n in no_decay], "weight_decay": 0.0},
    ]


def _losses(model, tokens):
    out = model(tokens, labels=tokens)
    return out.loss, out.logits.pow(2).mean()


def hf_job(rank, world, kind, steps=2):
    model = build(kind)
    ref = Reference(model)
    ref_opt = torch.optim.AdamW(trainer_groups(ref.model), **ADAM)
    count = ref.model.num_parameters()
    rt = paramfsm.shard(model)
    opt = torch.optim.AdamW(trainer_groups(model), **ADAM)
    report = {"count": (model.num_parameters(), count), "param_err": 0.0}
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        tokens = torch.randint(1, VOCAB, (world * PER_RANK, SEQ), generator=gen)
        l1, l2 = _losses(model, rank_slice(tokens, rank, world))
        r1, r2 = _losses(ref.model, tokens)
        for (loss, ref_loss), keep in (((l1, r1), True), ((l2, r2), False)):
            opt.zero_grad()
            ref_opt.zero_grad()
            loss.backward(retain_graph=keep)
            ref_loss.backward(retain_graph=keep)
        opt.step()
        ref_opt.step()
        err = assert_close_dicts(sharded_params(rt, model), ref.params(), atol=1e-5, what=f"{kind} step {step}")
        report["param_err"] = max(report["param_err"], err)
    assert set(rt.states().values()) == {State.NOT_AVAILABLE}

    prompt = torch.randint(1, VOCAB, (1, 4), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        report["generate"] = (model.generate(prompt, max_new_tokens=4, do_sample=False).tolist(),
                              ref.model.generate(prompt, max_new_tokens=4, do_sample=False).tolist())
        sharded_logits = model(prompt).logits
    assert set(rt.states().values()) == {State.NOT_AVAILABLE}, "generate left parameters gathered"

    state = rt.full_state_dict()
    with tempfile.TemporaryDirectory() as own:
        where = [own]
        torch.distributed.broadcast_object_list(where, src=0)  # every rank reads rank 0's directory
        if rank == 0:
            model.save_pretrained(where[0], state_dict=state)
        torch.distributed.barrier()
        loaded = type(model).from_pretrained(where[0])
        torch.distributed.barrier()
    with torch.no_grad():
        report["reload_err"] = (loaded(prompt).logits - sharded_logits).abs().max().item()
    rt.close()
    return report


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hugging_face_model_end_to_end(ranks2, kind):
    for report in ranks2.run(hf_job, kind):
        assert report["count"][0] == report["count"][1] > 0, "num_parameters() of a sharded model"
        assert report["param_err"] < 1e-5
        ours, plain = report["generate"]
        assert ours == plain and len(ours[0]) == 8
        assert report["reload_err"] < 1e-5


def generate_job(rank, world):
    model = build("gpt2")
    plain = copy.deepcopy(model)
    rt = paramfsm.shard(model)
    # A different prompt and length per rank; rank 0 asks for fewer tokens, so it finishes first
    # and must keep running forwards until rank 1 is done (synced_gpus).
    prompt = torch.randint(1, VOCAB, (1, 3 + 2 * rank), generator=torch.Generator().manual_seed(11 + rank))
    new_tokens = 3 if rank == 0 else 7
    with torch.no_grad():
        ours = rt.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
        want = plain.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
    states = set(rt.states().values())
    after = rt.full_state_dict()  # the ranks are still in step after generating
    in_step = all(torch.equal(after[k], v) for k, v in plain.state_dict().items())
    rt.close()
    return ours.tolist(), want.tolist(), states, in_step


def test_generate_with_a_different_prompt_per_rank(ranks2):
    results = ranks2.run(generate_job)
    for rank, (ours, want, states, in_step) in enumerate(results):
        assert ours == want, f"rank {rank}: {ours} != plain {want}"
        assert len(ours[0]) == 3 + 2 * rank + (3 if rank == 0 else 7)
        assert states == {State.NOT_AVAILABLE}
        assert in_step


def _safetensors(directory):
    from safetensors import safe_open

    path = os.path.join(directory, "model.safetensors")
    with safe_open(path, "pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
    with open(path, "rb") as handle:
        return tensors, handle.read()


def tied_save_job(rank, world, kind):
    model = build(kind)
    plain = copy.deepcopy(model)
    rt = paramfsm.shard(model)
    report = {"distinct": len(list(model.parameters())), "gathers": []}
    for rank0_only in (False, True):
        before = rt.counters["all_gathers"]
        state = rt.full_state_dict(rank0_only=rank0_only)
        report["gathers"].append(rt.counters["all_gathers"] - before)
        report[rank0_only] = sorted(state)
    full = rt.full_state_dict()
    own = plain.state_dict()
    report["values"] = set(full) == set(own) and all(torch.equal(full[k], v) for k, v in own.items())
    # Aliases share one tensor, as the keys of a plain state dict share one storage.
    report["aliases"] = sorted((a, b) for a in full for b in full
                               if a < b and own[a].data_ptr() == own[b].data_ptr() and full[a] is full[b])
    report["plain_aliases"] = sorted((a, b) for a in own for b in own
                                     if a < b and own[a].data_ptr() == own[b].data_ptr())
    with tempfile.TemporaryDirectory() as scratch:
        where = [scratch]
        torch.distributed.broadcast_object_list(where, src=0)
        if rank == 0:
            model.save_pretrained(os.path.join(where[0], "ours"), state_dict=state)
            plain.save_pretrained(os.path.join(where[0], "plain"))
            (ours, ours_bytes), (want, want_bytes) = (_safetensors(os.path.join(where[0], name))
                                                      for name in ("ours", "plain"))
            report["keys"] = (sorted(ours), sorted(want))
            report["same_tensors"] = all(torch.equal(ours[k], want[k]) for k in want if k in ours)
            report["same_bytes"] = ours_bytes == want_bytes
        torch.distributed.barrier()
    rt.close()
    return report


@pytest.mark.parametrize("kind", ["gpt2", "bert"])
def test_full_state_dict_saves_like_a_plain_model(ranks2, kind):
    zero, one = ranks2.run(tied_save_job, kind)
    assert zero["values"] and one["values"]
    assert zero["aliases"] == zero["plain_aliases"] != []
    for report in (zero, one):
        assert report["gathers"] == [report["distinct"]] * 2, "one all-gather per distinct parameter"
    assert zero[True] == zero[False] and one[True] == [], "rank0_only: the full dict on rank 0 only"
    ours, want = zero["keys"]
    assert ours == want, f"keys differ from a plain save: {sorted(set(ours) ^ set(want))}"
    assert zero["same_tensors"] and zero["same_bytes"]
