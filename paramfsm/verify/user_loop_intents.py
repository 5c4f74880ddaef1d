"""The normaliser's user-loop intents: what training loops do besides driving the root module.

:class:`UserLoopIntents` is mixed into the normaliser of
:mod:`paramfsm.verify.programs`. Its intents draw a forward of one unit on
the saved inputs of an earlier forward (its graph kept alive, or detached),
optimizer steps and ``zero_grad`` of one part of the model (a GAN's G or D,
``Subject(parts=...)``), whole GAN iterations with the fake batch not
detached, in-place writes inside ``rt.gathered``, eval segments under
``torch.no_grad()`` and ``torch.inference_mode()``, a saved state
(``rt.full_state_dict()``, or a DCP checkpoint with the optimizer state)
restored later in the loop, a loss that reads another output on each
rank, with its backward (:meth:`UserLoopIntents.rank_loss`), and an
optimizer step whose closure runs the forward and backward
(:meth:`UserLoopIntents.closure_step`).

[Note: which graphs an op makes stale]
Plain torch refuses a backward through a graph whose saved parameters were
modified in place since (a step, a load, a write), so a drawn backward must
never reach one. Each output records, for every optimizer's part of the
model, the part's version when its graph saved those parameters: a root
forward saves every part; a unit run again saves its own parts, plus, unless
its inputs were detached, the parts its saved inputs were computed from, at
the source's versions (the probe finds them by walking the autograd graph,
:func:`learn`). A step of one part bumps that part's version only, so a GAN's
G step after D's leaves ``D(fake)``'s graph usable when D was stepped first
and ran again since. An output with a stale version gets no backward; its
forward and loss are still run and compared with plain torch, which is what
catches a unit computing with the weights it had before the step.

A unit run on saved inputs that were not detached shares the source's graph
(its upstream part), so a backward without ``retain_graph`` of either frees
both (:meth:`UserLoopIntents.free`).
"""

from __future__ import annotations

import copy

import torch

from paramfsm.verify import user_loops
from paramfsm.verify.ops import (
    AUTO_MODES, BATCHES, RANK_WRITE, TREE_VARIANTS, WRITE_MODE, Attach, ClosureStep, Evaluate, GatheredWrite, NoSync, PartStep, PartZeroGrad, RankLoss,
    Restore, Save, SubForward,
)

#: Intent kinds this mixin handles (see :meth:`UserLoopIntents.user_loop_op`).
USER_LOOP_KINDS = ("sub_forward", "part", "gan", "gathered_write", "evaluate", "save_restore", "sub_forward",
                   "gathered_write", "gathered_write",  # writes are drawn in fp32 programs only
                   "rank_loss", "closure_step", "closure_step",
                   "save_restore")  # a restore needs a save and a step before it: drawn twice
#: Intent kinds the canonical programs use that are not drawn: a write inside forward, a write inside
#: ``rt.gathered`` that differs by rank and a module attached after ``shard()`` each stop the program (the
#: accepted refusal), so drawn among the others they would cut most programs short.
CANONICAL_KINDS = ("write_in_forward", "rank_write", "attach")


def learn(subject, inputs, modules: tuple[str, ...]) -> dict:
    """The :class:`~paramfsm.verify.ops.Shape` fields of the user-loop ops, from one train forward of a copy.

    Raises ValueError when ``subject.parts`` do not split the parameters into disjoint modules.
    """
    model = copy.deepcopy(subject.model)
    names = {id(p): name for name, p in model.named_parameters()}
    part_of: dict[str, int] = {}
    for index, part in enumerate(subject.parts):
        for p in model.get_submodule(part).parameters():
            if names[id(p)] in part_of:
                raise ValueError(f"parameter {names[id(p)]!r} is in two of the parts {subject.parts}")
            part_of[names[id(p)]] = index
    if subject.parts and len(part_of) != len(names):
        missing = sorted(set(names.values()) - set(part_of))
        raise ValueError(f"parts {subject.parts} leave parameters out: {missing[:3]}")
    model.train()
    with user_loops.record_inputs(model) as saved:
        model(inputs)
    callees = []
    for name in modules:
        if name not in saved:
            continue
        module = model.get_submodule(name)
        with torch.no_grad():
            floating = bool(user_loops.tensors(user_loops.sub_forward(module, saved[name], True, False)))
        if not floating:
            continue
        own = sorted({part_of.get(names[id(p)], 0) for p in module.parameters()})
        feeds = sorted({part_of.get(n, 0) for n in user_loops.parameter_sources(saved[name], names)})
        callees.append((name, tuple(own), tuple(feeds), user_loops.view_backward_works(module, saved[name])))
    params = [name for name, _ in model.named_parameters()]
    return {"parts": tuple(subject.parts), "param_parts": tuple(part_of.get(n, 0) for n in params),
            "callees": tuple(callees)}


class UserLoopIntents:
    """Part versions, shared graphs and the user-loop intents (see the module docstring); needs the
    normaliser's ``shape``, ``config``, ``ops``, ``outputs``, ``forward``, ``loss``, ``backward``, ``zero_grad``,
    ``synced`` and ``apply``."""

    def start_user_loops(self) -> None:
        self.versions = [0] * self.shape.optimizers
        self.stepped: set[int] = set()  # parts whose optimizer has stepped (and so has state to save)
        self.saves: set[tuple[bool, bool]] = set()  # kinds of Save taken: (full, with the optimizer's own)

    def current(self, parts) -> dict:
        return {p: self.versions[p] for p in parts}

    def stale(self, out) -> bool:
        return any(self.versions[p] != v for p, v in out.saved.items())

    def modified(self, parts=None) -> None:
        """Parameters of these parts (all by default) were modified in place: graphs that saved them are stale."""
        for p in range(self.shape.optimizers) if parts is None else parts:
            self.versions[p] += 1

    def free(self, out) -> None:
        """A backward without ``retain_graph`` freed ``out``'s graph, and so every output sharing it."""
        for other in self.outputs:
            if other.graph == out.graph:
                other.freed = True

    def stepped_parts(self, parts) -> None:
        self.stepped.update(parts)
        self.modified(parts)

    def sub_forward(self, a: int, b: int, detach: bool, view: bool | None = None, source=None, callees=None):
        """A unit (``a``-th of ``callees``, the shape's by default) run on the saved inputs of a train forward
        (``source``, else the ``b``-th alive one; one is run when none is), with a loss; ``view``: ``b >= 4``.

        A subject with no unit below the root runs a root forward instead.
        """
        callees = callees or self.shape.callees
        if not callees:
            out = self.forward(b % BATCHES, "train")
            self.loss(out, a)
            return out
        sources = [o for o in self.outputs if o.train]
        source = source or (sources[b % len(sources)] if sources else self.forward(b % BATCHES, "train"))
        name, own, feeds, view_ok = callees[a % len(callees)]
        view = (b >= 4 if view is None else view) and view_ok
        out = self.new_output(source.batch)
        out.sub = True
        out.saved = self.current(own)
        if not detach:
            out.saved.update({p: source.saved[p] for p in feeds})
            out.graph, out.freed = source.graph, source.freed
        self.ops.append(SubForward(out.id, name, source.id, detach, view))
        self.loss(out, a)
        return out

    def step_part(self, part: int) -> None:
        """``opts[part].step()``; a step of every optimizer without parts or under a loss scaler."""
        if self.shape.optimizers == 1 or self.config.scaled:
            self.apply("step", 0, 0, False)
            return
        self.synced()
        self.ops.append(PartStep(part))
        self.stepped_parts([part])

    def zero_part(self, part: int) -> None:
        if self.shape.optimizers == 1 or self.config.scaled:
            self.zero_grad()
            self.has_grads = False
            return
        self.synced()
        self.ops.append(PartZeroGrad(part))

    def gan(self, a: int, b: int, via_runtime: bool) -> None:
        """A GAN iteration in one sharded root, the fake batch not detached: ``fake = G(z)``,
        D's loss on ``D(fake)`` with ``retain_graph=True`` (D is left deferred), D's step, then G's loss on
        ``D(fake)`` run again (D's new weights) back through G, and G's step (the last part's optimizer
        is D's, the first G's; a step of everything without parts)."""
        real = self.forward(b % BATCHES, "train")
        d, g = self.shape.optimizers - 1, 0
        critics = [c for c in self.shape.callees if d in c[1] and g in c[2]] or None
        self.zero_part(d)
        fake = self.sub_forward(a, b, False, False, real, critics)
        self.backward(fake, fake.losses[-1], True, via_runtime)
        self.step_part(d)
        self.zero_part(g)
        again = self.sub_forward(a, b, False, False, real, critics)
        if not again.freed and not self.stale(again):
            self.backward(again, again.losses[-1], False, via_runtime)
            self.step_part(g)
        for out in (again, fake, real):
            if out in self.outputs:
                self.drop(out)

    def user_loop_op(self, kind: str, a: int, b: int, flag: bool) -> None:
        parts = self.shape.optimizers
        if kind == "sub_forward":
            self.sub_forward(a, b, flag)
        elif kind == "part":
            (self.zero_part if flag else self.step_part)(a % parts)
        elif kind == "gan":
            self.gan(a, b, flag)
        elif kind == "gathered_write" and self.config.param_dtype is None and self.shape.params:
            self.gathered_write(a, b, flag)
        elif kind == "evaluate":
            self.ops.append(Evaluate(tuple((b + i) % BATCHES for i in range(1 + a % 2)), flag))
        elif kind == "write_in_forward" and self.config.param_dtype is None \
                and self.config.reshard_after_forward is True:  # refused at the release after the forward
            self.forward(b % BATCHES, WRITE_MODE)
        elif kind == "rank_write" and self.config.param_dtype is None and self.shape.params:
            self.gathered_write(a, b, RANK_WRITE)
        elif kind == "attach":
            modules = ("",) + tuple(self.shape.modules)
            self.ops.append(Attach(modules[a % len(modules)], b % BATCHES))
        elif kind == "save_restore":
            self.save_restore(bool(a % 2), flag, a, b)
        elif kind == "rank_loss":
            self.rank_loss(a, b, flag)
        elif kind == "closure_step":
            self.closure_step(a, b, flag)

    def closure_step(self, a: int, b: int, via_runtime: bool) -> None:
        """A :class:`ClosureStep`, drawn with one optimizer, no loss scaling, no offload (an offloaded step
        runs unit by unit and refuses a closure) and gradient sync on.

        ``a`` odd: ``1 + b % 2`` micro-batches under ``rt.no_sync()`` first, and the closure's backward is
        the last micro-batch, which synchronises them (the closure keeps their gradients); ``a`` even: the
        closure zeroes the gradients first. The forwards run in ``AUTO_MODES[(a // 2) % 3]``.
        """
        # A closure is refused under offload and by a whole-parameter optimizer (paramfsm.optim.whole_params).
        refused = self.config.offload is not None or self.shape.offload or self.config.optimizer != "subject"
        if self.shape.optimizers != 1 or self.config.scaled or refused or not self.sync_on or self.window:
            return
        mode = AUTO_MODES[(a // 2) % len(AUTO_MODES)]
        accumulate = a % 2 == 1
        if accumulate:
            self.zero_grad()
            self.ops.append(NoSync(True))
            self.window = True
            for micro in range(1 + b % 2):
                out = self.forward((b + micro) % BATCHES, mode)
                self.backward(out, self.loss(out, a), False, via_runtime)
                self.drop(out)
            self.ops.append(NoSync(False))
            self.window = False
        mark = len(self.ops)
        if not accumulate:
            self.zero_grad()
        out = self.forward((b + 2) % BATCHES, mode)
        loss = self.loss(out, a)
        self.backward(out, loss, False, via_runtime)
        inner = tuple(self.ops[mark:])
        del self.ops[mark:]
        self.ops.append(ClosureStep(inner, loss))
        self.drop(out)
        self.unscaled = False
        self.stepped_parts(range(self.shape.optimizers))

    def rank_loss(self, a: int, b: int, detach: bool) -> None:
        """A :class:`RankLoss` over two usable outputs (the ``a``-th and another), then its backward without
        ``retain_graph`` (through ``rt.backward`` when ``b`` is odd).

        With fewer than two usable outputs, they are made: when ``a % 4`` is 0, root train forwards of other
        batches (the ranks' backward passes reach the same units); otherwise units are run again (the ``a``-th
        callee and the next, on the ``detach``-ed saved inputs of the last usable train forward, or not), and
        root forwards make up for a subject with no unit below the root or outputs born with a freed graph. The loss belongs to the second output (dropped with it); the backward frees the graphs of
        both, as the ranks' backward passes differ and each rank's frees its own output's graph.
        """
        if not self.syncing():
            # With gradient sync off, a rank whose backward reaches fewer units issues no collective at all, so
            # no rank can tell the desync before the next collective, which here is verify's own agreement
            # (not paramfsm's): the ranks hang until the collective timeout. Not drawn until paramfsm can
            # raise RankDesync there (see issue #52's closing note).
            return
        for made in range(2):
            if len(self.usable()) < 2 and a % 4:
                kept = [o for o in self.usable() if o.train]
                self.sub_forward(a + made, b + made, detach, False, kept[-1] if kept else None)
        while len(self.usable()) < 2:
            self.forward((b + len(self.usable())) % BATCHES, "train")
        outs = self.usable()
        first = outs[a % len(outs)]
        second = [o for o in outs if o is not first][b % (len(outs) - 1)]
        loss = self.next_loss
        self.next_loss += 1
        second.losses.append(loss)
        self.ops.append(RankLoss(loss, (first.id, second.id), self.tree_variant(b)))
        self.backward(first, loss, False, bool(b % 2))
        self.free(second)

    def save_restore(self, full: bool, restore: bool, a: int, b: int) -> None:
        """A :class:`Save` (``restore`` False), or a :class:`Restore` of the last one; with none yet, a save, an
        iteration, then the restore. A DCP save (with optimizer state) waits until every optimizer has stepped.
        """
        if not full and len(self.stepped) < self.shape.optimizers:
            return
        optimizer = full and bool(b % 2)  # torch's own optimizer state dict, kept and loaded back
        if not restore or (full, optimizer) not in self.saves:
            self.ops.append(Save(full, optimizer))
            self.saves.add((full, optimizer))
            if not restore:
                return
            self.apply("iteration", a, b, False)
        self.ops.append(Restore(full, plain=not full and bool(b % 2), optimizer=optimizer))
        self.modified()

    def gathered_write(self, a: int, b: int, variant: int) -> None:
        """A write to one parameter inside ``rt.gathered`` of a unit module holding it (every unit when none);
        ``variant``: see :class:`~paramfsm.verify.ops.GatheredWrite`."""
        names = [name for name, _ in self.shape.params]
        modules = [m for m in self.shape.modules if any(n.startswith(m + ".") for n in names)]
        module = ([None] + modules)[a % (len(modules) + 1)]
        inside = [i for i, n in enumerate(names) if module is None or n.startswith(module + ".")]
        index = inside[b % len(inside)]
        self.ops.append(GatheredWrite(module, names[index], int(variant)))
        self.modified([self.shape.param_parts[index]] if self.shape.param_parts else None)

    @staticmethod
    def tree_variant(variant: int) -> int:
        """The loss variant of a unit's output (any container)."""
        return TREE_VARIANTS[variant % len(TREE_VARIANTS)]

