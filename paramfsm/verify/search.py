"""Property-based verification of training loops: ``paramfsm.verify.verify_model`` and its engine.

Hypothesis draws training-loop programs (:mod:`paramfsm.verify.programs`)
in this process; each program runs, identical, on every rank of a
:class:`~paramfsm.verify.launch.RankPool` beside a plain-torch reference
(:mod:`paramfsm.verify.runner`), with checks after every op. A failing
program is shrunk (hypothesis deletes and simplifies ops, within a time
budget) and reported as a runnable reproduction that calls only the public
API.

Add one test to your CI::

    from paramfsm.verify import verify_model

    def test_paramfsm_lifetimes():
        verify_model("mypkg.models:make_subject", world_size=2, examples=20)

``examples`` can be raised without editing the test through the
``PARAMFSM_VERIFY_EXAMPLES`` environment variable. See
:mod:`paramfsm.verify.subject` for what the factory returns.

A program plain torch cannot run the same way on the model (a gradient
penalty through an op without double backward, say) is rejected as invalid
for this model, not reported: the reference runs every op first (see
:mod:`paramfsm.verify.checker`), and ``Report.rejected`` counts the
rejections by reason.
"""

from __future__ import annotations

import copy
import logging
import os
import time
from collections import Counter
from typing import Callable, Sequence

import attrs
from hypothesis import HealthCheck, Phase, Verbosity, example, given, reject, settings
from hypothesis import seed as hypothesis_seed
from hypothesis.errors import Unsatisfiable

from paramfsm.engine.storage.units import select_unit_modules
from paramfsm.engine.storage.unsupported import refuse_unsupported
from paramfsm.verify.launch import RankFailure, RankPool
from paramfsm.verify.faults import FAULTS
from paramfsm.verify.mirror import blocks_of
from paramfsm.verify.programs import Config, Program, Shape, canonical, programs
from paramfsm.verify.reproduction import render
from paramfsm.verify.runner import Options, Outcome, run_program
from paramfsm.verify.subject import (
    FactoryError, Subject, describe, first_tensor, global_batch, import_root, load_subject, split, user_frame,
)
from paramfsm.verify.user_loop_intents import learn

__all__ = ["verify", "verify_model", "VerificationFailed", "Report", "Finding", "Progress", "Subject",
           "FactoryError", "load_subject", "examples_from_env"]

log = logging.getLogger(__name__)

EXAMPLES_ENV = "PARAMFSM_VERIFY_EXAMPLES"


def examples_from_env(default: int) -> int:
    """``PARAMFSM_VERIFY_EXAMPLES`` when set (a larger budget for nightly runs), else ``default``."""
    value = os.environ.get(EXAMPLES_ENV, "").strip()
    if not value:
        return default
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{EXAMPLES_ENV}={value!r}: expected a positive integer")
    return int(value)


@attrs.frozen(slots=True)
class Finding:
    """A failing program: where it failed, why, and a script that reproduces it."""

    program: Program
    op: int | None
    kind: str
    message: str
    detail: str
    reproduction: str


@attrs.frozen(slots=True)
class Report:
    """What a verification run did: programs run, time, the (shrunk) failure if any, and the rejections.

    ``examples`` counts every program run, rejected ones included; ``rejected``
    maps a reason (the op plain torch could not run, and its error) to how many
    programs it rejected.
    """

    examples: int
    seconds: float
    failure: Finding | None = None
    examples_to_failure: int | None = None
    seconds_to_failure: float | None = None
    rejected: dict = attrs.field(factory=dict)

    @property
    def accepted(self) -> int:
        """Programs that plain torch could run (and so were checked)."""
        return self.examples - sum(self.rejected.values())


@attrs.frozen(slots=True)
class Progress:
    """Where a run is, for a progress line: programs done (and rejected) of those planned, seconds so far.

    ``shrinking`` is set once a failure was found; ``smallest`` is then the op count of the smallest failure.
    """

    done: int
    planned: int
    rejected: int
    seconds: float
    shrinking: bool = False
    smallest: int | None = None


class VerificationFailed(AssertionError):
    """A program broke a check; the message holds the failure and a runnable reproduction."""

    def __init__(self, finding: Finding):
        self.finding = finding
        where = f"op {finding.op}" if finding.op is not None else "setup or teardown"
        super().__init__(f"paramfsm verify: {finding.kind} check failed at {where}: {finding.message}\n\n"
                         f"Reproduction (torchrun --nproc-per-node WORLD repro.py):\n\n{finding.reproduction}")


class _Falsified(Exception):
    """Raised inside the hypothesis test to mark an example as failing."""


class _StopShrinking(BaseException):
    """Ends the search when the shrink budget is spent (hypothesis does not catch BaseException)."""


def probe(factory, seed: int = 0, per_rank: int = 2) -> Shape:
    """What the generator needs to know about the subject, learnt by building it once here.

    Raises :class:`~paramfsm.verify.subject.FactoryError` when the factory, its
    batches or its model's forward fail, or its units are not the model's.
    """
    import torch

    subject = load_subject(factory, seed)

    def attempt(what: str, fn):
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - the user's code: summarised in one line
            raise FactoryError(factory, f"{what}: {describe(exc)}", user_frame(exc)) from exc

    attempt("units", lambda: select_unit_modules(subject.model, subject.units, subject.min_unit_bytes))
    # The modules ops may name (a sub-forward, a kept unit): every unit one per module would make, since some
    # of the drawn unit choices merge them (a merged module called on its own must still work).
    chosen = select_unit_modules(subject.model, subject.units, 0)
    modules = tuple(name for name in chosen if name)
    attempt("the model cannot run under paramfsm", lambda: refuse_unsupported(subject.model))
    attempt("the plain-torch reference needs copy.deepcopy(model)", lambda: copy.deepcopy(subject.model))
    inputs, _ = attempt("make_batch", lambda: global_batch(subject, 0, seed, 1, per_rank))
    with torch.no_grad():
        output = attempt("the model's forward", lambda: subject.model(split(inputs, 1)[0]))
    try:
        tensor_output = isinstance(output, torch.Tensor) and first_tensor(output).is_floating_point()
    except TypeError:
        tensor_output = False
    params = tuple((name, p.numel()) for name, p in subject.model.named_parameters())
    blocks = attempt("blocks", lambda: blocks_of(subject))
    for name in blocks:
        attempt(f"block {name!r}", lambda: subject.model.get_submodule(name))
    loops = attempt("the user-loop ops", lambda: learn(subject, split(inputs, 1)[0], modules))
    return Shape(modules, subject.checkpoint, tensor_output, subject.create_graph, params, blocks, subject.meta,
                 offload=subject.offload is not None, own_units=subject.units is not None, **loops)


class _Search:
    """Runs programs on the pool and keeps the smallest failure of the first failure's kind."""

    def __init__(self, pool: RankPool, factory, options: Options, shrink_budget_s: float, planned: int,
                 progress: Callable[[Progress], None] | None):
        self.pool, self.factory, self.options = pool, factory, options
        self.shrink_budget_s = shrink_budget_s
        self.planned, self.progress = planned, progress
        self.runs = 0
        self.rejected: Counter = Counter()
        self.start = time.perf_counter()
        self.first: tuple[int, float] | None = None
        self.best: tuple[Program, Outcome] | None = None

    def run(self, program: Program) -> None:
        try:
            self._run(program)
        finally:
            if self.progress is not None:
                self.progress(Progress(self.runs - sum(self.rejected.values()), self.planned,
                                       sum(self.rejected.values()), time.perf_counter() - self.start,
                                       self.first is not None, len(self.best[0].ops) if self.best else None))

    def _run(self, program: Program) -> None:
        if self.first is not None and time.perf_counter() - self.start - self.first[1] > self.shrink_budget_s:
            raise _StopShrinking()
        self.runs += 1
        began = time.perf_counter()
        try:
            outcomes = self.pool.run(run_program, self.factory, program, self.options,
                                     timeout=self.options.timeout_s * 2 + 30)
        except RankFailure as exc:
            outcomes = [Outcome(True, None, "crash", f"rank {exc.rank} died or hung", exc.detail)]
        outcome = _merge(outcomes)
        status = f"FAILED ({outcome.kind})" if outcome.failed else "rejected" if outcome.kind == "invalid" else "ok"
        log.info("example %d: %d ops, %s, %.2fs", self.runs, len(program.ops), status, time.perf_counter() - began)
        if outcome.kind == "invalid":
            op = program.ops[outcome.op] if outcome.op is not None else None
            self.rejected[f"{type(op).__name__} op: {outcome.message}" if op else outcome.message] += 1
            reject()
        if not outcome.failed:
            return
        if self.first is None:
            self.first = (self.runs, time.perf_counter() - self.start)
        if self.best is None or (outcome.kind == self.best[1].kind and _smaller(program, self.best[0])):
            self.best = (program, outcome)
        raise _Falsified(outcome.message)


def _merge(outcomes) -> Outcome:
    """One outcome for all ranks: the failure of the lowest-numbered rank that saw a problem itself."""
    failed = [o for o in outcomes if o.failed]
    if not failed:
        invalid = [o for o in outcomes if o.kind == "invalid"]
        return min(invalid, key=lambda o: o.message.startswith("another rank")) if invalid else outcomes[0]
    own = [o for o in failed if o.kind != "peer"] or failed
    return min(own, key=lambda o: (o.op if o.op is not None else 1 << 30))


def _smaller(a: Program, b: Program) -> bool:
    return (len(a.ops), repr(a)) < (len(b.ops), repr(b))


def verify(factory, *, world_size: int = 2, examples: int = 20, seed: int = 0, pool: RankPool | None = None,
           fault: str | None = None, shrink: bool = True, shrink_budget_s: float = 120.0, max_ops: int = 16,
           per_rank: int = 2, config: Config | None = None, timeout_s: float = 60.0,
           canonical_first: bool = True, progress: Callable[[Progress], None] | None = None,
           canonical_only: Sequence[int] | None = None) -> Report:
    """Run the canonical programs, then up to ``examples`` drawn ones; return a :class:`Report`.

    ``report.failure`` is set on failure. The canonical programs
    (:data:`paramfsm.verify.programs.CANONICAL`) are the training-loop
    patterns behind the catalogued bugs; they run first, unshrunk, unless
    ``canonical_first`` is false or ``config`` fixes the configuration.
    ``canonical_only``: run these canonical programs alone (their indices in
    ``CANONICAL``, in this order) and nothing drawn (the fault catalogue's test
    runs the pattern behind each bug: see [Note: a fault's pattern] in
    :mod:`paramfsm.testing.mutants`).

    ``factory``: a callable or ``"module:attribute"`` (it must be importable on
    the ranks). ``pool``: reuse a pool of ``world_size`` ranks (one is started
    and closed otherwise). ``fault``: inject a catalogued bug
    (:mod:`paramfsm.verify.faults`) on the ranks. ``config``: fix the sharding
    configuration instead of drawing it. ``progress``: called with a
    :class:`Progress` after every program.

    Raises ValueError for a bad argument and
    :class:`~paramfsm.verify.subject.FactoryError` when the factory or its
    model cannot be used, before any rank starts.
    """
    _check_arguments(world_size=world_size, examples=examples, max_ops=max_ops, per_rank=per_rank, fault=fault)
    if pool is not None and pool.world != world_size:
        raise ValueError(f"the pool has {pool.world} ranks, not world_size={world_size}")
    shape = probe(factory, seed, per_rank)
    options = Options(seed=seed, per_rank=per_rank, fault=fault, timeout_s=timeout_s)
    every = canonical(shape) if canonical_only is not None or (config is None and canonical_first) else []
    explicit, drawn = (every if config is None and canonical_first else []), examples
    phases = (Phase.explicit, Phase.generate, Phase.shrink) if shrink else (Phase.explicit, Phase.generate)
    if canonical_only is not None:
        if not canonical_only or not all(isinstance(i, int) and 0 <= i < len(every) for i in canonical_only):
            raise ValueError(f"canonical_only={canonical_only!r}: name one or more canonical programs by their "
                             f"index, 0 to {len(every) - 1}")
        explicit, phases, drawn = [every[i] for i in canonical_only], (Phase.explicit,), 0
    own_pool = pool is None
    pool = pool or RankPool(world_size, timeout=timeout_s * 2 + 30)
    search = _Search(pool, factory, options, shrink_budget_s, drawn + len(explicit), progress)

    @settings(max_examples=max(drawn, 1), deadline=None, database=None, phases=phases, derandomize=False,
              suppress_health_check=list(HealthCheck), report_multiple_bugs=False, verbosity=Verbosity.quiet,
              print_blob=False)
    @hypothesis_seed(seed)
    @given(programs(shape, max_ops, config))
    def check(program):
        search.run(program)

    for program in reversed(explicit):
        check = example(program)(check)
    try:
        check()
    except (_Falsified, _StopShrinking, Unsatisfiable):  # Unsatisfiable: plain torch could run no drawn program
        pass
    finally:
        if own_pool:
            pool.close()
    seconds = time.perf_counter() - search.start
    rejected = dict(search.rejected.most_common())
    if search.best is None:
        return Report(search.runs, seconds, rejected=rejected)
    program, outcome = search.best
    message = outcome.message + (f"\n{outcome.detail}" if outcome.detail else "")
    script = render(program, _factory_name(factory), per_rank=per_rank, seed=seed, fail_at=outcome.op,
                    message=f"{outcome.kind} check failed: {outcome.message}", fault=fault,
                    path=import_root(factory), world=world_size, meta=shape.meta, parts=shape.parts,
                    offload=shape.offload)
    finding = Finding(program, outcome.op, outcome.kind, outcome.message, message, script)
    return Report(search.runs, seconds, finding, search.first[0], search.first[1], rejected)


def _check_arguments(*, world_size: int, examples: int, max_ops: int, per_rank: int, fault: str | None) -> None:
    for name, value in (("world_size", world_size), ("examples", examples), ("max_ops", max_ops),
                        ("per_rank", per_rank)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: need a positive integer")
    if fault is not None and fault not in FAULTS:
        raise ValueError(f"unknown fault {fault!r}; known: {', '.join(FAULTS)}")


def verify_model(factory, *, world_size: int = 2, examples: int = 20, seed: int = 0, pool: RankPool | None = None,
                 **kwargs) -> Report:
    """Verify a model's training loops; raise :class:`VerificationFailed` (with a reproduction) on failure.

    ``examples`` is overridden by ``PARAMFSM_VERIFY_EXAMPLES`` when set. Other
    keyword arguments go to :func:`verify`.
    """
    report = verify(factory, world_size=world_size, examples=examples_from_env(examples), seed=seed,
                    pool=pool, **kwargs)
    if report.failure is not None:
        raise VerificationFailed(report.failure)
    return report


def _factory_name(factory) -> str:
    if isinstance(factory, str):
        return factory
    return f"{factory.__module__}:{factory.__qualname__}"
