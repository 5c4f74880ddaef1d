"""How close the memory plan is to what training holds, per phase, with DeepSpeed's estimate beside it.

For each model, offload setting and world size, one run:

* **plan**: ``paramfsm.plan`` of the model built on the meta device (nothing allocated), with the seconds
  it took;
* **measured**: the same configuration trained for real on local gloo ranks (built on the meta device,
  sharded, ``rt.init_weights()``, two AdamW steps), every transition counted as the plan counts it
  (``paramfsm.planning.measure.peaks``), the largest over the ranks;
* **plan / measured** for the init, forward, backward and step phases (the plan must be at or above 1.00
  and at most 1.15);
* **DeepSpeed**: ``estimate_zero3_model_states_mem_needs`` per GPU, reimplemented from DeepSpeed's
  documentation (DeepSpeed is not a dependency): the largest layer's fp16 parameters and gradients, plus
  18 bytes per parameter (fp16 parameters and gradients, fp32 master weights and Adam moments) divided by
  the ranks, or 2 bytes per parameter when the optimizer is offloaded, and the largest layer alone when
  the parameters are too. It counts model states only: no prefetch, no buckets, no activations, and its
  bytes per parameter are for fp16 training where these runs are fp32.

Figures are paramfsm-owned bytes per rank (``rt.memory()``'s kinds plus the optimizer state and the
gradients waiting for or inside a reduce-scatter), not the allocator's view.

    python benchmarks/plan_accuracy.py [--worlds 2 3] [--models stack llama] [--folder DIR]
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from torch import nn

import paramfsm
from paramfsm.verify.launch import RankPool
from paramfsm.planning.measure import measured_steps
from paramfsm.planning.report import size

PHASES = ("init", "forward", "backward", "step")


def build(name: str) -> nn.Module:
    if name == "stack":  # benchmarks/memory.py's and benchmarks/offload.py's stack
        return nn.Sequential(*(nn.Linear(1024, 1024) for _ in range(16)))
    import transformers

    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
        vocab_size=4096, max_position_embeddings=256, tie_word_embeddings=False))


def example(name: str, device: str):
    if name == "stack":
        return torch.ones(32, 1024, device=device)
    return {"input_ids": torch.ones(4, 128, dtype=torch.long, device=device)}


def offloads(folder: str) -> dict:
    return {"none": None, "optimizer cpu": paramfsm.Offload(optimizer="cpu"),
            "all disk": paramfsm.Offload(params="disk", grads="disk", optimizer="disk", path=folder)}


def job(rank, world, name, offload):
    torch.manual_seed(0)
    with torch.device("meta"):
        model = build(name)
    rt = paramfsm.shard(model, offload=offload)
    found = measured_steps(rt, model, example(name, "cpu"))
    rt.close()
    return found


def deepspeed_estimate(model: nn.Module, world: int, offload) -> int:
    """DeepSpeed's ``estimate_zero3_model_states_mem_needs`` per GPU (see the module docstring)."""
    total = sum(p.numel() for p in model.parameters())
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    layer = 4 * largest
    if offload is None:
        return layer + 18 * total // world
    if offload.params is None:
        return layer + 2 * total // world
    return layer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 3])
    parser.add_argument("--models", nargs="+", default=["stack", "llama"])
    parser.add_argument("--folder", default=None, help="where the disk tiers go (default: a temporary folder)")
    args = parser.parse_args()
    folder = args.folder or tempfile.mkdtemp(prefix="paramfsm-plan-accuracy-")
    print("| model | world | offload | plan s | " + " | ".join(f"{p} plan/measured" for p in PHASES)
          + " | plan peak | measured peak | DeepSpeed |")
    print("|---" * (7 + len(PHASES)) + "|")
    for world in args.worlds:
        with RankPool(world, timeout=600) as pool:
            for name in args.models:
                for label, offload in offloads(folder).items():
                    with torch.device("meta"):
                        twin = build(name)
                    start = time.perf_counter()
                    plan = paramfsm.plan(twin, world, example_input=example(name, "meta"), offload=offload)
                    seconds = time.perf_counter() - start
                    results = pool.run(job, name, offload)
                    measured = {phase: max(r[phase] for r in results) for phase in PHASES}
                    ratios = [plan.phase(phase).total / measured[phase] for phase in PHASES]
                    peak = max(measured.values())
                    planned = max(plan.phase(phase).total for phase in PHASES)
                    print(f"| {name} | {world} | {label} | {seconds:.1f} | "
                          + " | ".join(f"{r:.3f}" for r in ratios)
                          + f" | {size(planned)} | {size(peak)} | {size(deepspeed_estimate(twin, world, offload))} |",
                          flush=True)


if __name__ == "__main__":
    main()
