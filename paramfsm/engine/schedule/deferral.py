"""Retained-graph deferral: full copies kept for a later backward over a graph that was retained.

A release inside a backward that keeps its graph (``retain_graph=True``)
defers the parameter instead of freeing it (the spec's ``release`` with
``keep_graph``), so the next backward over the same graph finds it gathered
and issues no all-gather. :class:`Deferral` owns the retain policy, the
deferred set (oldest first) and its bound, ``max_deferred_bytes``: past it,
the oldest copies are flushed. The flush of everything comes after the final
non-retained backward, at a new root forward and at ``rt.flush()``.
"""

from __future__ import annotations


class Deferral:
    """The retain policy and the deferred parameters; see the module docstring."""

    __slots__ = ("_step", "_step_all", "allowed", "bound", "deferred", "bytes", "peak_bytes")

    def __init__(self, step, step_all, *, allowed: bool, bound):
        self._step, self._step_all = step, step_all
        self.allowed = allowed  # retain="defer"; "regather" frees and gathers again
        self.bound = bound  # max_deferred_bytes (None: unbounded)
        self.deferred: dict = {}  # record -> None, oldest first
        self.bytes = 0
        self.peak_bytes = 0

    def defers(self) -> bool:
        """Whether a release in a backward that keeps its graph defers (``retain="defer"``)."""
        return self.allowed

    def release(self, unit, keep_graph: bool) -> None:
        """Release one hold on every parameter of ``unit``; deferred when the backward keeps its graph."""
        self._step_all(unit.records, "release", keep_graph and self.allowed)

    def release_records(self, records, keep_graph: bool) -> None:
        """``release`` for some parameters (gradient holds), not a whole unit."""
        self._step_all(records, "release", keep_graph and self.allowed)

    def release_one(self, rec, keep_graph: bool) -> None:
        self._step(rec, "release", keep_graph and self.allowed)

    def defer_all(self, records) -> None:
        """The ``defer`` effect."""
        for rec in records:
            self._defer(rec)

    def undefer_all(self, records) -> None:
        """The ``undefer`` effect (a deferred copy is used, flushed or dropped)."""
        for rec in records:
            if self.deferred.pop(rec, 0) is None:
                self.bytes -= rec.nbytes

    def _defer(self, rec) -> None:
        self.deferred[rec] = None
        self.bytes += rec.nbytes
        bound = self.bound
        if bound is not None:
            while self.bytes > bound and self.deferred:
                self._step(next(iter(self.deferred)), "flush")
        self.peak_bytes = max(self.peak_bytes, self.bytes)

    def flush(self) -> None:
        """Return every deferred parameter (rt.flush(), a new forward, the final backward)."""
        for rec in list(self.deferred):
            self._step(rec, "flush")
