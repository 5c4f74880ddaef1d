"""The per-bucket torch work, batched, against the per-item work it replaced, in the same run.

Each row times one way of doing one bucket's work on the CPU (microseconds,
the best of ``--repeats`` medians, the ways interleaved so drift touches all
alike) and gives the ratio to the first way of its group:

* gradient packing (the reduce-scatter input): per-gradient ``_foreach_copy_``
  and zero fills (``torch_impl.pack_grads``), one ``cat`` and ``index_copy_``
  (the previous path for 16 gradients or more), and one ``torch._chunk_cat``
  (``torch_impl.pack_grads_chunked``, what the dispatcher takes now);
* unpacking a gathered bucket into one buffer of views: per-parameter
  ``_foreach_copy_`` (the previous path for fewer than 16 parameters), one
  ``index_select`` (kept for many small parameters), and one
  ``split_with_sizes_copy`` (``torch_impl.unpack_padded_views``);
* the flight recorder's trim of its default ring, as it drops one ring's worth
  of unit entries: one ``popleft`` per entry (the previous trim) against one
  slice deletion (``Trace._trim``); both include copying the entries into a
  fresh ring first.

Buckets: the tiny model's (200 x Linear(8, 8), 400 parameters), one GPT block
of width 128 (12 parameters) and two of them, at world 2.

    python benchmarks/batched_effects.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from paramfsm.core.fsm import Lifetime, StepContext, default_table, step_many  # noqa: E402
from paramfsm.core.trace import DEFAULT_RING, Trace  # noqa: E402
from paramfsm.engine.effects import kernels  # noqa: E402
from paramfsm.engine.effects.kernels import shard_layout, torch_impl  # noqa: E402

WORLD = 2
WIDTH = 128


def buckets() -> dict[str, list[torch.Size]]:
    d = WIDTH
    block = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    tiny = [shape for _ in range(200) for shape in ((8, 8), (8,))]
    return {"tiny model (400)": [torch.Size(s) for s in tiny], "GPT block (12)": [torch.Size(s) for s in block],
            "2 GPT blocks (24)": [torch.Size(s) for s in block * 2]}


def cat_index_copy(grads, layout, out):
    """The previous packing of 16 gradients or more: one cat, one index_copy_."""
    src = torch.cat([g.reshape(-1) for g in grads])
    return out.index_copy_(0, torch_impl.element_index(layout), src)


def foreach_views(gathered, layout, shapes):
    """The previous unpacking of fewer than 16 parameters: views of one buffer, one copy per parameter."""
    flat = torch.empty(sum(layout.numels), dtype=gathered.dtype)
    views, offset = [], 0
    for numel, shape in zip(layout.numels, shapes):
        views.append(flat.view(-1)[offset:offset + numel].view(shape))
        offset += numel
    torch_impl.unpack_gathered(gathered, views, layout.shard_numels, layout.world)
    return views


def index_select_views(gathered, layout, shapes):
    """One index_select into one buffer, and a view per parameter."""
    flat = torch.empty(sum(layout.numels), dtype=gathered.dtype)
    views, offset = [], 0
    for numel, shape in zip(layout.numels, shapes):
        views.append(flat.as_strided(shape, kernels._contiguous_strides(shape), offset))
        offset += numel
    torch_impl.unpack_gathered_flat(gathered, layout, flat)
    return views


def time_us(fn, number: int) -> float:
    start = time.perf_counter_ns()
    for _ in range(number):
        fn()
    return (time.perf_counter_ns() - start) / number / 1e3


def interleaved(ways: dict, repeats: int, number: int = 30) -> dict[str, float]:
    """Best of ``repeats`` rounds of each way, the ways taking turns within every round."""
    best: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(repeats):
        for name, fn in ways.items():
            best[name].append(statistics.median(time_us(fn, number) for _ in range(3)))
    return {name: min(values) for name, values in best.items()}


def trim_ways():
    """Two rings filled alike (a tiny model's unit entries); each way trims a fresh copy."""
    table = default_table()
    unit = (Lifetime("w", "u"), Lifetime("b", "u"))
    trace = Trace(0, limit=DEFAULT_RING, digest=table.digest)
    ctx = StepContext(0, trace)
    trace._next_trim = float("inf")
    for _ in range(DEFAULT_RING // 2):  # one ring's worth beyond the window: a trim's usual drop
        for event in ("fetch", "arrive", "release"):
            step_many(table, unit, event, ctx)
    entries, seq = list(trace._raw), trace._seq

    def popleft():
        from collections import deque
        raw, start = deque(entries), seq - DEFAULT_RING
        while len(raw) > 1 and raw[1][0] <= start:
            raw.popleft()

    def sliced():
        trace._raw = list(entries)
        trace._trim()

    return {"popleft per entry (before)": popleft, "one slice deletion (now)": sliced}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    print(f"{'bucket':<20}{'way':<44}{'us':>10}{'vs first':>10}")
    for label, shapes in buckets().items():
        grads = [torch.randn(shape) for shape in shapes]
        layout = shard_layout(tuple(s.numel() for s in shapes), WORLD)
        out = torch.empty(layout.gathered_numel)
        gathered = torch.randn(layout.gathered_numel)
        packs = {"pack: per-gradient copies": lambda: torch_impl.pack_grads(grads, layout.shard_numels, WORLD, out),
                 "pack: cat + index_copy_ (before, >= 16)": lambda: cat_index_copy(grads, layout, out),
                 "pack: one _chunk_cat (now)": lambda: torch_impl.pack_grads_chunked(grads, WORLD, out)}
        unpacks = {"unpack: per-parameter copies (before, < 16)": lambda: foreach_views(gathered, layout, shapes),
                   "unpack: one index_select": lambda: index_select_views(gathered, layout, shapes),
                   "unpack: one split_with_sizes_copy": lambda: torch_impl.unpack_padded_views(
                       gathered, layout, shapes, [kernels._contiguous_strides(s) for s in shapes])}
        for ways in (packs, unpacks):
            times = interleaved(ways, args.repeats)
            first = next(iter(times.values()))
            for name, us in times.items():
                print(f"{label:<20}{name:<44}{us:>10.1f}{us / first:>10.2f}")
    times = interleaved(trim_ways(), args.repeats, number=5)
    first = next(iter(times.values()))
    for name, us in times.items():
        print(f"{'ring trim (8192)':<20}{name:<44}{us:>10.1f}{us / first:>10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
