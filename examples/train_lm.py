"""Train a small GPT-style language model with paramfsm under torchrun. Copy it and adapt it.

One machine, two processes (gloo on CPU, NCCL when CUDA is there)::

    torchrun --nproc-per-node 2 examples/train_lm.py --steps 50 --out runs/lm
    torchrun --nproc-per-node 2 examples/train_lm.py --steps 100 --out runs/lm --resume
    torchrun --nproc-per-node 2 examples/train_lm.py --steps 100 --out runs/lm --resume runs/lm/step-40

Several machines (run on every node, with its --node-rank)::

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 \\
        --rdzv-backend c10d --rdzv-endpoint node0.example:29500 examples/train_lm.py --mesh 2x8

What it shows: the model built on the meta device (nothing allocated),
``paramfsm.shard(..., device=)`` placing only this rank's shards and
``rt.init_weights(fn)`` initialising it module by module, the same weights at
any world size (``--eager`` builds it whole on every rank instead);
``paramfsm.shard`` with a choice of units, retain policy and mesh; AdamW over ``model.parameters()``;
gradient accumulation (``--accum K``: the first K-1 micro-batches under ``rt.no_sync()``, one
reduce-scatter per step);
``rt.clip_grad_norm_``; optional bf16 compute; a sharded DCP checkpoint every
``--save-every`` steps (atomic: a crash mid-save keeps the previous one; ``--keep-last N``;
``--async-save`` writes in the background) and ``--resume`` from the newest complete one
(``paramfsm.checkpoint.latest``) or a given folder; the flight recorder
(on by default: a failure leaves ``paramfsm-trace-rank*.jsonl`` in ``--out``);
and one progress line per step on rank 0. The data is a synthetic token stream
drawn from the global step, so a resumed run sees exactly the batches an
uninterrupted one would.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import paramfsm
import paramfsm.checkpoint
import paramfsm.optim
from paramfsm.testing.models import Block, TinyTransformer


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps to reach (a resumed run counts on)")
    parser.add_argument("--batch", type=int, default=8, help="sequences per rank per micro-batch")
    parser.add_argument("--accumulate", "--accum", type=int, default=2,
                        help="micro-batches per optimizer step (all but the last under rt.no_sync(): one "
                             "reduce-scatter per step)")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--clip", type=float, default=1.0, help="max gradient norm (0: no clipping)")
    parser.add_argument("--bf16", action="store_true", help="gather and compute in bf16 (fp32 shards)")
    parser.add_argument("--retain", choices=("defer", "regather"), default="defer")
    parser.add_argument("--units", default="block",
                        help="'block' (one unit per transformer block), 'module' (per module) or by_size:BYTES")
    parser.add_argument("--mesh", default=None,
                        help="REPLICATExSHARD, e.g. 2x4: shard within groups of SHARD ranks, replicate across")
    parser.add_argument("--out", type=Path, default=Path("runs/lm"))
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--keep-last", type=int, default=None, help="keep only the newest N checkpoints in --out")
    parser.add_argument("--async-save", action="store_true",
                        help="write checkpoints in the background (training goes on after a copy of the shards)")
    parser.add_argument("--resume", nargs="?", const="auto", default=None, metavar="auto|FOLDER",
                        help="continue from the newest complete checkpoint in --out ('auto', the default when "
                             "given without a value; starts from step 0 when there is none) or from FOLDER")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eager", action="store_true",
                        help="build the whole model on every rank, then shard it (default: build on meta)")
    return parser.parse_args(argv)


def initialiser(model: TinyTransformer):
    """``fn`` for ``rt.init_weights``: each module's ``reset_parameters()``, a small normal init for the
    tied embedding / LM head (the head comes later in ``model.apply`` order, so its write is the one
    kept) and for the learned positions (a parameter of the model itself, visited last)."""
    def init(module: torch.nn.Module) -> None:
        if module is model.head:
            torch.nn.init.normal_(module.weight, std=0.02)  # the head starts near uniform predictions
        elif callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()
        if module is model:
            torch.nn.init.normal_(model.pos, std=0.02)
    return init


def units_from(text: str):
    if text == "block":
        return (Block,)
    if text == "module":
        return None
    match = re.fullmatch(r"by_size:(\d+)", text)
    if match:
        return paramfsm.by_size(min_bytes=int(match.group(1)))
    raise SystemExit(f"--units {text!r}: expected block, module or by_size:BYTES")


def mesh_from(text: str | None, device_type: str):
    """A 2-D (replicate, shard) DeviceMesh from 'RxS', or None for plain sharding over every rank."""
    if text is None:
        return None
    from torch.distributed.device_mesh import init_device_mesh

    replicate, shard = (int(n) for n in text.lower().split("x"))
    if replicate * shard != dist.get_world_size():
        raise SystemExit(f"--mesh {text}: {replicate}x{shard} != world size {dist.get_world_size()}")
    return init_device_mesh(device_type, (replicate, shard), mesh_dim_names=("replicate", "shard"))


def batch(step: int, micro: int, args, rank: int, world: int, device) -> torch.Tensor:
    """This rank's share of micro-batch ``micro`` of ``step``: a noisy affine token recurrence."""
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + micro)
    n = args.batch * world
    start = torch.randint(0, args.vocab, (n, 1), generator=gen)
    steps = torch.arange(args.seq).unsqueeze(0)
    tokens = (start + 7 * steps) % args.vocab
    noise = torch.rand(n, args.seq, generator=gen) < 0.1
    tokens = torch.where(noise, torch.randint(0, args.vocab, (n, args.seq), generator=gen), tokens)
    return tokens.chunk(world)[rank].to(device)


def checkpoint_to_resume(args) -> tuple[int, Path] | None:
    """``(step, folder)`` of the checkpoint ``--resume`` names, or None when ``auto`` finds none.

    Exits with a message for a folder whose name is not ``step-N`` and for a
    ``--steps`` below the checkpoint's step (the run would do nothing).
    """
    if args.resume == "auto":
        path = paramfsm.checkpoint.latest(args.out)
        if path is None:
            return None
    else:
        path = Path(args.resume)
    match = re.fullmatch(r"step-(\d+)", path.name)
    if match is None:
        raise SystemExit(f"--resume {path}: expected a checkpoint folder named step-N (as this script saves)")
    step = int(match.group(1))
    if args.steps < step:
        raise SystemExit(f"--steps {args.steps} is below the step of the checkpoint to resume ({path}, step {step}): "
                         f"pass --steps above {step} to train on from it")
    return step, path


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', 0)}") if torch.cuda.is_available() else "cpu"
    if device != "cpu":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device != "cpu" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    args.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PARAMFSM_TRACE_DIR", str(args.out))

    torch.manual_seed(args.seed)  # the same seed on every rank: every rank computes the same full weights
    with torch.device("meta" if not args.eager else device):
        model = TinyTransformer(args.vocab, args.dim, args.depth, args.seq, tied=True)
    mesh = mesh_from(args.mesh, torch.device(device).type)
    shard_kw = {"mesh": mesh} if mesh is not None else {}
    if not args.eager:
        shard_kw["device"] = device  # only this rank's shards are allocated, there
    rt = paramfsm.shard(model, units=units_from(args.units), retain=args.retain,
                        param_dtype=torch.bfloat16 if args.bf16 else None, **shard_kw)
    torch.manual_seed(args.seed)
    rt.init_weights(initialiser(model))  # module by module; bit-identical to the same init of the whole model
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    paramfsm.optim.map_optimizer(opt)  # steps the shards; mapped now so a checkpoint can load into it

    start = 0
    if args.resume is not None:
        found = checkpoint_to_resume(args)
        if found is None:
            if rank == 0:
                print(f"nothing to resume in {args.out} (no complete checkpoint): starting from step 0", flush=True)
        else:
            start, path = found
            paramfsm.checkpoint.load(rt, path, optimizer=opt)
            if rank == 0:
                left = f"training to step {args.steps}" if start < args.steps else "nothing left to train"
                print(f"resumed from {path} at step {start}: {left}", flush=True)

    saving = None

    for step in range(start, args.steps):
        began = time.perf_counter()
        rt.set_step(step)
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for micro in range(args.accumulate):
            tokens = batch(step, micro, args, rank, world, device)
            last = micro == args.accumulate - 1
            with contextlib.nullcontext() if last else rt.no_sync():  # gradients stay local until the last
                logits = model(tokens[:, :-1])
                loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()) / args.accumulate
                loss.backward()
            total += loss.detach()
        norm = rt.clip_grad_norm_(args.clip) if args.clip > 0 else None
        opt.step()
        dist.all_reduce(total)
        seconds = time.perf_counter() - began
        if rank == 0:
            tokens_per_s = args.accumulate * args.batch * world * (args.seq - 1) / seconds
            extra = f" grad norm {norm.item():.3f}" if norm is not None else ""
            print(f"step {step + 1}/{args.steps} loss {total.item() / world:.4f} tokens/s {tokens_per_s:,.0f} "
                  f"deferred {rt.deferred_bytes} B{extra}", flush=True)
        if (step + 1) % args.save_every == 0 or step + 1 == args.steps:
            saving = paramfsm.checkpoint.save(rt, args.out / f"step-{step + 1}", optimizer=opt,
                                              keep_last=args.keep_last, async_save=args.async_save)
    if saving is not None:
        saving.wait()  # the last checkpoint is on disk before the run ends
    rt.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
