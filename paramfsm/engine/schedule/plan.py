"""Prefetch plans: the recorded order of units in a pass, cut into gather buckets.

The first forward (and the first backward) runs unit by unit and records the
order in which units were fetched. The next passes follow the recorded plan:
consecutive units are merged into one bucket until it would pass
``bucket_bytes`` (one all-gather for many small units, as gloo and NCCL both
charge a fixed cost per collective), and the next ``prefetch`` buckets are
issued ahead of use. A pass whose order differs from the plan re-records it at
its end; prefetched units the pass never fetched are abandoned.

Every rank runs the same program, so every rank derives the same plan and
issues the same collectives in the same order.
"""

from __future__ import annotations


class PassState:
    """One forward pass or one backward graph task: the order seen and the buckets issued."""

    __slots__ = ("order", "issued")

    def __init__(self):
        self.order: list[int] = []
        self.issued: set[int] = set()


class Plan:
    """A recorded unit order and its buckets (lists of units gathered by one collective)."""

    __slots__ = ("order", "buckets", "_bucket_of", "_units", "_bucket_bytes")

    def __init__(self, order, units, bucket_bytes: int):
        self.order = tuple(order)
        self._units = units
        self._bucket_bytes = bucket_bytes
        self.buckets: list[list] = []
        self._bucket_of: dict[int, int] = {}
        size = 0
        for index in dict.fromkeys(self.order):
            unit = units[index]
            if not self.buckets or size + unit.nbytes > bucket_bytes:
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(unit)
            size += unit.nbytes
            self._bucket_of[index] = len(self.buckets) - 1

    def bucket_index(self, unit) -> int | None:
        return self._bucket_of.get(unit.index)

    def updated(self, order: list[int]) -> "Plan":
        """This plan if ``order`` matches it (or is empty), else a plan re-recorded from ``order``."""
        if not order or tuple(order) == self.order:
            return self
        return Plan(order, self._units, self._bucket_bytes)
