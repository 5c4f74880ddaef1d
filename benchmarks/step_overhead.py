"""Median time per training step (forward + backward + optimizer step), all measured in one run.

Four models (and model (c), below):
  (a) 200 x Linear(8, 8), batch 32: framework overhead (the compute is tiny); its
      57 KB are one unit under the default units (``min_unit_bytes``, 64 KiB);
  (u) model (a) with one unit per Linear (``units=[nn.Linear]``): the per-unit cost;
  (b) 16 x Linear(1024, 1024), batch 32: real work;
  (t) 8 GPT-style blocks (causal self-attention and an MLP, two LayerNorms, biases:
      12 parameters each) of width 128, batch 8 x 32 tokens, one unit per block:
      the shape of a real model, where per-unit batching of the torch work shows.
Six ways to run each: plain torch in one process; paramfsm with world 1;
paramfsm with world 2 (gloo, 127.0.0.1), with the optimizer over
``rt.shard_parameters()`` and over ``model.parameters()`` (mapped to the shards
by paramfsm's step pre-hook: its cost is the difference), and with
``units=paramfsm.by_size(min_bytes=1 MiB)`` (size-based units); PyTorch FSDP2
(``fully_shard`` per layer) with world 2. Ratios are against plain torch measured in the same run;
all are measured in interleaved rounds and each keeps its best round's
median, so drift of a shared machine does not favour one of them. AG/RS per
step are paramfsm world 2's steady-state collectives.

A third table runs model (c), 8 residual blocks of two Linear(256, 256),
with activation checkpointing per block (none, non-reentrant, reentrant):
paramfsm world 2 against its own non-checkpointed step, with collectives
per step, and plain torch with the same checkpointing.

The floor table puts each ratio next to what it cannot beat: "hooks only"
(paramfsm's hooks registered on a plain model, emitting into a no-op: the
cost of being told what autograd does, with no bookkeeping at all), and, for
model (b), "compute only" (plain torch on each of the two ranks at once, no
communication: the per-rank compute of a world-2 step) and "communication
only" (the all-gathers and reduce-scatters of one paramfsm world-2 step,
recorded from a real step and issued back to back with no compute). With
perfect overlap a world-2 step costs max(compute, communication); with none,
their sum. Its last columns give the overhead per unit per step, in
microseconds: paramfsm's step minus plain torch's, and minus "hooks only",
divided by the number of units that hold parameters (default units; one per
Linear for (u), one per block for (t)).

A second table prices the trace at world 2, in the same rounds: no trace
(``trace=0``), the default flight recorder (a bounded ring), every transition
in memory (``trace=True``) and every transition streamed to a file
(``trace="....jsonl"``); ratios are against no trace.

    python benchmarks/step_overhead.py [--steps 30] [--warmup 5] [--only a|b|c|t] [--skip-fsdp2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


MODELS = {"a": (200, 8), "u": (200, 8), "b": (16, 1024), "c": (8, 256), "t": (8, 128)}
#: ``units=paramfsm.by_size(min_bytes=BY_SIZE)`` for the "w2 by_size" column.
BY_SIZE = 1 << 20
#: Model (c)'s variants: activation checkpointing per block.
CHECKPOINTING = {"c": None, "c-nonreentrant": "non-reentrant", "c-reentrant": "reentrant"}
#: The trace settings priced in the second table (``shard(..., trace=...)``; "stream" writes a temp file).
TRACE_MODES = {"off": 0, "recorder": False, "full": True, "stream": "stream"}
BATCH = 32
#: Model (t): attention heads, and tokens per sequence (its batch is BATCH // 4 sequences).
HEADS, TOKENS = 4, 32


class GPTBlock(nn.Module):
    """A pre-LayerNorm GPT block: causal self-attention and a 4x MLP, each residual."""

    def __init__(self, width: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        batch, tokens, width = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(batch, tokens, 3, HEADS, width // HEADS).permute(2, 0, 3, 1, 4)
        attn = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(batch, tokens, width))
        return x + self.out(nn.functional.gelu(self.fc(self.ln2(x))))


def units_of(name: str):
    """``shard(units=...)`` for model ``name``: one unit per block for (t), per Linear for (u), else the defaults."""
    return {"t": [GPTBlock], "u": [nn.Linear]}.get(name)


def unit_count(name: str) -> int:
    """Units of model ``name`` under :func:`units_of` that hold parameters (the root of (a) holds them all)."""
    from paramfsm.engine.storage.units import build_units

    return sum(1 for unit in build_units(build(name), units_of(name), 0, 1)[0] if unit.records)


def batch_of(name: str) -> torch.Tensor:
    """One input batch for model ``name``."""
    width = MODELS[name[0]][1]
    return torch.randn(BATCH // 4, TOKENS, width) if name == "t" else torch.randn(BATCH, width)


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        return x + self.b(torch.nn.functional.gelu(self.a(x)))


class Checkpointed(nn.Module):
    """An input Linear, then residual blocks, each checkpointed as ``mode`` says (None: not at all)."""

    def __init__(self, depth: int, width: int, mode: str | None):
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.mode = mode

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x) if self.mode is None else checkpoint(block, x, use_reentrant=self.mode == "reentrant")
        return x


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name.startswith("c"):
        return Checkpointed(*MODELS["c"], CHECKPOINTING[name])
    depth, width = MODELS[name]
    if name == "t":
        return nn.Sequential(*(GPTBlock(width) for _ in range(depth)))
    return nn.Sequential(*(nn.Linear(width, width) for _ in range(depth)))


def time_steps(model, params, steps: int, warmup: int, name: str) -> float:
    """Median seconds per step on a squared-output loss; ``params``: parameters (SGD) or an optimizer."""
    opt = params if isinstance(params, torch.optim.Optimizer) else torch.optim.SGD(params, lr=1e-3)
    x = batch_of(name)
    times = []
    for i in range(warmup + steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times) if times else 0.0


def plain_job(rank, world, name: str, steps: int, warmup: int) -> float:
    """Plain torch, no process group use: the baseline (run in a worker so threads match)."""
    model = build(name)
    return time_steps(model, model.parameters(), steps, warmup, name)


def paramfsm_job(rank, world, name, steps, warmup, over="shards", trace=False, by_size=None):
    import paramfsm

    model = build(name)
    if trace == "stream":
        trace = Path(tempfile.mkdtemp(prefix="paramfsm-bench-")) / f"rank{rank}.jsonl"
    units = paramfsm.by_size(min_bytes=by_size) if by_size else units_of(name)
    rt = paramfsm.shard(model, trace=trace, units=units)
    opt = torch.optim.SGD(rt.shard_parameters() if over == "shards" else model.parameters(), lr=1e-3)
    time_steps(model, opt, 0, warmup, name)
    before = rt.counters
    seconds = time_steps(model, opt, steps, 0, name)
    per_step = {k: (v - before[k]) / steps for k, v in rt.counters.items()}
    rt.close()
    return seconds, per_step


def hooks_job(rank, world, name: str, steps: int, warmup: int) -> float:
    """Plain torch with paramfsm's hooks installed, emitting into a no-op: the hooks' own cost."""
    from paramfsm.engine.events import hooks
    from paramfsm.engine.storage.units import build_units

    model = build(name)
    units, records = build_units(model, units_of(name), 0, 1)
    handles = hooks.install(model, units, list(records.values()), lambda event: None)
    seconds = time_steps(model, model.parameters(), steps, warmup, name)
    for handle in handles:
        handle.remove()
    return seconds


def comm_job(rank, world, name: str, steps: int, warmup: int) -> tuple[float, int]:
    """The collectives of one paramfsm step issued alone: (median seconds, collectives per step).

    One step is recorded (sizes and order of every all-gather and reduce-scatter);
    then the same collectives are issued back to back, asynchronously, and waited
    for at the end, with fresh buffers of the same sizes and no compute at all.
    """
    import torch.distributed as dist

    import paramfsm
    from paramfsm.engine.effects import executor, gathers

    model = build(name)
    rt = paramfsm.shard(model, trace=0, units=units_of(name))
    opt = torch.optim.SGD(rt.shard_parameters(), lr=1e-3)
    time_steps(model, opt, 0, warmup, name)
    issued = []
    originals = gathers.all_gather_flat, executor.reduce_scatter_flat

    def recorder(kind, original):
        def record(out, inp, group, async_op=True, **kwargs):
            issued.append((kind, out.numel(), inp.numel(), out.dtype))
            return original(out, inp, group, async_op, **kwargs)
        return record

    gathers.all_gather_flat = recorder("ag", originals[0])
    executor.reduce_scatter_flat = recorder("rs", originals[1])
    try:
        time_steps(model, opt, 0, 1, name)
    finally:
        gathers.all_gather_flat, executor.reduce_scatter_flat = originals
    rt.close()
    buffers = [(kind, torch.empty(n_out, dtype=dtype), torch.ones(n_in, dtype=dtype))
               for kind, n_out, n_in, dtype in issued]
    collective = {"ag": originals[0], "rs": originals[1]}
    times = []
    for i in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        works = [collective[kind](out, inp, None, async_op=True) for kind, out, inp in buffers]
        for work in works:
            work.wait()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times), len(issued)


def fsdp2_job(rank, world, name, steps, warmup):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = build(name)
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return time_steps(model, model.parameters(), steps, warmup, name), None


def checkpointing_rows(one, two, args) -> list:
    """Model (c) with each kind of checkpointing: best-round medians and collectives per step."""
    best = {name: {"plain": [], "w2": []} for name in CHECKPOINTING}
    per_step = {}
    for round_ in range(args.rounds):
        print(f"model (c): round {round_ + 1}/{args.rounds} ...", file=sys.stderr, flush=True)
        for name in CHECKPOINTING:
            best[name]["plain"].append(one.run(plain_job, name, args.steps, args.warmup)[0])
            seconds, per_step[name] = two.run(paramfsm_job, name, args.steps, args.warmup)[0]
            best[name]["w2"].append(seconds)
    return [(name, min(best[name]["plain"]), min(best[name]["w2"]), per_step[name]) for name in CHECKPOINTING]


def print_checkpointing(rows) -> None:
    if not rows:
        return
    base_w2 = rows[0][2]
    print(f"\n{'model (c) 8 blocks, w2':<26}{'plain ms':>10}{'pfsm w2 ms':>12}{'w2/plain':>10}"
          f"{'w2/no-ckpt w2':>15}{'AG/step':>9}{'RS/step':>9}")
    for name, plain, w2, per_step in rows:
        label = CHECKPOINTING[name] or "no checkpointing"
        print(f"{label:<26}{plain * 1e3:>10.2f}{w2 * 1e3:>12.2f}{w2 / plain:>10.2f}{w2 / base_w2:>15.2f}"
              f"{per_step['all_gathers']:>9.1f}{per_step['reduce_scatters']:>9.1f}")


def print_floor(rows, depth_width) -> None:
    """Each ratio next to its floor: the hooks alone, and for (b) compute and communication alone;
    and the overhead per unit per step (microseconds) above plain torch and above the hooks alone."""
    if not rows:
        return
    print(f"\n{'floor':<22}{'hooks only ms':>14}{'hooks/plain':>12}{'w1/plain':>10}{'w2/plain':>10}"
          f"{'by_size/plain':>15}{'units':>6}{'w1 us/u>plain':>14}{'w1 us/u>hooks':>14}{'w2 us/u>plain':>14}"
          f"{'w2 us/u>hooks':>14}{'compute ms':>12}{'comm ms':>9}{'w2/compute':>12}{'w2/max(c,m)':>13}"
          f"{'w2/(c+m)':>10}{'max(c,m)/FSDP2':>16}")
    for name, base, hooks, w1, w2, w2s, f2, compute, comm in rows:
        units = unit_count(name)
        line = (f"({name}) {depth_width[name]:<18}{hooks * 1e3:>14.2f}{hooks / base:>12.2f}{w1 / base:>10.2f}"
                f"{w2 / base:>10.2f}{w2s / base:>15.2f}{units:>6}"
                + "".join(f"{(w - floor) / units * 1e6:>14.1f}" for w in (w1, w2) for floor in (base, hooks)))
        if compute is not None and comm is not None:
            line += (f"{compute * 1e3:>12.2f}{comm * 1e3:>9.2f}{w2 / compute:>12.2f}{w2 / max(compute, comm):>13.2f}"
                     f"{w2 / (compute + comm):>10.2f}{fmt_ratio(max(compute, comm), f2):>16}")
        print(line)


def fmt_ratio(a: float, b: float | None) -> str:
    """``a / b`` with two decimals, or "-" when ``b`` was not measured (--skip-fsdp2)."""
    return "-" if b is None else f"{a / b:.2f}"


def main(argv=None) -> int:
    from paramfsm.verify.launch import RankPool  # in main only: rank workers import this module for its jobs

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--only", choices=sorted(MODELS), nargs="+", help="models to run (default: all)")
    parser.add_argument("--skip-trace", action="store_true", help="leave out the trace-cost table")
    parser.add_argument("--skip-fsdp2", nargs="*", choices=sorted(MODELS), metavar="MODEL",
                        help="leave FSDP2 out for these models (all when none is named); (a) takes minutes")
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved rounds; each figure is the best round's median (machine drift cancels)")
    args = parser.parse_args(argv)
    names = args.only or sorted(MODELS)
    no_fsdp2 = set(MODELS if args.skip_fsdp2 == [] else args.skip_fsdp2 or ())
    rows, trace_rows, ckpt_rows, floor_rows = [], [], [], []
    with RankPool(1) as one, RankPool(2) as two:
        if "c" in names:
            ckpt_rows = checkpointing_rows(one, two, args)
        for name in (n for n in names if n != "c"):
            best = {"plain": [], "w1": [], "w2": [], "w2m": [], "fsdp2": [], "w2s": [], "hooks": [],
                    "compute": [], "comm": []}
            traced = {mode: [] for mode in TRACE_MODES}
            for round_ in range(args.rounds):
                print(f"model ({name}): round {round_ + 1}/{args.rounds} ...", file=sys.stderr, flush=True)
                best["plain"].append(one.run(plain_job, name, args.steps, args.warmup)[0])
                best["w1"].append(one.run(paramfsm_job, name, args.steps, args.warmup)[0][0])
                w2, per_step = two.run(paramfsm_job, name, args.steps, args.warmup)[0]
                best["w2"].append(w2)
                best["w2m"].append(two.run(paramfsm_job, name, args.steps, args.warmup, "model")[0][0])
                best["w2s"].append(two.run(paramfsm_job, name, args.steps, args.warmup, "shards", False,
                                           BY_SIZE)[0][0])
                if name not in no_fsdp2:
                    best["fsdp2"].append(two.run(fsdp2_job, name, args.steps, args.warmup)[0][0])
                best["hooks"].append(one.run(hooks_job, name, args.steps, args.warmup)[0])
                if name == "b":
                    best["compute"].append(max(two.run(plain_job, name, args.steps, args.warmup)))
                    best["comm"].append(max(seconds for seconds, _ in
                                            two.run(comm_job, name, args.steps, args.warmup)))
                for mode, trace in ({} if args.skip_trace else TRACE_MODES).items():
                    traced[mode].append(two.run(paramfsm_job, name, args.steps, args.warmup, "shards", trace)[0][0])
            base, w1, w2, w2m, w2s = (min(best[k]) for k in ("plain", "w1", "w2", "w2m", "w2s"))
            f2 = min(best["fsdp2"]) if best["fsdp2"] else None
            rows.append((name, base, w1, w2, f2, per_step["all_gathers"], per_step["reduce_scatters"], w2m, w2s))
            floor_rows.append((name, base, min(best["hooks"]), w1, w2, w2s, f2,
                               min(best["compute"]) if best["compute"] else None,
                               min(best["comm"]) if best["comm"] else None))
            if not args.skip_trace:
                trace_rows.append((name, *(min(traced[mode]) for mode in TRACE_MODES)))
    depth_width = {n: f"{d}xLinear({w},{w})" for n, (d, w) in MODELS.items()}
    depth_width["t"] = f"{MODELS['t'][0]}xGPTBlock({MODELS['t'][1]})"
    if not rows:  # --only c
        print_checkpointing(ckpt_rows)
        return 0
    print(f"{'model':<22}{'plain ms':>10}{'pfsm w1 ms':>12}{'pfsm w2 ms':>12}{'FSDP2 w2 ms':>13}"
          f"{'w1/plain':>10}{'w2/plain':>10}{'w2/FSDP2':>10}{'AG/step':>9}{'RS/step':>9}"
          f"{'w2 opt(model) ms':>18}{'vs shards':>10}{'w2 by_size ms':>15}{'by_size/plain':>15}")
    for name, base, w1, w2, f2, ag, rs, w2m, w2s in rows:
        f2_ms = "-" if f2 is None else f"{f2 * 1e3:.2f}"
        print(f"({name}) {depth_width[name]:<18}{base * 1e3:>10.2f}{w1 * 1e3:>12.2f}{w2 * 1e3:>12.2f}{f2_ms:>13}"
              f"{w1 / base:>10.2f}{w2 / base:>10.2f}{fmt_ratio(w2, f2):>10}{ag:>9.1f}{rs:>9.1f}"
              f"{w2m * 1e3:>18.2f}{w2m / w2:>10.2f}{w2s * 1e3:>15.2f}{w2s / base:>15.2f}")
    print_floor(floor_rows, depth_width)
    print_checkpointing(ckpt_rows)
    if not trace_rows:
        return 0
    print(f"\n{'model (world 2)':<22}{'no trace ms':>12}{'recorder ms':>12}{'full ms':>10}{'stream ms':>11}"
          f"{'recorder/off':>14}{'full/off':>10}{'stream/off':>12}")
    for name, off, ring, full, stream in trace_rows:
        print(f"({name}) {depth_width[name]:<18}{off * 1e3:>12.2f}{ring * 1e3:>12.2f}{full * 1e3:>10.2f}"
              f"{stream * 1e3:>11.2f}{ring / off:>14.2f}{full / off:>10.2f}{stream / off:>12.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
