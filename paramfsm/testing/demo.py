"""``make demo``: two gloo ranks train a small transformer with the retained-graph two-loss pattern.

Every step runs one forward, computes two losses from the same output and
backpropagates them separately: ``l1.backward(retain_graph=True)`` then
``l2.backward()`` (the pattern of DeepSpeed issue #7352). Every rank also
steps an unsharded copy of the model on the combined batch of both ranks;
the demo checks the full gradients after each backward and the parameters
after each step against it (SGD with momentum: Adam divides by the root of
tiny second moments and turns float noise in exactly-zero gradients, such as
an attention key bias, into full-size steps, which says nothing about
sharding), prints the loss per step, and writes the FSM
trace of every rank (JSON Lines + Perfetto) under ``--out``.

    python -m paramfsm.testing.demo [--steps 30] [--world 2] [--out demo-out]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from paramfsm.verify.launch import RankPool

VOCAB, DIM, DEPTH, SEQ, PER_RANK = 64, 32, 2, 16, 4


def _losses(logits, targets):
    """Next-token cross-entropy and a z-loss style auxiliary loss (both batch means)."""
    ce = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
    z = torch.logsumexp(logits, dim=-1).pow(2).mean() * 1e-2
    return ce, z


def _sequences(count: int, gen) -> torch.Tensor:
    """Arithmetic progressions mod VOCAB (random start and stride): learnable next-token data."""
    start = torch.randint(0, VOCAB, (count, 1), generator=gen)
    stride = torch.randint(1, 4, (count, 1), generator=gen)
    return (start + stride * torch.arange(SEQ + 1)) % VOCAB


def train(rank: int, world: int, steps: int, out: str) -> dict:
    """One rank's training loop; returns what rank 0 reports."""
    import paramfsm
    from paramfsm.core.fsm import default_table
    from paramfsm.core.replay import replay
    from paramfsm.testing import Reference, assert_close_dicts, rank_slice, sharded_grads, sharded_params
    from paramfsm.testing.models import TinyTransformer

    torch.manual_seed(0)
    model = TinyTransformer(vocab=VOCAB, dim=DIM, depth=DEPTH, seq=SEQ)
    ref = Reference(model, lambda ps: torch.optim.SGD(ps, lr=0.2, momentum=0.9))
    # The model is 120 KB, one unit under the default min_unit_bytes (64 KiB per unit at least);
    # 0 keeps a unit per module, so the trace shows parameters gathered and released unit by unit.
    rt = paramfsm.shard(model, trace=True, strict=True, min_unit_bytes=0)
    opt = torch.optim.SGD(rt.shard_parameters(), lr=0.2, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    worst_grad = worst_param = 0.0
    history = []
    start = time.perf_counter()
    for step in range(steps):
        data = _sequences(world * PER_RANK, gen)
        tokens, targets = data[:, :-1], data[:, 1:]
        l1, l2 = _losses(model(rank_slice(tokens, rank, world)), rank_slice(targets, rank, world))
        r1, r2 = _losses(ref.model(tokens), targets)
        opt.zero_grad()
        ref.zero_grad()
        l1.backward(retain_graph=True)
        r1.backward(retain_graph=True)
        worst_grad = max(worst_grad, assert_close_dicts(sharded_grads(rt, model), ref.grads(), atol=1e-5,
                                                        what=f"step {step} after l1.backward"))
        l2.backward()
        r2.backward()
        worst_grad = max(worst_grad, assert_close_dicts(sharded_grads(rt, model), ref.grads(), atol=1e-5,
                                                        what=f"step {step} after l2.backward"))
        opt.step()
        ref.optimizer.step()
        worst_param = max(worst_param, assert_close_dicts(sharded_params(rt, model), ref.params(), atol=1e-4,
                                                          what=f"step {step} parameters"))
        history.append((r1.item(), r2.item()))
        if rank == 0:
            print(f"[step {step + 1:>3}/{steps}] loss {r1.item():.4f}  aux {r2.item():.4f}  "
                  f"({time.perf_counter() - start:.1f}s)", file=sys.stderr, flush=True)
    out_dir = Path(out)
    jsonl = rt.trace.dump(out_dir / f"trace-rank{rank}.jsonl")
    perfetto = rt.trace.to_perfetto(out_dir / f"trace-rank{rank}.perfetto.json")
    problem = replay(rt.trace.records, default_table())
    report = {"rank": rank, "records": len(rt.trace), "replay": str(problem) if problem else "clean",
              "worst_grad": worst_grad, "worst_param": worst_param, "first": history[0], "last": history[-1],
              "counters": rt.counters, "jsonl": str(jsonl), "perfetto": str(perfetto),
              "leaks": [str(leak) for leak in rt.scheduler.audit.last]}
    rt.close()
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--out", default="demo-out")
    args = parser.parse_args(argv)
    print(f"paramfsm demo: {args.world} gloo ranks, {args.steps} steps of "
          "forward -> l1.backward(retain_graph=True) -> l2.backward() -> step", file=sys.stderr)
    with RankPool(args.world, timeout=600) as pool:
        reports = pool.run(train, args.steps, str(Path(args.out).resolve()))
    ok = True
    for r in reports:
        print(f"rank {r['rank']}: {r['records']} trace records, replay {r['replay']}, "
              f"max |grad - ref| {r['worst_grad']:.2e}, max |param - ref| {r['worst_param']:.2e}, "
              f"all-gathers {r['counters']['all_gathers']}, reduce-scatters {r['counters']['reduce_scatters']}")
        print(f"  trace: {r['jsonl']}\n  perfetto: {r['perfetto']}")
        ok &= r["replay"] == "clean" and not r["leaks"]
    first, last = reports[0]["first"], reports[0]["last"]
    print(f"loss {first[0]:.4f} -> {last[0]:.4f}; gradients and parameters match the unsharded reference "
          "after every backward and step")
    print("open the .perfetto.json files in https://ui.perfetto.dev; check a trace with "
          f"`paramfsm trace check {reports[0]['jsonl']}`")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
