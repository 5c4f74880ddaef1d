"""The default units of tiny Hugging Face models are their ``_no_split_modules`` blocks.

Llama (untied head), GPT-2 (head tied to the embedding), Qwen2, OPT and T5
(encoder and decoder blocks, embedding shared), built offline from configs sized
so that each block holds more than the default ``min_unit_bytes``: every block is
one unit, the embeddings, final norm and head (each smaller) join the root, and
training at world 2 equals plain torch. BERT declares its embeddings a block too;
being small, they join the root whole. ``units=`` still overrides the choice.
"""

from __future__ import annotations

import pytest
import torch
from patterns_common import Pair
from torch import nn

from paramfsm.engine.storage.default_units import MIN_UNIT_BYTES, MIN_UNIT_BYTES_ENV
from paramfsm.engine.storage.units import select_unit_modules

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 64, 8
BLOCKS = {"llama": ("model.layers", "LlamaDecoderLayer"), "gpt2": ("transformer.h", "GPT2Block"),
          "qwen2": ("model.layers", "Qwen2DecoderLayer"), "opt": ("model.decoder.layers", "OPTDecoderLayer"),
          "t5": ("encoder.block", "T5Block"), "bert": ("bert.encoder.layer", "BertLayer")}


@pytest.fixture(autouse=True)
def real_default(monkeypatch):
    """The suite sets $PARAMFSM_MIN_UNIT_BYTES=0 (tests/conftest.py); these tests are of the real default."""
    monkeypatch.delenv(MIN_UNIT_BYTES_ENV, raising=False)


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))
    config = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32, bos_token_id=0,
                  eos_token_id=0, pad_token_id=0)
    if kind == "opt":
        return transformers.OPTForCausalLM(transformers.OPTConfig(
            hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=2, vocab_size=VOCAB,
            max_position_embeddings=32, word_embed_proj_dim=64, dropout=0.0, bos_token_id=0, eos_token_id=0,
            pad_token_id=0))
    if kind == "t5":
        return transformers.T5ForConditionalGeneration(transformers.T5Config(
            d_model=64, d_ff=128, d_kv=32, num_layers=2, num_decoder_layers=2, num_heads=2, vocab_size=VOCAB,
            dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))
    if kind == "bert":
        return transformers.BertForMaskedLM(transformers.BertConfig(
            hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, vocab_size=VOCAB,
            max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    if kind == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**config))
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**config))


def blocks_of(model: nn.Module, block: str) -> list[str]:
    """Qualified names of the instances of class ``block`` in ``model``, in module order."""
    return [name for name, m in model.named_modules() if type(m).__name__ == block]


@pytest.mark.parametrize("kind", sorted(BLOCKS))
def test_default_units_are_the_declared_blocks(kind):
    model = build(kind)
    prefix, block = BLOCKS[kind]
    assert block in model._no_split_modules
    chosen = select_unit_modules(model, None)
    assert list(chosen) == [""] + blocks_of(model, block)
    assert len(chosen) == (5 if kind == "t5" else 3) and f"{prefix}.1" in chosen
    assert {chosen.reasons[name] for name in chosen if name} == {f"_no_split_modules ({block})"}
    assert all(sum(p.numel() * 4 for p in chosen[name].parameters()) >= MIN_UNIT_BYTES for name in chosen if name)
    merged = chosen.merged[""]
    assert any("embed" in name or "wte" in name or name == "shared" for name in merged), merged
    head = {"t5": "shared", "bert": "cls.predictions.decoder"}.get(kind, "lm_head")  # T5's is tied to "shared"
    assert head in merged, merged


def test_a_small_declared_block_joins_its_parent_whole():
    model = build("bert")
    assert "BertEmbeddings" in model._no_split_modules
    chosen = select_unit_modules(model, None)
    assert "bert.embeddings" in chosen.merged[""] and "bert.embeddings.word_embeddings" not in chosen.merged[""]
    assert "bert.embeddings" in select_unit_modules(model, None, min_unit_bytes=0)
    assert "bert.embeddings.word_embeddings" not in select_unit_modules(model, None, min_unit_bytes=0), "whole"


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_units_override_the_declared_blocks(kind):
    model = build(kind)
    chosen = select_unit_modules(model, [nn.Embedding])
    assert sorted(name for name in chosen if name) == sorted(
        name for name, m in model.named_modules() if isinstance(m, nn.Embedding))
    assert set(chosen.reasons.values()) == {"units=", "root"}
    assert len(select_unit_modules(model, None, min_unit_bytes=1 << 30)) == 1, "blocks smaller than it merge too"


def train_job(rank, world, kind):
    model = build(kind)
    pair = Pair(model, rank, world, make_optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-3),
                min_unit_bytes=MIN_UNIT_BYTES)  # ranks inherit the suite's 0
    table = pair.rt.describe_units()
    for step in range(2):
        tokens = torch.randint(0, VOCAB, (2 * world, SEQ), generator=torch.Generator().manual_seed(step))
        local = pair.local(tokens)
        pair.zero_grad()
        model(local, labels=local).loss.backward()
        pair.ref.model(tokens, labels=tokens).loss.backward()
        pair.check_grads(f"step {step}", atol=1e-5, rtol=1e-4)
        pair.step(f"step {step}", atol=1e-5, rtol=1e-4)
    report = pair.finish()
    report.update(units=[u.name for u in pair.rt.units], table=table)
    return report


@pytest.mark.parametrize("kind", ["llama", "gpt2", "t5"])
def test_training_through_the_declared_blocks_matches_plain_torch(ranks2, kind):
    prefix, block = BLOCKS[kind]
    blocks = blocks_of(build(kind), block)
    for report in ranks2.run(train_job, kind):
        assert report["units"] == ["<root>"] + blocks, report["units"]
        assert report["checks"] >= 4
        lines = report["table"].splitlines()
        assert len(lines) == 2 + len(blocks) and f"_no_split_modules ({block})" in lines[2], report["table"]
        head = "shared" if kind == "t5" else "lm_head"
        assert lines[1].split()[1] == "<root>" and head in lines[1], report["table"]
