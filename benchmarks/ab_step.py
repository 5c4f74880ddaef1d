"""A/B of paramfsm's step time between two checkouts, interleaved in one run.

Each checkout (A: ``--base``, a directory holding another version's ``paramfsm/``
and ``specs/``, e.g. ``git archive REV paramfsm specs | tar -x -C DIR``; B:
``--head``, by default this checkout) gets a server process with its own rank pools (world 1 and world 2)
that imports paramfsm from that checkout and the jobs of
:mod:`step_overhead` from this one, so both run the same models and loops.
Every measurement is taken from A and from B back to back (their order
alternating from round to round), so drift of a shared machine touches both
alike. Each figure is the median over rounds of a job's median step; plain
torch is measured in both servers, and each version's ratio is against its
own plain figure.

Jobs: ``w1`` (world 1), ``w2`` (world 2), ``w2s`` (world 2,
``units=paramfsm.by_size(1 MiB)``), ``fsdp2`` (PyTorch FSDP2, world 2: measured
in B's server only, for the ratio to FSDP2), ``hooks`` (world 1, paramfsm's hooks alone,
emitting into a no-op: with ``w1``, the microseconds per unit per step above the hooks). Models: those of :mod:`step_overhead`,
and ``llama``, the tiny Hugging Face Llama of :mod:`default_units` under the
default units (jobs ``w1``, ``w2`` and ``fsdp2``, FSDP2 wrapping each decoder layer; ``w2b``: world 2 with
FSDP2's wrapping given as ``units=``, the blocks a user would choose by hand). B/A is the A/B figure of the
change between the two checkouts: the ratio of the medians, and "paired", the
median over rounds of each round's B / A (the two taken back to back, so it
cancels drift between rounds best).

    python benchmarks/ab_step.py --base /tmp/base [--head /tmp/head] [--models a t] [--jobs w1 w2 w2s] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PREFIX = "@@ab "
#: Units holding parameters, where the per-unit cost above the hooks is printed (one per Linear).
PER_UNIT = {"u": 200}
#: Models of default_units (Hugging Face), measured under plain, w1, w2 and fsdp2 only.
HF_MODELS = ("llama",)

# The server: reads one job a line (JSON), answers one line starting with PREFIX.
SERVER = """
import json, sys
import paramfsm
print(PREFIX + json.dumps(paramfsm.__file__), flush=True)
try:
    from paramfsm.verify.launch import RankPool
except ImportError:  # a checkout from before the rank pools moved into paramfsm/verify/: the benchmarks' path
    import paramfsm.launch
    sys.modules["paramfsm.verify.launch"] = paramfsm.launch
    from paramfsm.launch import RankPool
import step_overhead as so
import default_units as du
with RankPool(1) as one, RankPool(2) as two:
    print(PREFIX + "null", flush=True)
    for line in sys.stdin:
        job, name, steps, warmup = json.loads(line)
        if name in du.MODELS and name not in so.MODELS:  # a Hugging Face model, default units
            setting = {"plain": "plain", "w1": None, "w2": None, "w2b": "blocks", "fsdp2": "FSDP2"}[job]
            pool = one if job in ("plain", "w1") else two
            out = max(r[0] for r in pool.run(du.step_job, name, setting, steps, warmup))
        elif job == "plain":
            out = one.run(so.plain_job, name, steps, warmup)[0]
        elif job == "w1":
            out = one.run(so.paramfsm_job, name, steps, warmup)[0][0]
        elif job == "w2":
            out = max(r[0] for r in two.run(so.paramfsm_job, name, steps, warmup))
        elif job == "w2s":
            out = max(r[0] for r in two.run(so.paramfsm_job, name, steps, warmup, "shards", False, so.BY_SIZE))
        elif job == "fsdp2":
            out = max(r[0] for r in two.run(so.fsdp2_job, name, steps, warmup))
        elif job == "hooks":
            out = one.run(so.hooks_job, name, steps, warmup)[0]
        else:
            raise SystemExit(f"unknown job {job}")
        print(PREFIX + json.dumps(out), flush=True)
"""


class Server:
    """One checkout's server process (see the module docstring)."""

    def __init__(self, checkout: Path):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(checkout), str(HERE)]))
        # -P: "python -c" would put the working directory first on sys.path, and run from a checkout's
        # root, both servers would import that checkout's paramfsm instead of their own.
        self.proc = subprocess.Popen([sys.executable, "-P", "-c", f"PREFIX = {PREFIX!r}\n" + SERVER], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.imported = self._answer()  # the paramfsm/__init__.py this server imported
        if not Path(self.imported).resolve().is_relative_to(checkout):
            raise RuntimeError(f"the server for {checkout} imported paramfsm from {self.imported}")
        self._answer()

    def _answer(self):
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                return json.loads(line[len(PREFIX):])
        raise RuntimeError(f"the server exited with {self.proc.wait()}")

    def run(self, job: str, name: str, steps: int, warmup: int) -> float:
        self.proc.stdin.write(json.dumps([job, name, steps, warmup]) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", type=Path, required=True, help="checkout A (holds paramfsm/ and specs/)")
    parser.add_argument("--head", type=Path, default=HERE.parent,
                        help="checkout B (default: this one; a copy keeps edits made during the run out of it)")
    parser.add_argument("--models", nargs="+", default=["a", "t"], choices=["a", "u", "b", "t", *HF_MODELS],
                        help="step_overhead's models, or llama: default_units' tiny Hugging Face Llama (default "
                             "units; its fsdp2 job wraps each decoder layer)")
    parser.add_argument("--jobs", nargs="+", default=["w1", "w2", "w2s"],
                        choices=["w1", "w2", "w2s", "w2b", "fsdp2", "hooks"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args(argv)
    servers = {"A": Server(args.base.resolve()), "B": Server(args.head.resolve())}
    times: dict = {}
    try:
        for round_ in range(args.rounds):
            print(f"round {round_ + 1}/{args.rounds} ...", file=sys.stderr, flush=True)
            order = ("A", "B") if round_ % 2 == 0 else ("B", "A")
            for name in args.models:
                for job in ("plain", *args.jobs):
                    if (name in HF_MODELS) != (job == "w2b") and job not in ("plain", "w1", "w2", "fsdp2"):
                        continue
                    for version in ("B",) if job == "fsdp2" else order:
                        seconds = servers[version].run(job, name, args.steps, args.warmup)
                        times.setdefault((name, job, version), []).append(seconds)
    finally:
        for server in servers.values():
            server.close()
    med = {key: statistics.median(values) for key, values in times.items()}
    print(f"{'model':<7}{'job':<7}{'A ms':>10}{'B ms':>10}{'A/plain':>9}{'B/plain':>9}{'B/A':>7}{'B/A paired':>12}")
    for name in args.models:
        for job in args.jobs:
            if job in ("fsdp2", "hooks") or (name, job, "A") not in med:
                continue
            a, b = med[(name, job, "A")], med[(name, job, "B")]
            pa, pb = med[(name, "plain", "A")], med[(name, "plain", "B")]
            paired = statistics.median(tb / ta for ta, tb in zip(times[(name, job, "A")], times[(name, job, "B")]))
            line = (f"({name})    {job:<7}{a * 1e3:>10.2f}{b * 1e3:>10.2f}{a / pa:>9.2f}{b / pb:>9.2f}{b / a:>7.3f}"
                    f"{paired:>12.3f}")
            if "hooks" in args.jobs and job == "w1" and name in PER_UNIT:
                ha, hb = med[(name, "hooks", "A")], med[(name, "hooks", "B")]
                line += (f"   above the hooks, us per unit: A {(a - ha) / PER_UNIT[name] * 1e6:.1f}, "
                         f"B {(b - hb) / PER_UNIT[name] * 1e6:.1f}")
            if "fsdp2" in args.jobs and job in ("w2", "w2b"):
                f2 = med[(name, "fsdp2", "B")]
                line += f"   FSDP2 {f2 * 1e3:.2f} ms: A/FSDP2 {a / f2:.2f}, B/FSDP2 {b / f2:.2f}"
            print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
