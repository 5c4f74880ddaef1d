"""How often drawn programs hold each op and pattern: ``python -m paramfsm.verify.frequencies MODULE:FACTORY``.

Draws programs for the subject as ``paramfsm verify --examples N --seed S``
does, for ``--seeds`` seeds (hypothesis draws the programs of one run from
one another, so one long run says little about a short one), and prints, for
every op kind and for the user-loop patterns of
:mod:`paramfsm.verify.user_loop_intents`, the share of programs that hold it
at least once. Nothing runs on ranks.
"""

from __future__ import annotations

import argparse
from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import seed as hypothesis_seed

from paramfsm.verify.ops import (
    Backward, ClosureStep, Drop, Evaluate, Forward, GatheredWrite, Loss, PartStep, Penalty, Program, RankLoss,
    Restore, Save, Step, SubForward, ZeroGrad,
)


def patterns(program: Program) -> set[str]:
    """The op kinds of a program and the user-loop patterns it holds."""
    found = {type(op).__name__ for op in program.ops}
    retained: set[int] = set()  # alive outputs a backward retained
    owner: dict[int, int] = {}
    stepped_over: set[int] = set()  # retained outputs an optimizer stepped over
    made: dict[int, str] = {}  # outputs of forwards so far -> the module that made them ("": the root)
    before_step: set[int] = set()  # outputs of forwards made before the last step
    for op in program.ops:
        if isinstance(op, (Step, PartStep)):
            before_step = set(made)
        elif isinstance(op, (Forward, SubForward)):
            made[op.out] = getattr(op, "module", "")
        if isinstance(op, (Loss, RankLoss)):
            owner[op.loss] = op.out if isinstance(op, Loss) else op.outs[-1]
        elif isinstance(op, (Backward, Penalty)) and op.retain:
            retained.add(owner[op.loss])
        elif isinstance(op, (Step, PartStep)) and retained:
            stepped_over |= retained
            found.add("step over a retained graph")
        elif isinstance(op, (Forward, SubForward, Backward)) and stepped_over:
            found.add("step between a retained backward and the next forward or backward")
        elif isinstance(op, Drop):
            retained.discard(op.out)
            stepped_over.discard(op.out)
        if isinstance(op, SubForward):
            found.add("SubForward " + ("detached" if op.detach else "on a kept graph") + (", view" if op.view else ""))
            if op.source in before_step:
                found.add("SubForward after a step, on inputs saved before it")
        elif isinstance(op, GatheredWrite) and retained:
            found.add("GatheredWrite while a retained graph is alive")
        elif isinstance(op, Evaluate):
            found.add("Evaluate under " + ("inference_mode" if op.inference else "no_grad"))
        elif isinstance(op, (Save, Restore)):
            way = "full state dict" if op.full else "plain DCP in place" if getattr(op, "plain", False) else "DCP"
            way += " and opt.load_state_dict" * op.optimizer
            found.add(f"{type(op).__name__}({way})")
        if isinstance(op, Restore) and retained:
            found.add("Restore while a retained graph is alive")
        if isinstance(op, ClosureStep):
            zeroes = isinstance(op.inner[0], ZeroGrad)
            found.add("ClosureStep " + ("that zeroes the gradients" if zeroes else "after micro-batches under no_sync"))
        if isinstance(op, RankLoss):
            found.add("RankLoss over outputs of " + ("different" if len({made[o] for o in op.outs}) > 1 else "the same")
                      + " modules")
    return found


def frequencies(shape, examples: int = 50, seeds: int = 10, max_ops: int = 16) -> Counter:
    """Pattern -> number of drawn programs holding it, over ``seeds`` runs of ``examples`` draws for a model of
    ``shape`` (the ``"programs"`` entry counts them all)."""
    from paramfsm.verify.programs import programs as strategy

    seen: Counter = Counter()
    for run in range(seeds):
        @settings(max_examples=examples, deadline=None, database=None, derandomize=False,
                  suppress_health_check=list(HealthCheck))
        @hypothesis_seed(run)
        @given(strategy(shape, max_ops=max_ops))
        def draw(program):
            seen.update(patterns(program))
            seen["programs"] += 1

        draw()
    return seen


def main(argv=None) -> int:
    from paramfsm.verify.search import probe

    parser = argparse.ArgumentParser(prog="python -m paramfsm.verify.frequencies", description=__doc__.split("\n")[0])
    parser.add_argument("factory", metavar="MODULE:FACTORY")
    parser.add_argument("--examples", type=int, default=50, help="programs per seed, as verify --examples")
    parser.add_argument("--seeds", type=int, default=10, help="seeds 0 .. SEEDS-1, as verify --seed")
    parser.add_argument("--max-ops", type=int, default=16)
    args = parser.parse_args(argv)
    seen = frequencies(probe(args.factory), args.examples, args.seeds, args.max_ops)
    total = seen.pop("programs")
    print(f"{total} programs drawn for {args.factory} ({args.seeds} seeds x --examples {args.examples}, "
          f"--max-ops {args.max_ops}); share holding each:")
    for name, count in sorted(seen.items(), key=lambda item: (-item[1], item[0])):
        print(f"  {100 * count / total:5.1f}%  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
