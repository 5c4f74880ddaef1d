"""Rank 0 of large worlds, simulated: torch's fake process group runs the whole runtime without peers.

For worlds of 8 to 1,024 ranks, a GPT-style model is sharded and trained for
a few steps on rank 0 of a fake group (collectives return at once; an
all-gather's output is filled with copies of this rank's input, so values stay
finite). Reported per world size:

* shard bytes per rank;
* step time, and paramfsm's share of it (the step minus a plain-torch step of
  the same model in the same process): the bookkeeping must not grow with
  the world size;
* collectives and bytes per rank per step, and the check against ZeRO-3's
  formula: about 3 x parameter bytes x (N-1)/N on the wire (an all-gather in
  forward, a re-gather in backward, a reduce-scatter);
* the rank-order check's cost: bytes its tag adds to every all-gather (it
  grows with N) and the step time with the check off.

``--estimate`` prints a model-based estimate of step time for a 7B-parameter
model on 1,024 GPUs, flat and hybrid, from stated bandwidths and latencies.

    python benchmarks/scale_sim.py [--worlds 8 64 256 1024] [--steps 6] [--check] [--estimate]

``--check`` exits 1 unless the measured bytes per step are within 10% of the formula.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import paramfsm
from paramfsm.engine.effects import gathers as gathers_module
from paramfsm.testing.models import Block, TinyTransformer

VOCAB, DIM, DEPTH, SEQ, BATCH = 256, 128, 6, 64, 4
#: ZeRO-3 moves each parameter's bytes three times per step: gather, re-gather, reduce-scatter.
ZERO3_PASSES = 3


#: All-gathers served by :func:`_gather_copies`; --check fails unless the runtime's gathers use it.
FAKE_GATHERS = [0]


def _gather_copies(out, inp, group, async_op=True):
    """The fake group's all-gather: every rank's slot gets this rank's shard (finite values)."""
    FAKE_GATHERS[0] += 1
    out.view(-1, inp.numel()).copy_(inp.reshape(1, -1))
    return None


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    return TinyTransformer(VOCAB, DIM, DEPTH, SEQ, tied=True)


def time_steps(model, opt, steps: int) -> float:
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(tokens).float().logsumexp(-1).mean().backward()
        opt.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]) if len(times) > 1 else times[0]


def simulate(world: int, steps: int, rank_check: bool) -> dict:
    """Rank 0 of a fake ``world``-rank group: step time, shard bytes and collectives per step."""
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        model = build()
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        rt = paramfsm.shard(model, units=(Block,), trace=0)
        if not rank_check:
            rt.executor.rank_check = None
        opt = torch.optim.SGD(rt.shard_parameters(), lr=1e-3)
        time_steps(model, opt, 2)
        before, faked = rt.counters, FAKE_GATHERS[0]
        seconds = time_steps(model, opt, steps)
        faked = FAKE_GATHERS[0] - faked
        per_step = {k: (v - before[k]) / steps for k, v in rt.counters.items()}
        shard_bytes = sum(s.numel() * s.element_size() for s in rt.shard_parameters())
        rt.close()
    finally:
        dist.destroy_process_group()
    wire = (per_step["gathered_bytes"] + per_step["reduced_bytes"]) * (world - 1) / world
    formula = ZERO3_PASSES * param_bytes * (world - 1) / world
    return {"world": world, "seconds": seconds, "shard_bytes": shard_bytes, "param_bytes": param_bytes,
            "collectives": per_step["all_gathers"] + per_step["reduce_scatters"], "wire": wire,
            "formula": formula, "gathers": per_step["all_gathers"],
            "faked": faked >= per_step["all_gathers"] * steps > 0}


def estimate_7b() -> str:
    """Step time of a 7B model on 1,024 GPUs (128 nodes x 8), flat and hybrid: an estimate."""
    params, dtype_bytes = 7e9, 2  # bf16 gathers and gradients
    nodes, per_node = 128, 8
    nvlink, ib = 450e9, 50e9  # bytes/s per GPU: NVLink within a node, one 400 Gb/s NIC per GPU across
    alpha_nvlink, alpha_ib = 5e-6, 10e-6  # seconds per ring step
    layers = 32  # one unit per transformer block: 3 collectives each per step
    tokens_per_gpu, flops_per_gpu = 4096, 400e12  # per step; sustained bf16
    p = params * dtype_bytes
    n = nodes * per_node
    compute = 6 * params * tokens_per_gpu / flops_per_gpu
    flat = ZERO3_PASSES * p * (n - 1) / n / ib + ZERO3_PASSES * layers * (n - 1) * alpha_ib
    inside = ZERO3_PASSES * p * (per_node - 1) / per_node / nvlink + ZERO3_PASSES * layers * (per_node - 1) * alpha_nvlink
    across = 2 * (p / per_node) * (nodes - 1) / nodes / ib + layers * 2 * (nodes - 1) * alpha_ib
    hybrid = inside + across
    rows = [("compute (6 x params x tokens / FLOP/s)", compute),
            ("flat ZeRO-3 over 1,024 ranks: communication", flat),
            ("hybrid 128 x 8: communication (NVLink shard + IB all-reduce)", hybrid),
            ("flat step, communication not hidden", compute + flat),
            ("flat step, fully overlapped", max(compute, flat)),
            ("hybrid step, fully overlapped", max(compute, hybrid))]
    lines = ["Estimate (not a measurement): 7B parameters, bf16, 1,024 GPUs = 128 nodes x 8; NVLink 450 GB/s "
             "and 5 us per ring step inside a node; one 400 Gb/s NIC (50 GB/s) and 10 us per ring step per GPU "
             "across nodes; ring collectives; one unit per block (32); 4,096 tokens per GPU per step at "
             "400 TFLOP/s sustained."]
    lines += [f"  {label:<62}{seconds * 1e3:>10.0f} ms" for label, seconds in rows]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 256, 1024])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--check", action="store_true", help="exit 1 unless bytes per step match the formula")
    parser.add_argument("--estimate", action="store_true", help="also print the 7B / 1,024-GPU estimate")
    args = parser.parse_args(argv)
    gathers_module.all_gather_flat = _gather_copies
    model = build()
    plain_opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    print(f"model: TinyTransformer(vocab {VOCAB}, dim {DIM}, depth {DEPTH}), "
          f"{sum(p.numel() for p in model.parameters()):,} parameters, one unit per block; 'pfsm ms' is the "
          "step minus a plain-torch step timed right before it")
    print(f"{'world':>6}{'shard KiB':>11}{'step ms':>9}{'pfsm ms':>9}{'coll/step':>11}{'wire KiB/step':>15}"
          f"{'formula KiB':>13}{'ratio':>7}{'tag KiB/step':>14}{'step ms, no check':>19}")
    failed = False
    for world in args.worlds:
        print(f"world {world}: simulating ...", file=sys.stderr, flush=True)
        plain = time_steps(model, plain_opt, args.steps + 1)
        on, off = simulate(world, args.steps, True), simulate(world, args.steps, False)
        ratio = off["wire"] / off["formula"]
        failed |= not 1.0 <= ratio <= 1.1
        if not (on["faked"] and off["faked"]):
            print(f"world {world}: the runtime's all-gathers did not go through the fake gather", file=sys.stderr)
            failed = True
        tag = (on["wire"] - off["wire"]) / 1024
        print(f"{world:>6}{on['shard_bytes'] / 1024:>11.1f}{on['seconds'] * 1e3:>9.1f}"
              f"{(on['seconds'] - plain) * 1e3:>9.1f}{on['collectives']:>11.1f}{off['wire'] / 1024:>15.1f}"
              f"{off['formula'] / 1024:>13.1f}{ratio:>7.3f}{tag:>14.1f}{off['seconds'] * 1e3:>19.1f}")
    if args.estimate:
        print()
        print(estimate_7b())
    if args.check and failed:
        print("bytes per step are not within 10% of 3 x parameter bytes x (N-1)/N, or the fake gather "
              "was bypassed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
