"""Loading into a model built on the meta device, on 2 gloo ranks, against a plain ``from_pretrained``.

A tiny Llama with tied embeddings is saved with ``save_pretrained`` in several
files (an index); built on meta (``AutoModelForCausalLM.from_config``),
sharded and loaded with ``load_pretrained`` (slices only), it gives the same
logits as ``from_pretrained``, rotary frequencies included (a buffer no
checkpoint holds). A torch.load(mmap=True) state dict loads through
``rt.load_full_state_dict``. Bad checkpoints (a key missing, a wrong shape)
raise an error naming the parameter and write nothing: a meta-built model
stays guarded, an eager one keeps its values.
"""

from __future__ import annotations

import os

import pytest
import torch

import paramfsm
from paramfsm import ParamFSMError

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

VOCAB = 67


def config():
    return transformers.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                    num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB,
                                    max_position_embeddings=32, tie_word_embeddings=True,
                                    bos_token_id=0, eos_token_id=0, pad_token_id=0)


def tokens():
    return torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(3))


def logits(model):
    with torch.no_grad():
        return model(tokens()).logits


def _error(call) -> str:
    try:
        call()
    except ParamFSMError as exc:
        return str(exc)
    return "no error"


def load_job(rank, world, root):
    from paramfsm.integrations.hf import load_pretrained

    out = {}
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config())
    rt = paramfsm.shard(model)
    out["missing"] = _error(lambda: load_pretrained(rt, os.path.join(root, "missing")))
    out["shape"] = _error(lambda: load_pretrained(rt, os.path.join(root, "shape")))
    out["still guarded"] = _error(lambda: model(tokens()))
    load_pretrained(rt, os.path.join(root, "indexed"))
    out["sliced"] = logits(model)
    rt.close()

    eager = transformers.AutoModelForCausalLM.from_config(config())
    rt = paramfsm.shard(eager)
    before = rt.full_param("model.norm.weight")
    out["eager shape"] = _error(lambda: load_pretrained(rt, os.path.join(root, "shape")))
    out["eager kept"] = torch.equal(rt.full_param("model.norm.weight"), before)
    state = torch.load(os.path.join(root, "state.pt"), mmap=True, weights_only=True)
    rt.load_full_state_dict(state)
    out["mmap"] = logits(eager)
    rt.close()
    return out


def test_meta_build_and_load_pretrained(ranks2, tmp_path):
    torch.manual_seed(0)
    plain = transformers.LlamaForCausalLM(config())
    plain.save_pretrained(tmp_path / "indexed", max_shard_size="20KB")
    assert (tmp_path / "indexed" / "model.safetensors.index.json").exists()
    state = {k: v.clone() for k, v in plain.state_dict().items() if k != "lm_head.weight"}
    torch.save(state, tmp_path / "state.pt")
    for bad, change in (("missing", lambda sd: sd.pop("model.norm.weight")),
                        ("shape", lambda sd: sd.update({"model.layers.1.mlp.up_proj.weight": torch.zeros(48, 31)}))):
        sd = dict(state)
        change(sd)
        os.makedirs(tmp_path / bad)
        safetensors_torch.save_file(sd, str(tmp_path / bad / "model.safetensors"))
    want = logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "indexed"))
    for rank, out in enumerate(ranks2.run(load_job, str(tmp_path))):
        assert "No tensor for: ['model.norm.weight']" in out["missing"], out["missing"]
        assert "nothing was loaded" in out["missing"]
        assert "'model.layers.1.mlp.up_proj.weight' is [48, 31]" in out["shape"], out["shape"]
        assert "built on the meta device" in out["still guarded"], out["still guarded"]
        assert torch.equal(out["sliced"], want), f"rank {rank}: logits differ from from_pretrained"
        assert "Wrong shape" in out["eager shape"] and out["eager kept"]
        assert torch.equal(out["mmap"], want), f"rank {rank}: the mmap state dict gave other logits"
