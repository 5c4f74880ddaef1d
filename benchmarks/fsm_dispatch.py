"""Cost of one lifetime transition: the compiled table (fsm.step) against the transitions Machine.

Both run the same event cycle in the same process: a plain fetch/arrive/
release, a keep-graph backward (release to DEFERRED_RELEASE, a fetch that
reuses it, a flush) and a shared parameter (two holders). Every event in the
cycle is a transition, and the cycle ends where it started. Tracing is off.

Two measurements:

* per transition: one parameter stepped through the cycle many times;
* one event applied to every parameter of a 10,000-parameter model (a list of
  10,000 Lifetime records), which is what the scheduler does per unit. The
  Machine side builds one Machine per parameter, so it is measured on 1,000
  models and scaled by 10 (the output says so).

Timings are medians over several repeats, from ``time.perf_counter_ns``,
with the garbage collector paused.
The harness loop itself (iterating the cycle and calling a function) is
included in both columns; its cost is printed on its own line.

Run: ``python benchmarks/fsm_dispatch.py [--repeats N] [--check]``; with
``--check`` the exit status is 1 when a target is missed (compiled <= 0.5 us
per transition and >= 15x cheaper than the Machine).
"""

from __future__ import annotations

import argparse
import gc
import platform
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import transitions  # noqa: E402

from paramfsm import fsm  # noqa: E402
from paramfsm.core.machine import build_machine  # noqa: E402

CYCLE = (
    ("fetch", False, False), ("arrive", False, False), ("release", False, False),
    ("fetch", False, False), ("arrive", False, False), ("release", True, False),
    ("fetch", False, False), ("release", True, False), ("flush", False, False),
    ("fetch", False, False), ("arrive", False, False), ("fetch", False, False),
    ("release", False, False), ("release", False, False),
)
N_PARAMS = 10_000
MACHINE_SAMPLE = 1_000
TARGET_US = 0.5
TARGET_RATIO = 15.0


def median_ns(measure, repeats: int) -> float:
    """Median of ``repeats`` calls of ``measure() -> ns per unit``, after one warm-up call.

    The garbage collector is paused while timing (as ``timeit`` does), so a
    collection triggered by one side's allocations does not land on the other.
    """
    measure()
    gc.collect()
    gc.disable()
    try:
        return statistics.median(measure() for _ in range(repeats))
    finally:
        gc.enable()


def compiled_per_transition(cycles: int):
    table, step, ctx = fsm.default_table(), fsm.step, fsm.StepContext()
    rec = fsm.Lifetime("layer.weight", "layer")

    def measure() -> float:
        t0 = time.perf_counter_ns()
        for _ in range(cycles):
            for event, keep_graph, retained in CYCLE:
                step(table, rec, event, ctx, keep_graph, retained)
        return (time.perf_counter_ns() - t0) / (cycles * len(CYCLE))

    return measure


def machine_per_transition(cycles: int):
    _, model = build_machine(fsm.default_table().spec)

    def measure() -> float:
        trigger = model.trigger
        t0 = time.perf_counter_ns()
        for _ in range(cycles):
            for event, keep_graph, retained in CYCLE:
                model.keep_graph = keep_graph
                model.retained = retained
                trigger(event)
        return (time.perf_counter_ns() - t0) / (cycles * len(CYCLE))

    return measure


def harness_per_iteration(cycles: int):
    def noop(table, rec, event, ctx, keep_graph, retained):
        return ()

    def measure() -> float:
        t0 = time.perf_counter_ns()
        for _ in range(cycles):
            for event, keep_graph, retained in CYCLE:
                noop(None, None, event, None, keep_graph, retained)
        return (time.perf_counter_ns() - t0) / (cycles * len(CYCLE))

    return measure


def compiled_all_params(n: int):
    table, step, ctx = fsm.default_table(), fsm.step, fsm.StepContext()
    records = [fsm.Lifetime(f"layers.{i}.weight", f"layers.{i // 4}") for i in range(n)]

    def measure() -> float:
        t0 = time.perf_counter_ns()
        for event, keep_graph, retained in CYCLE:
            for rec in records:
                step(table, rec, event, ctx, keep_graph, retained)
        return (time.perf_counter_ns() - t0) / len(CYCLE)

    return measure


def machine_all_params(n: int):
    spec = fsm.default_table().spec
    models = [build_machine(spec)[1] for _ in range(n)]

    def measure() -> float:
        t0 = time.perf_counter_ns()
        for event, keep_graph, retained in CYCLE:
            for model in models:
                model.keep_graph = keep_graph
                model.retained = retained
                model.trigger(event)
        return (time.perf_counter_ns() - t0) / len(CYCLE)

    return measure


def bytes_per_parameter(make, n: int = 200) -> float:
    """Python heap allocated per parameter record (tracemalloc), averaged over ``n`` records."""
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    kept = [make(i) for i in range(n)]
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del kept
    return (after - before) / n


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats per measurement (median)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)

    per_compiled = median_ns(compiled_per_transition(20_000), args.repeats)
    per_machine = median_ns(machine_per_transition(1_000), args.repeats)
    harness = median_ns(harness_per_iteration(20_000), args.repeats)
    all_compiled = median_ns(compiled_all_params(N_PARAMS), args.repeats)
    all_machine = median_ns(machine_all_params(MACHINE_SAMPLE), args.repeats) * (N_PARAMS / MACHINE_SAMPLE)
    spec = fsm.default_table().spec
    mem_compiled = bytes_per_parameter(lambda i: fsm.Lifetime(f"p{i}", "u"))
    mem_machine = bytes_per_parameter(lambda i: build_machine(spec)[1])

    rows = [
        ("per transition (us)", per_compiled / 1e3, per_machine / 1e3, "{:.3f}", "{:.2f}"),
        (f"one event, {N_PARAMS:,} params (ms)", all_compiled / 1e6, all_machine / 1e6, "{:.2f}", "{:.1f}*"),
        ("heap per parameter (bytes)", mem_compiled, mem_machine, "{:.0f}", "{:.0f}"),
    ]
    print(f"fsm dispatch: median of {args.repeats} repeats; Python {platform.python_version()}, "
          f"transitions {transitions.__version__}; tracing off; cycle of {len(CYCLE)} transitions")
    print(f"{'':34}{'compiled':>12}{'Machine':>12}{'Machine/compiled':>19}")
    for label, compiled, machine, fmt_c, fmt_m in rows:
        print(f"{label:34}{fmt_c.format(compiled):>12}{fmt_m.format(machine):>12}{machine / compiled:>18.1f}x")
    print(f"* Machine measured on {MACHINE_SAMPLE:,} models (one Machine each), "
          f"scaled x{N_PARAMS // MACHINE_SAMPLE}")
    print(f"harness loop + call overhead, included above: {harness / 1e3:.3f} us per iteration")

    ratio = per_machine / per_compiled
    ok_time, ok_ratio = per_compiled / 1e3 <= TARGET_US, ratio >= TARGET_RATIO
    print(f"target compiled <= {TARGET_US} us per transition: {'met' if ok_time else 'MISSED'} "
          f"({per_compiled / 1e3:.3f} us); target >= {TARGET_RATIO:.0f}x cheaper than the Machine: "
          f"{'met' if ok_ratio else 'MISSED'} ({ratio:.1f}x)")
    return 0 if (ok_time and ok_ratio) or not args.check else 1


if __name__ == "__main__":
    raise SystemExit(main())
