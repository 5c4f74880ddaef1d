"""Fetching units for their holders: the gather batch, waiting, and prefetching along the recorded plans.

:class:`Prefetch` owns the forward and backward plans (:mod:`paramfsm.engine.schedule.plan`),
the state of the forward pass in progress and the gathers asked for in the
current decision, which it issues as one collective.
"""

from __future__ import annotations

from paramfsm.core.spec import State
from paramfsm.engine.schedule.plan import PassState, Plan


class Prefetch:
    """Gathers units when asked, in buckets, and ahead of use; see the module docstring."""

    __slots__ = ("_step", "_step_all", "_executor", "depth", "planning", "fwd_plan", "bwd_plan", "forward",
                 "forward_open", "_batch")

    def __init__(self, step, step_all, executor, units, *, prefetch: int, bucket_bytes: int):
        self._step, self._step_all, self._executor = step, step_all, executor
        self.depth = prefetch  # buckets issued ahead of the one in use
        # One rank gathers nothing over the wire: buckets and prefetch would only add steps.
        self.planning = executor.world > 1
        self.fwd_plan = Plan((), units, bucket_bytes)
        self.bwd_plan = Plan((), units, bucket_bytes)
        self.forward = PassState()
        self.forward_open = False
        self._batch: list = []

    def start_gather(self, records) -> None:
        """The ``start_gather`` effect: collected, and issued as one all-gather by :meth:`issue`."""
        self._batch.extend(records)

    def issue(self) -> None:
        """Issue one all-gather for every record that asked for start_gather in this decision."""
        batch = self._batch
        if batch:
            records = tuple(batch)
            batch.clear()
            self._executor.start_gather(records)

    def wait(self, unit) -> None:
        """Make every INFLIGHT parameter of ``unit`` arrive (waiting for its whole bucket)."""
        for rec in unit.records:
            if rec.state is State.INFLIGHT:
                gather = rec.pending
                self._executor.wait_gather(gather)
                members = gather.records
                for member in members:
                    if member.state is not State.INFLIGHT or member.pending is not gather:
                        members = [m for m in members if m.state is State.INFLIGHT and m.pending is gather]
                        break
                self._step_all(members, "arrive")

    def fetch_forward(self, unit) -> None:
        """A unit's forward in a root forward (planned) or anywhere else (alone)."""
        if self.forward_open and self.planning:
            self.fetch(unit, self.fwd_plan, self.forward)
        else:
            self.fetch(unit, None, None)

    def fetch_backward(self, unit, passes: PassState, outermost: bool) -> None:
        """A unit's pre-backward or recomputation: planned in the outermost graph task only."""
        if outermost and self.planning:
            self.fetch(unit, self.bwd_plan, passes)
        else:
            self.fetch(unit, None, None)

    def fetch(self, unit, plan: Plan | None, passes: PassState | None) -> None:
        """Fetch ``unit`` for a holder: gather it (with its bucket) if needed, wait, prefetch ahead.

        Without a plan (first pass, recomputation inside backward, rt.gathered)
        the unit is gathered alone and nothing is prefetched.
        """
        self._step_all(unit.records, "fetch")
        bucket = plan.bucket_index(unit) if plan is not None else None
        # [Note: a bucket is issued by its first fetch]
        # Whether or not this unit itself needed a gather: a unit with nothing to gather (the root
        # holding no parameters of its own, a unit kept from its forward) still opens its bucket, and
        # _prefetch_ahead below marks the bucket issued. Prefetching the rest only when this unit
        # gathered left every other unit of the bucket to gather alone: one all-gather per unit.
        if bucket is not None and bucket not in passes.issued:
            passes.issued.add(bucket)
            for other in plan.buckets[bucket]:
                if other is not unit:
                    self._step_all(other.records, "prefetch")
        self.issue()
        self.wait(unit)
        if passes is not None:
            passes.order.append(unit.index)
            if bucket is not None:
                self._prefetch_ahead(bucket, plan, passes)

    def _prefetch_ahead(self, bucket: int, plan: Plan, passes: PassState) -> None:
        """Issue the gathers of the next ``depth`` buckets (one collective each) not issued yet."""
        passes.issued.add(bucket)
        for ahead in range(bucket + 1, min(bucket + 1 + self.depth, len(plan.buckets))):
            if ahead in passes.issued:
                continue
            passes.issued.add(ahead)
            for other in plan.buckets[ahead]:
                self._step_all(other.records, "prefetch")
            self.issue()

    def in_forward(self) -> bool:
        """Whether a root forward is in progress."""
        return self.forward_open

    def begin_forward(self) -> None:
        """A root forward begins: a new pass, planned by the forward plan."""
        self.forward = PassState()
        self.forward_open = True

    def end_forward(self) -> None:
        """The root forward ended: drop what it prefetched and never used; re-record the plan if it differed."""
        if not self.forward_open:
            return
        self.forward_open = False
        self._abandon(self.fwd_plan, self.forward)
        self.fwd_plan = self.fwd_plan.updated(self.forward.order)

    def end_backward(self, passes: PassState) -> None:
        """The outermost graph task ended: the same for the backward plan."""
        self._abandon(self.bwd_plan, passes)
        self.bwd_plan = self.bwd_plan.updated(passes.order)

    def _abandon(self, plan: Plan, passes: PassState) -> None:
        """Drop prefetched parameters nobody fetched in a pass that ended."""
        for bucket in passes.issued:
            for unit in plan.buckets[bucket]:
                for rec in unit.records:
                    if rec.state is State.INFLIGHT or (rec.state is State.AVAILABLE and rec.holds == 0):
                        self._step(rec, "abandon")

    def reset(self) -> None:
        self.forward_open = False
        self._batch.clear()
