"""Peak resident memory per rank of getting a model onto the ranks: eager or meta, paramfsm or FSDP2.

Two models: a stack of 12 x Linear(2048, 2048) (192 MiB of fp32 parameters)
and a Hugging Face Llama of about 110 MiB (tied embeddings), saved once with
``save_pretrained``. For each world size and each way (paramfsm eager,
paramfsm meta, FSDP2 eager, FSDP2 meta), one job on fresh ranks measures,
in order, with the peak reset (``/proc/self/clear_refs``) before each phase:

* **load**: the Llama from its safetensors file. Eager: ``from_pretrained``,
  then shard. paramfsm meta: ``from_config`` on meta, ``shard``,
  ``load_pretrained`` (this rank's slices only). FSDP2 meta: ``from_config``
  on meta, ``fully_shard``, ``to_empty``, ``set_model_state_dict`` of the
  file read on rank 0 and broadcast (``broadcast_from_rank0``, FSDP2's recipe);
* **build**: the stack built, sharded and initialised. Eager: built by its
  constructors, then sharded. paramfsm meta: built on meta, ``shard``,
  ``rt.init_weights()``. FSDP2 meta: built on meta, ``fully_shard``,
  ``to_empty``, ``reset_parameters()`` (FSDP2's recipe);
* **step**: the stack's first AdamW step (batch 8).

Every job first imports the same modules, builds FSDP2's device mesh and
builds both models once on the meta device, so the code pages these touch
count for none of them (see [Note: resident memory counts code pages] in
``benchmarks/memory.py``). Each figure is ``VmHWM`` during the phase minus the resident set before the
phase's model existed (after the previous phase's model was dropped), in MiB,
the largest over the ranks (FSDP2's broadcast load peaks on rank 0). Workers
run with a fixed glibc mmap threshold (``MALLOC_MMAP_THRESHOLD_``, as in
``benchmarks/memory.py``), so a freed tensor leaves the resident set. The floor
row is what any sharded runtime must hold: load, the model / N plus its largest
tensor; build, the model / N plus one unit; step, (parameters + gradients +
AdamW's two moments) / N plus two units gathered.

    python benchmarks/model_scale.py [--worlds 1 2 4]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import tempfile

from pathlib import Path

import torch
from torch import nn

from paramfsm.verify.launch import RankPool

sys.path.insert(0, str(Path(__file__).resolve().parent))
from memory import _reset_peak, _status_kib  # noqa: E402 - the same peak measurement as memory.py

DEPTH, WIDTH, BATCH = 12, 2048, 8
WAYS = ("paramfsm eager", "paramfsm meta", "FSDP2 eager", "FSDP2 meta")


def _phase_start() -> int:
    gc.collect()
    _reset_peak()
    return _status_kib("VmRSS")


def _peak_mib(start_kib: int) -> float:
    return (_status_kib("VmHWM") - start_kib) / 1024


def llama_config():
    import transformers

    return transformers.LlamaConfig(hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                                    num_attention_heads=8, num_key_value_heads=8, vocab_size=16000,
                                    max_position_embeddings=256, tie_word_embeddings=True)


def stack() -> nn.Module:
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH)))


def _fsdp(model: nn.Module, layers, mesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def load_phase(way: str, path: str, mesh) -> float:
    import transformers

    import paramfsm
    from paramfsm.integrations.hf import load_pretrained

    start = _phase_start()
    if way.endswith("eager"):
        model = transformers.AutoModelForCausalLM.from_pretrained(path)
        handle = paramfsm.shard(model) if way.startswith("paramfsm") else _fsdp(model, model.model.layers, mesh)
    elif way == "paramfsm meta":
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(llama_config())
        handle = paramfsm.shard(model, device="cpu")
        load_pretrained(handle, path)
    else:
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(llama_config())
        _fsdp(model, model.model.layers, mesh)
        model.to_empty(device="cpu")
        full = load_file(os.path.join(path, "model.safetensors")) if torch.distributed.get_rank() == 0 else {}
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True,
                                                                   strict=False))
        del full
        handle = None
    peak = _peak_mib(start)
    if way.startswith("paramfsm"):
        handle.detach()
    del model, handle
    return peak


def build_phase(way: str, mesh):
    import paramfsm

    start = _phase_start()
    torch.manual_seed(0)
    rt = None
    if way == "paramfsm eager":
        model = stack()
        rt = paramfsm.shard(model)
    elif way == "paramfsm meta":
        with torch.device("meta"):
            model = stack()
        rt = paramfsm.shard(model, device="cpu")
        rt.init_weights()
    elif way == "FSDP2 eager":
        model = stack()
        _fsdp(model, list(model), mesh)
    else:
        with torch.device("meta"):
            model = stack()
        _fsdp(model, list(model), mesh)
        model.to_empty(device="cpu")
        with torch.no_grad():
            for module in model.modules():
                if callable(getattr(module, "reset_parameters", None)):
                    module.reset_parameters()
    return (model, rt), start, _peak_mib(start)


def step_phase(built, start: int) -> float:
    model = built[0]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randn(BATCH, WIDTH)
    with open("/proc/self/clear_refs", "w", encoding="ascii") as clear:
        clear.write("5")
    model(x).pow(2).mean().backward()
    opt.step()
    return _peak_mib(start)


def job(rank, world, way: str, path: str) -> dict:
    """One way at one world size: the three phases in order (see the module docstring)."""
    import transformers  # imported before any baseline, by every job alike
    from torch.distributed.device_mesh import init_device_mesh

    import paramfsm.integrations.hf  # noqa: F401

    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):  # the same code paths run once in every job before any baseline
        transformers.AutoModelForCausalLM.from_config(llama_config())
        stack()
    out = {"load": load_phase(way, path, mesh)}
    model, start, out["build"] = build_phase(way, mesh)
    out["step"] = step_phase(model, start)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--ways", nargs="+", default=list(WAYS), choices=WAYS)
    args = parser.parse_args(argv)
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)  # see benchmarks/memory.py
    import transformers

    mib = 2.0 ** 20
    with tempfile.TemporaryDirectory(prefix="paramfsm-model-scale-") as path:
        torch.manual_seed(0)
        llama = transformers.LlamaForCausalLM(llama_config())
        llama.save_pretrained(path)
        llama_mib = sum(p.numel() * p.element_size() for p in llama.parameters()) / mib
        largest_mib = max(p.numel() * p.element_size() for p in llama.parameters()) / mib
        del llama
        unit_mib = (WIDTH * WIDTH + WIDTH) * 4 / mib
        stack_mib = DEPTH * unit_mib
        print(f"stack {stack_mib:.1f} MiB (unit {unit_mib:.1f}); Llama {llama_mib:.1f} MiB "
              f"(largest tensor {largest_mib:.1f}); peak per rank in MiB, the largest over ranks")
        print(f"{'world':>5}  {'way':<16}{'load':>8}{'build':>8}{'step':>8}{'build/model':>13}")
        for world in args.worlds:
            rows = {}
            for way in args.ways:
                print(f"world {world}: {way} ...", file=sys.stderr, flush=True)
                with RankPool(world, timeout=1200) as pool:
                    results = pool.run(job, way, path)
                rows[way] = {k: max(r[k] for r in results) for k in ("load", "build", "step")}
            rows["floor"] = {"load": llama_mib / world + largest_mib, "build": stack_mib / world + unit_mib,
                             "step": 4 * stack_mib / world + 2 * unit_mib}
            for way, r in rows.items():
                print(f"{world:>5}  {way:<16}{r['load']:>8.1f}{r['build']:>8.1f}{r['step']:>8.1f}"
                      f"{r['build'] / stack_mib:>13.2f}")
            for ours, theirs in (("paramfsm meta", "FSDP2 meta"), ("paramfsm eager", "FSDP2 eager")):
                if ours in rows and theirs in rows:
                    print(f"{'':>5}  {ours} / {theirs}: load {rows[ours]['load'] / rows[theirs]['load']:.2f}x, "
                          f"build {rows[ours]['build'] / rows[theirs]['build']:.2f}x, "
                          f"step {rows[ours]['step'] / rows[theirs]['step']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
