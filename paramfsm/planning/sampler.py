"""What a runtime holds after each transition, by kind, and each phase's largest total: what a plan keeps.

:class:`Sampler` stands where a runtime's trace sits (``rt.ctx.trace``): every transition the
FSMs take calls it, and it counts the bytes held right then. The rehearsal of a plan
(:mod:`paramfsm.planning.rehearsal`) and the measurement of a live run (:mod:`paramfsm.planning.measure`)
use the same sampler, so a plan and a measurement count alike.

[Note: a sample counts the states by their transitions]
Adding up every record's bytes at every transition would make a plan of a 70B model take minutes (a step is
thousands of transitions over hundreds of records). So a sample reads only what changes, and little of it:

* full parameters (AVAILABLE, INFLIGHT, DEFERRED_RELEASE) are running totals, moved by each transition of
  the parameter machine from the kind of its source state to that of its destination;
* offloaded values (shards, shard gradients, optimizer state with ``offload=``) are the placements of the
  residency machine's resident set (in use, kept, or paged in ahead), a unit or two at a time;
* shards that are not offloaded are fixed; their gradients are added up again only when a reduce-scatter
  was issued or completed since (the only moments they appear) or ``zero_grad`` dropped them (the first
  one is another tensor, or none), and the optimizer's state of the values
  it does not offload only when it holds state for more parameters than before (its first step);
* what the tiers hold is added up again only when a tier placed a new slot.

At world 1, where full parameters are views of the shards, every sample counts as ``rt.memory()`` does.
Under offload the sampler counts an offloaded value from the moment its page-in starts (its buffer exists)
where ``rt.memory()`` counts it from the moment the read lands.
"""

from __future__ import annotations

import itertools

import torch

from paramfsm.sharding import memory as runtime_memory
from paramfsm.core.fsm import TAGS
from paramfsm.engine.storage import paged

#: What a plan counts in working memory, per rank, in the order it reports them (a phase's total is their sum).
KINDS = ("shards", "shard_grads", "optimizer_state", "gathered", "inflight", "deferred", "unsynced_grads",
         "reduce_buffers", "checkpoint_staging")
#: What offload tiers hold apart from working memory (host memory, disk): reported, not in a total. Under
#: offload ``shards``, ``shard_grads`` and ``optimizer_state`` count only the values resident in working memory.
TIER_KINDS = ("tier_cpu", "tier_disk")
#: The phases of a step, in order.
PHASES = ("init", "forward", "backward", "step", "checkpoint")
#: The kinds of memory the parameter machine's states hold (a full parameter each), by state name.
_STATE_KIND = {"AVAILABLE": "gathered", "INFLIGHT": "inflight", "DEFERRED_RELEASE": "deferred"}
#: The kind an offloaded value counts as, by its placement's kind.
_PLACED_KIND = {"shard": "shards", "grad": "shard_grads", "optim": "optimizer_state"}


def optimizer_state_bytes(optimizer, resident: bool = True, skip=frozenset()) -> int:
    """Bytes of every tensor of ``optimizer``'s per-parameter state (its step counters included), but for the
    parameters whose id is in ``skip``; with ``resident``, only those in working memory."""
    return sum(t.numel() * t.element_size() for param, state in optimizer.state.items() if id(param) not in skip
               for t in state.values() if isinstance(t, torch.Tensor)
               and not (resident and paged.is_paged_out(t)))


def reduce_buffer_bytes(executor) -> int:
    """Full gradients waiting for their bucket's reduce-scatter, and each issued reduce-scatter's input and
    output (its input holds the bucket's full gradients until it completes: [Note: a big gradient is reduced in
    place] in paramfsm.engine.effects.executor)."""
    pending = executor._grad_bytes
    for _, records, layout in executor._reduces:
        itemsize = (executor.reduce_dtype or records[0].compute_dtype).itemsize
        pending += layout.total * (executor.world + 1) * itemsize
    return pending


class Sampler:
    """Counts what ``rt`` holds after each transition (see the module's note); keeps each phase's peak.

    ``extra()`` gives the bytes of kinds no runtime structure holds (a checkpoint's staged copy, optimizer
    state given per element); ``optimizer``: whose state counts (it may be set once it is built).
    """

    def __init__(self, rt, trace, extra=dict, optimizer=None):
        self.rt, self.trace, self.extra, self.optimizer = rt, trace, extra, optimizer
        self.phase = PHASES[0]
        self.peaks: dict[str, tuple[int, dict, str, str]] = {}  # phase -> (total, by kind, unit, event)
        self.last = ("", "shard")  # the transition the states now held follow from
        self.exact = rt.world == 1
        held = runtime_memory.memory(rt)
        self.states = {kind: held[kind] for kind in _STATE_KIND.values()}
        plan = getattr(rt, "offload", None)
        self.residency = plan.residency if plan is not None else None
        self.pagers = list(plan.pagers.values()) if plan is not None else []
        placed = set(self.residency.shards) if self.residency is not None else set()
        paged_grads = set(plan.grads.pagers) if plan is not None and plan.grads is not None else set()
        records = list(rt._by_id.values())
        self.shards = sum(rec.shard.numel() * rec.shard.element_size() for rec in records if rec not in placed)
        self.grad_records = [rec for rec in records if rec not in paged_grads]
        self.grads, self.grads_at = 0, None
        self.state_bytes, self.state_at = 0, None
        self.tiers, self.tiers_at = dict.fromkeys(TIER_KINDS, 0), None

    # The trace's interface, as paramfsm.core.fsm.step and step_many call it.
    # [Note: a sample follows the transition it names]
    # ``step`` calls ``append`` after it set the record's state, ``step_many`` calls ``append_many`` before
    # it moves its records. So ``append`` counts the states this transition made, and ``append_many`` those
    # the transition before it made (named as that one); the states after a phase's last transition are
    # counted by the phase's closing :meth:`sample`. Every state the runtime passes through is counted once.
    def append(self, t_ns, ctx, rec, cell, keep_graph, retained, holds) -> None:
        if self.trace is not None:
            self.trace.append(t_ns, ctx, rec, cell, keep_graph, retained, holds)
        event, src, dst, _ = TAGS[cell.tag]
        self._move((rec,), src, dst)
        self.last = (getattr(rec, "unit", "") or "", event)
        self.sample()

    def append_many(self, t_ns, ctx, records, cell, keep_graph, retained, holds) -> None:
        if self.trace is not None:
            self.trace.append_many(t_ns, ctx, records, cell, keep_graph, retained, holds)
        self.sample()
        event, src, dst, _ = TAGS[cell.tag]
        self._move(records, src, dst)
        first = records[0] if records else None
        self.last = (getattr(first, "unit", "") or "", event)

    def __getattr__(self, name):  # anything else of the trace (its mode, its records) is the trace's
        return getattr(self.trace, name)

    def _move(self, records, src: str, dst: str) -> None:
        """Move the full-parameter bytes of ``records`` from ``src``'s kind to ``dst``'s."""
        before, after = _STATE_KIND.get(src), _STATE_KIND.get(dst)
        if before == after or self.exact:
            return
        nbytes = sum(rec.numel * rec.compute_dtype.itemsize for rec in records if hasattr(rec, "compute_dtype"))
        if before is not None:
            self.states[before] -= nbytes
        if after is not None:
            self.states[after] += nbytes

    def counted(self) -> dict[str, int]:
        """What is held now, by kind (see [Note: a sample counts the states by their transitions])."""
        held = dict.fromkeys(KINDS + TIER_KINDS, 0)
        rt, executor = self.rt, self.rt.executor
        if self.exact:
            held.update({k: v for k, v in runtime_memory.memory(rt).items() if k in held})
            held["optimizer_state"] = optimizer_state_bytes(self.optimizer) if self.optimizer is not None else 0
        else:
            first = self.grad_records[0].shard.grad if self.grad_records else None  # zero_grad drops it
            moment = (executor.counters.reduce_scatters, len(executor._reduces), self.phase, id(first))
            if moment != self.grads_at:
                self.grads_at = moment
                self.grads = sum(rec.shard.grad.numel() * rec.shard.grad.element_size()
                                 for rec in self.grad_records if rec.shard.grad is not None)
            held.update(self.states, shards=self.shards, shard_grads=self.grads,
                        optimizer_state=self._optimizer_state(), unsynced_grads=executor.unsynced.nbytes)
            if self.residency is not None:
                residency = self.residency
                for p in set(itertools.chain(residency._in_use, residency._cached, residency._ahead)):
                    held[_PLACED_KIND[p.kind]] += p.nbytes
                held.update(self._tiers())
        held["reduce_buffers"] = reduce_buffer_bytes(executor)
        for kind, value in self.extra().items():
            held[kind] += value
        return held

    def _optimizer_state(self) -> int:
        """The optimizer's state of the values it does not offload (those it does are resident placements)."""
        optimizer = self.optimizer
        if optimizer is None:
            return 0
        moment = (id(optimizer), len(optimizer.state), self.phase)
        if moment != self.state_at:
            self.state_at = moment
            offloaded = frozenset(id(rec.shard) for _, rec in self.residency.optim) if self.residency else frozenset()
            self.state_bytes = optimizer_state_bytes(optimizer, skip=offloaded)
        return self.state_bytes

    def _tiers(self) -> dict[str, int]:
        """Bytes each tier holds, added up again only when a tier placed a new slot."""
        moment = sum(len(pager.tier.slots) for pager in self.pagers)
        if moment != self.tiers_at:
            self.tiers_at = moment
            self.tiers = dict.fromkeys(TIER_KINDS, 0)
            for pager in self.pagers:
                self.tiers[f"tier_{pager.tier.where}"] += pager.tier.nbytes
        return self.tiers

    def sample(self, unit: str | None = None, event: str | None = None) -> None:
        """Count what is held now (after the last transition, or after ``event`` of ``unit``); keep it if it is
        the phase's largest total so far."""
        if event is not None:
            self.last = (unit or "", event)
            self.grads_at = self.state_at = None  # a step or zero_grad between transitions changes these
        held = self.counted()
        total = sum(held[kind] for kind in KINDS)
        best = self.peaks.get(self.phase)
        if best is None or total > best[0]:
            self.peaks[self.phase] = (total, held, *self.last)
