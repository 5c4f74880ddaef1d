"""Default units against the per-module rule and FSDP2 per block: unit count, step time, step peak memory.

World 2, one run. Models: (a) 200 x Linear(8, 8); (t) the 8 GPT-block stack of
``step_overhead.py`` (no ``_no_split_modules``); tiny Hugging Face Llama (8 layers,
hidden 256), GPT-2, Qwen2, OPT, BERT (4 layers, width 256 each) and T5 (2 + 2
blocks, width 256), built offline. Columns:

- "per-module": every module owning parameters a unit (the default before declared
  blocks and merging; forced with a ``units=`` predicate);
- the default units under each ``min_unit_bytes`` candidate (64 KiB is the default);
- "FSDP2": ``fully_shard`` on each declared block (each Linear for (a), each GPT
  block for (t)) and on the root.

Each cell: units, median step time (SGD, interleaved rounds, best round kept), the
ratio to plain torch measured in the same run, and the step's peak resident memory
above the resident set at the start of the measured steps (``VmHWM`` after
``/proc/self/clear_refs``, rank 0, MiB; see ``memory.py``).

    python benchmarks/default_units.py [--steps 10] [--warmup 3] [--rounds 2] [--models a,t,llama,...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import memory  # noqa: E402
import step_overhead  # noqa: E402


#: The ``min_unit_bytes`` candidates measured.
CANDIDATES = (64 << 10, 1 << 20)
MODELS = ("a", "t", "llama", "gpt2", "qwen2", "opt", "bert", "t5")
VOCAB, TOKENS, SEQS, WIDTH = 256, 32, 4, 256


def build(name: str):
    """Model ``name`` and one input batch for it."""
    torch.manual_seed(0)
    if name in ("a", "t"):
        return step_overhead.build(name), step_overhead.batch_of(name)
    import transformers as tf

    tokens = torch.randint(1, VOCAB, (SEQS, TOKENS))
    common = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if name in ("llama", "qwen2"):
        config = dict(hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=8 if name == "llama" else 4,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, **common)
        if name == "llama":
            return tf.LlamaForCausalLM(tf.LlamaConfig(**config)), tokens
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**config)), tokens
    if name == "gpt2":
        return tf.GPT2LMHeadModel(tf.GPT2Config(n_layer=4, n_embd=WIDTH, n_head=4, vocab_size=VOCAB,
                                                n_positions=64)), tokens
    if name == "opt":
        return tf.OPTForCausalLM(tf.OPTConfig(hidden_size=WIDTH, ffn_dim=2 * WIDTH, num_hidden_layers=4,
                                              num_attention_heads=4, max_position_embeddings=64,
                                              word_embed_proj_dim=WIDTH, **common)), tokens
    if name == "bert":
        return tf.BertForMaskedLM(tf.BertConfig(hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=4,
                                                num_attention_heads=4, max_position_embeddings=64,
                                                vocab_size=VOCAB)), tokens
    if name == "t5":
        return tf.T5ForConditionalGeneration(tf.T5Config(
            d_model=WIDTH, d_ff=2 * WIDTH, d_kv=64, num_layers=2, num_decoder_layers=2, num_heads=4,
            vocab_size=VOCAB, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)), tokens
    raise ValueError(f"unknown model {name!r}; expected one of {MODELS}")


def loss_of(model, x):
    if isinstance(model, torch.nn.Sequential):
        return model(x).float().pow(2).mean()
    return model(x, labels=x).loss


def per_module(name, module):
    """The per-module rule: every module owning parameters directly."""
    return any(True for _ in module.parameters(recurse=False))


def blocks(model) -> list:
    """The modules FSDP2 wraps: each declared block, each GPT block of (t), each Linear of (a); a block
    holding a weight tied outside it (BERT's embeddings) stays with the root, as FSDP2 requires."""
    declared = set(getattr(model, "_no_split_modules", None) or ())
    if not declared:
        declared = {"GPTBlock"} if any(type(m).__name__ == "GPTBlock" for m in model.modules()) else {"Linear"}
    everywhere: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        everywhere[id(param)] = everywhere.get(id(param), 0) + 1

    def self_contained(block) -> bool:
        inside: dict[int, int] = {}
        for _, param in block.named_parameters(remove_duplicate=False):
            inside[id(param)] = inside.get(id(param), 0) + 1
        return all(everywhere[key] == count for key, count in inside.items())

    return [m for m in model.modules() if type(m).__name__ in declared and self_contained(m)]


def step_job(rank, world, name: str, setting, steps: int, warmup: int):
    """(median seconds per step, units, step peak MiB) under ``setting``: "plain", "per-module",
    "blocks" (paramfsm with FSDP2's wrapping as ``units=``: each declared block, the rest in the root),
    "FSDP2" or a ``min_unit_bytes``."""
    warnings.simplefilter("ignore")  # FSDP2's view-output and transformers' config notices, once per job
    model, x = build(name)
    rt, units = None, 0
    if setting == "FSDP2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        wrapped = blocks(model)
        for block in wrapped:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        units = len(wrapped) + 1
    elif setting != "plain":
        import paramfsm

        kwargs = ({"units": per_module} if setting == "per-module" else {"units": blocks(model)}
                  if setting == "blocks" else {"min_unit_bytes": setting})
        rt = paramfsm.shard(model, **kwargs)
        units = len(rt.units)
    opt = torch.optim.SGD(rt.shard_parameters() if rt else model.parameters(), lr=1e-3)
    times = []
    for i in range(warmup + steps):
        if i == warmup:
            memory._reset_peak()
            base = memory._status_kib("VmRSS")
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_of(model, x).backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    peak = (memory._status_kib("VmHWM") - base) / 1024
    if rt:
        rt.close()
    return statistics.median(times), units, peak


def main(argv=None) -> int:
    from paramfsm.verify.launch import RankPool  # in main only: rank workers import this module for its jobs

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args(argv)
    names = args.models.split(",")
    settings = ("plain", "per-module", *CANDIDATES, "FSDP2")
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 16))  # tensors are mappings: RSS follows them
    os.environ.pop("PARAMFSM_MIN_UNIT_BYTES", None)
    best: dict = {}
    facts: dict = {}
    with RankPool(2, timeout=600) as pool:
        for round_ in range(args.rounds):
            print(f"round {round_ + 1}/{args.rounds} ...", file=sys.stderr, flush=True)
            for name in names:
                for setting in settings:
                    seconds, count, peak = pool.run(step_job, name, setting, args.steps, args.warmup)[0]
                    best[name, setting] = min(best.get((name, setting), seconds), seconds)
                    facts[name, setting] = count, max(peak, facts.get((name, setting), (0, 0.0))[1])
    labels = {s: (f"{s >> 10} KiB" if isinstance(s, int) and s < 1 << 20 else
                  f"{s >> 20} MiB" if isinstance(s, int) else s) for s in settings}
    print("cells: units / ms per step / x plain torch / step peak MiB (rank 0); world 2")
    print(f"{'model':<7}" + "".join(f"{labels[s]:>30}" for s in settings[1:]) + f"{'plain ms':>10}")
    for name in names:
        plain = best[name, "plain"]
        cells = "".join(f"{facts[name, s][0]:>5} u {best[name, s] * 1e3:7.1f} ms {best[name, s] / plain:5.2f}x "
                        f"{facts[name, s][1]:5.1f}" for s in settings[1:])
        print(f"{name:<7}{cells}{plain * 1e3:10.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
