"""Training-loop programs: small op records and a hypothesis strategy that draws valid ones.

A :class:`Program` is a :class:`Config` (how the model is sharded) and a tuple
of ops. Ops are frozen, slotted records, so a program pickles in a few hundred
bytes: the test process draws it once and sends the same program to every
rank and to the plain-torch reference (:mod:`paramfsm.testing.runner`).

[Note: intents, then a normaliser]
The strategy does not draw ops directly. It draws a list of *intents*
(``(kind, a, b, flag)`` tuples of small integers) and :func:`normalise` turns
them into ops while tracking which autograd graphs are alive, retained, freed
by a backward, or stale after an optimizer step. An intent that cannot apply
is completed (a backward with no loss first runs a forward and takes a loss)
or skipped. So every drawn program is valid plain PyTorch (no backward through
a freed graph, none through parameters an optimizer step modified in place),
and hypothesis shrinks a failure by deleting intents and lowering integers
with no risk of producing an invalid program. The program ends by dropping
every live output, so retained-graph cleanup is always exercised.

:func:`paramfsm.testing.reproduction.render` prints a program as a runnable
script that calls only the public API.
"""

from __future__ import annotations

from typing import Sequence

import attrs
from hypothesis import strategies as st

MODES = ("train", "no_grad", "eval", "checkpoint", "eval_no_grad")
AUTO_MODES = ("train", "checkpoint", "eval")  # forwards the normaliser adds before a loss
GRAD_MODES = frozenset({"train", "eval", "checkpoint"})
LOSS_VARIANTS = 3  # 0: the subject's loss_fn, 1: mean square of the output, 2: mean tanh of the output
PENALTY_WEIGHT = 0.1
BATCHES = 4


@attrs.frozen(slots=True)
class Config:
    """How the program shards the model (the arguments of ``paramfsm.shard``)."""

    retain: str = "defer"
    prefetch: int = 1
    bucket_bytes: int = 1 << 20
    max_deferred_bytes: int | None = None


@attrs.frozen(slots=True)
class Forward:
    """``out = model(x)`` in a mode: train, no_grad, eval, checkpoint (whole model) or eval_no_grad.

    ``out`` is -1 in the no_grad modes, whose output nothing keeps.
    """

    out: int
    batch: int
    mode: str


@attrs.frozen(slots=True)
class Loss:
    """A scalar loss from an output (several losses may share one output and its graph)."""

    loss: int
    out: int
    batch: int
    variant: int


@attrs.frozen(slots=True)
class Backward:
    """``loss.backward(retain_graph=...)`` or ``rt.backward(loss, retain_graph=...)``."""

    loss: int
    retain: bool
    via_runtime: bool


@attrs.frozen(slots=True)
class Penalty:
    """A gradient penalty: ``autograd.grad(create_graph=True)``, then ``(loss + w * penalty).backward()``."""

    loss: int
    retain: bool


@attrs.frozen(slots=True)
class Drop:
    """``del`` an output and its losses: the graph is freed without a final backward."""

    out: int
    losses: tuple[int, ...]


@attrs.frozen(slots=True)
class ZeroGrad:
    """``opt.zero_grad()``."""


@attrs.frozen(slots=True)
class Step:
    """``opt.step()``."""


@attrs.frozen(slots=True)
class Flush:
    """``rt.flush()``."""


@attrs.frozen(slots=True)
class Gathered:
    """``with rt.gathered(module):`` (every unit when ``module`` is None), optionally with a no_grad forward inside."""

    module: str | None
    batch: int | None


Op = Forward | Loss | Backward | Penalty | Drop | ZeroGrad | Step | Flush | Gathered


@attrs.frozen(slots=True)
class Program:
    """A sharding configuration and the ops to run, in order, on every rank and on the reference."""

    config: Config
    ops: tuple


@attrs.frozen(slots=True)
class Shape:
    """What the generator must know about the subject: its unit modules and what its output allows."""

    modules: tuple[str, ...] = ()
    checkpoint: bool = True
    tensor_output: bool = True
    allow_create_graph: bool = True


# ------------------------------------------------------------------ normaliser

@attrs.define(slots=True)
class _Output:
    """An output the program holds, with its losses and whether its graph can still run a backward."""

    id: int
    batch: int
    losses: list = attrs.Factory(list)
    freed: bool = False  # a backward without retain_graph freed its graph
    stale: bool = False  # an optimizer step modified parameters its graph saved


KINDS = ("backward", "forward", "loss", "zero_grad", "step", "iteration", "drop", "flush",
         "gathered", "penalty", "multi_loss", "accumulate", "backward", "forward", "multi_loss")


class _Normaliser:
    """Turns intents into ops, tracking the outputs (graphs) a valid program may still use."""

    def __init__(self, shape: Shape):
        self.shape = shape
        self.ops: list = []
        self.outputs: list[_Output] = []
        self.next_out = 0
        self.next_loss = 0

    def usable(self) -> list[_Output]:
        return [o for o in self.outputs if not o.freed and not o.stale]

    def forward(self, batch: int, mode: str) -> _Output | None:
        if mode == "checkpoint" and not self.shape.checkpoint:
            mode = "train"
        if mode not in GRAD_MODES:
            self.ops.append(Forward(-1, batch, mode))
            return None
        out = _Output(self.next_out, batch)
        self.next_out += 1
        self.outputs.append(out)
        self.ops.append(Forward(out.id, batch, mode))
        return out

    def loss(self, out: _Output, variant: int) -> int:
        if not self.shape.tensor_output:
            variant = 0
        loss = self.next_loss
        self.next_loss += 1
        out.losses.append(loss)
        self.ops.append(Loss(loss, out.id, out.batch, variant % LOSS_VARIANTS))
        return loss

    def some_loss(self, a: int, b: int) -> tuple[_Output, int]:
        """A loss on a usable output, taking one (and running a forward) when there is none."""
        usable = [o for o in self.usable() if o.losses]
        if usable:
            out = usable[a % len(usable)]
            return out, out.losses[b % len(out.losses)]
        outs = self.usable()
        out = outs[a % len(outs)] if outs else self.forward(b % BATCHES, AUTO_MODES[a % len(AUTO_MODES)])
        return out, self.loss(out, b)

    def backward(self, out: _Output, loss: int, retain: bool, via_runtime: bool) -> None:
        self.ops.append(Backward(loss, retain, via_runtime))
        if not retain:
            out.freed = True

    def apply(self, kind: str, a: int, b: int, flag: bool) -> None:
        if kind == "forward":
            self.forward(b % BATCHES, MODES[a % len(MODES)])
        elif kind == "loss":
            outs = self.usable()
            out = outs[a % len(outs)] if outs else self.forward(b % BATCHES, "train")
            self.loss(out, b)
        elif kind == "penalty" and self.shape.allow_create_graph:
            out, loss = self.some_loss(a, b)
            self.ops.append(Penalty(loss, flag))
            if not flag:
                out.freed = True
        elif kind in ("backward", "penalty"):
            out, loss = self.some_loss(a, b)
            self.backward(out, loss, flag, bool(b % 2))
        elif kind in ("iteration", "accumulate"):
            self.ops.append(ZeroGrad())
            for micro in range(1 + (b % 3 if kind == "accumulate" else 0)):
                out = self.forward((b + micro) % BATCHES, AUTO_MODES[a % len(AUTO_MODES)])
                self.backward(out, self.loss(out, a), False, flag)
                self.drop(out)
            self.apply("step", a, b, flag)
        elif kind == "multi_loss":
            self.multi_loss(a, b, flag)
        elif kind == "drop" and self.outputs:
            self.drop(self.outputs[a % len(self.outputs)])
        elif kind == "zero_grad":
            self.ops.append(ZeroGrad())
        elif kind == "step":
            self.ops.append(Step())
            for out in self.outputs:
                out.stale = True
        elif kind == "flush":
            self.ops.append(Flush())
        elif kind == "gathered":
            names = (None,) + self.shape.modules
            self.ops.append(Gathered(names[a % len(names)], b % BATCHES if flag else None))

    def multi_loss(self, a: int, b: int, via_runtime: bool) -> None:
        """One forward, two or three losses, a backward each (all but the last retaining the graph).

        ``b % 4``: 2 retains the last backward too and then drops the graph;
        3 calls ``rt.flush()`` between the backward passes.
        """
        out = self.forward(b % BATCHES, AUTO_MODES[a % len(AUTO_MODES)])
        variant = b % 4
        losses = [self.loss(out, a + i) for i in range(2 + (b // 4) % 2)]
        for i, loss in enumerate(losses):
            last = i == len(losses) - 1
            self.ops.append(ZeroGrad())
            self.backward(out, loss, not last or variant == 2, via_runtime)
            if variant == 3 and not last:
                self.ops.append(Flush())
        if variant == 2:
            self.drop(out)

    def drop(self, out: _Output) -> None:
        self.outputs.remove(out)
        self.ops.append(Drop(out.id, tuple(out.losses)))


def normalise(intents: Sequence[tuple], shape: Shape, config: Config = Config()) -> Program:
    """Turn drawn intents into a valid program (see [Note: intents, then a normaliser])."""
    norm = _Normaliser(shape)
    for kind, a, b, flag in intents:
        norm.apply(kind, a, b, flag)
    for out in list(norm.outputs):
        norm.drop(out)
    return Program(config, tuple(norm.ops))


#: Training-loop patterns behind the bugs of :mod:`paramfsm.testing.faults`, as intents (kind, a, b, flag)
#: with a configuration. They run before the random programs (see :func:`canonical`).
CANONICAL: tuple[tuple[Config, tuple], ...] = (
    (Config(), (("multi_loss", 0, 0, False),)),  # forward, two losses, zero_grad/backward(retain)/backward
    (Config(), (("multi_loss", 1, 4, True),)),  # the same through rt.backward, checkpointed, three losses
    (Config(), (("multi_loss", 0, 2, False),)),  # both backward passes retain; the graph is dropped
    (Config(), (("multi_loss", 2, 3, False),)),  # eval mode, rt.flush() between the backward passes
    (Config(retain="regather"), (("multi_loss", 0, 0, True), ("iteration", 1, 0, False))),
    (Config(max_deferred_bytes=4096), (("multi_loss", 0, 4, False),)),
    (Config(), (("iteration", 0, 0, False), ("forward", 4, 1, False), ("forward", 1, 2, False),
                ("backward", 0, 3, True), ("step", 0, 0, False), ("gathered", 0, 1, True))),
    (Config(bucket_bytes=1, prefetch=2), (("accumulate", 0, 2, False), ("forward", 2, 0, False),
                                          ("iteration", 1, 1, True), ("penalty", 0, 0, False))),
)


def canonical(shape: Shape) -> list[Program]:
    """The :data:`CANONICAL` patterns as programs for a model of this shape."""
    return [normalise(intents, shape, config) for config, intents in CANONICAL]


def configs() -> st.SearchStrategy[Config]:
    """Sharding configurations, weighted towards the defaults of ``paramfsm.shard`` (and shrinking to them)."""
    return st.builds(
        Config,
        retain=st.sampled_from(("defer", "regather", "defer")),
        prefetch=st.sampled_from((1, 0, 2)),
        bucket_bytes=st.sampled_from((1 << 20, 1)),
        max_deferred_bytes=st.sampled_from((None, 4096, None)),
    )


def intents(max_ops: int) -> st.SearchStrategy[list]:
    intent = st.tuples(st.sampled_from(KINDS), st.integers(0, 7), st.integers(0, 7), st.booleans())
    return st.lists(intent, min_size=1, max_size=max_ops)


def programs(shape: Shape, max_ops: int = 16, config: Config | None = None) -> st.SearchStrategy[Program]:
    """Valid training-loop programs for a model of this shape (``config`` fixes the sharding)."""
    cfg = st.just(config) if config is not None else configs()
    return st.builds(lambda c, i: normalise(i, shape, c), cfg, intents(max_ops))
