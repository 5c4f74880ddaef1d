"""What the executor keeps about its collectives: a gather in flight, and the communication counts.

Plain records with no behaviour, kept apart from :mod:`paramfsm.engine.executor`
(which fills them) so that module stays about running effects.
"""

from __future__ import annotations


class Gather:
    """One coalesced all-gather in flight: its lane ticket, work handle, receive buffer and records."""

    __slots__ = ("ticket", "work", "recv", "records", "layout", "tagged")

    def __init__(self, records, layout, tagged: bool = False):
        self.records, self.layout = records, layout
        self.ticket = self.work = self.recv = None
        self.tagged = tagged  # the bucket ends with the rank-order tag (see paramfsm.engine.rankcheck)


class Counters:
    """Communication counts, for tests (communication is part of correctness) and benchmarks."""

    __slots__ = ("all_gathers", "gathered_bytes", "reduce_scatters", "reduced_bytes")

    def __init__(self):
        self.all_gathers = self.gathered_bytes = self.reduce_scatters = self.reduced_bytes = 0

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.__slots__}
