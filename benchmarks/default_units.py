"""Unit counts and median step time at world 2 under candidate ``min_unit_bytes`` defaults, in one run.

Models: (a) 200 x Linear(8, 8); (t) the 8 GPT-block stack of ``step_overhead.py``
(no ``_no_split_modules``); a tiny Hugging Face Llama (8 layers, hidden 256) and
GPT-2 (4 layers, width 256), both declaring their blocks. Columns: "per-module"
(every module owning parameters a unit: the default before blocks and merging),
then the default units with each ``min_unit_bytes``. SGD, interleaved rounds,
each column keeps its best round's median; plain torch in the same run is the base.

    python benchmarks/default_units.py [--steps 10] [--warmup 3] [--rounds 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import step_overhead  # noqa: E402

from paramfsm.launch import RankPool  # noqa: E402

#: The ``min_unit_bytes`` candidates measured.
CANDIDATES = (64 << 10, 1 << 20)
VOCAB, TOKENS, SEQS = 256, 32, 4


def build(name: str):
    """Model ``name`` and one input batch for it."""
    torch.manual_seed(0)
    if name in ("a", "t"):
        return step_overhead.build(name), step_overhead.batch_of(name)
    import transformers

    tokens = torch.randint(0, VOCAB, (SEQS, TOKENS))
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=64)), tokens
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=4, n_embd=256, n_head=4, vocab_size=VOCAB, n_positions=64)), tokens


def loss_of(model, x):
    out = model(x)
    return (out.logits if hasattr(out, "logits") else out).float().pow(2).mean()


def per_module(name, module):
    """The per-module rule: every module owning parameters directly."""
    return any(True for _ in module.parameters(recurse=False))


def step_job(rank, world, name: str, setting, steps: int, warmup: int):
    """Median seconds per step and unit count; ``setting``: "plain", "per-module" or a ``min_unit_bytes``."""
    model, x = build(name)
    rt = None
    if setting != "plain":
        import paramfsm

        kwargs = {"units": per_module} if setting == "per-module" else {"min_unit_bytes": setting}
        rt = paramfsm.shard(model, **kwargs)
    opt = torch.optim.SGD(rt.shard_parameters() if rt else model.parameters(), lr=1e-3)
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_of(model, x).backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    units = len(rt.units) if rt else 0
    if rt:
        rt.close()
    return statistics.median(times), units


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--models", default="a,t,llama,gpt2")
    args = parser.parse_args(argv)
    settings = ("plain", "per-module", *CANDIDATES)
    best: dict = {}
    units: dict = {}
    pool = RankPool(2)
    try:
        for _ in range(args.rounds):
            for name in args.models.split(","):
                for setting in settings:
                    seconds, count = pool.run(step_job, name, setting, args.steps, args.warmup)[0]
                    best[name, setting] = min(best.get((name, setting), seconds), seconds)
                    units[name, setting] = count
    finally:
        pool.close()
    print("model   " + "".join(f"{str(s):>22}" for s in settings[1:]) + "   plain ms")
    for name in args.models.split(","):
        plain = best[name, "plain"]
        cells = "".join(f"{units[name, s]:>5} u {best[name, s] * 1e3:7.1f} ms {best[name, s] / plain:4.2f}x"
                        for s in settings[1:])
        print(f"{name:<8}{cells}   {plain * 1e3:7.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
