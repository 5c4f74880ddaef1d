"""The score of the last ``make mutate`` run, per module, from ``mutmut results --all true``.

Score = killed / (mutants that some test ran against), where killed includes
timeouts (a mutant that hangs is caught). Survivors are listed by name;
``mutmut show NAME`` prints one as a diff, ``mutmut apply NAME`` writes it.
"""

from __future__ import annotations

import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

KILLED = {"killed", "timeout"}


def read_results(mutmut: str) -> dict[str, str]:
    """``mutant name -> status`` as mutmut reports them."""
    done = subprocess.run([mutmut, "results", "--all", "true"], capture_output=True, text=True, check=True)
    results = {}
    for line in done.stdout.splitlines():
        name, _, status = line.strip().rpartition(": ")
        if name:
            results[name] = status
    return results


def module_of(mutant: str) -> str:
    """``paramfsm.core.fsm.x_step__mutmut_3`` -> ``paramfsm.core.fsm``."""
    parts = mutant.split("__mutmut_")[0].split(".")
    return ".".join(p for p in parts[:-1])


def main() -> int:
    mutmut = str(Path(sys.executable).with_name("mutmut"))
    results = read_results(mutmut)
    if not results:
        print("no mutmut results: run `make mutate` first")
        return 2
    by_module: dict[str, Counter] = defaultdict(Counter)
    survivors = []
    for name, status in results.items():
        by_module[module_of(name)][status] += 1
        if status == "survived":
            survivors.append(name)
    print(f"{'module':<40}{'mutants':>9}{'killed':>8}{'survived':>10}{'no tests':>10}{'score':>8}")
    total = Counter()
    for module in sorted(by_module):
        counts = by_module[module]
        total.update(counts)
        print(_row(module, counts))
    print(_row("all", total))
    print(f"\n{len(survivors)} survivors (mutmut show NAME):")
    for name in sorted(survivors):
        print(f"  {name}")
    return 0


def _row(label: str, counts: Counter) -> str:
    killed = sum(counts[s] for s in KILLED)
    tested = killed + counts["survived"] + counts["suspicious"]
    score = f"{killed / tested:.0%}" if tested else "-"
    return (f"{label:<40}{sum(counts.values()):>9}{killed:>8}{counts['survived']:>10}"
            f"{counts['no tests']:>10}{score:>8}")


if __name__ == "__main__":
    raise SystemExit(main())
