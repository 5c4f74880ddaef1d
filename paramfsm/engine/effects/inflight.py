"""What the executor keeps about its collectives: a gather in flight, and the communication counts.

Plain records with no behaviour, kept apart from :mod:`paramfsm.engine.effects.executor`
(which fills them) so that module stays about running effects.
"""

from __future__ import annotations


class Gather:
    """One coalesced all-gather in flight: its lane ticket, work handle, receive buffer and records."""

    __slots__ = ("ticket", "work", "recv", "records", "layout", "tagged", "in_place", "direct")

    def __init__(self, records, layout, tagged: bool = False, in_place: tuple[bool, ...] | None = None):
        self.records, self.layout = records, layout  # layout: of the packed part, None when nothing is packed
        self.ticket = self.work = self.recv = None
        self.tagged = tagged  # the packed part ends with the rank-order tag (see paramfsm.engine.effects.rankcheck)
        # Per record, whether it is gathered straight into its full tensor (None: none is), and
        # the work handles of those in-place all-gathers while in flight.
        self.in_place = in_place
        self.direct = None


class Counters:
    """Communication counts, for tests (communication is part of correctness) and benchmarks."""

    __slots__ = ("all_gathers", "gathered_bytes", "reduce_scatters", "reduced_bytes")

    def __init__(self):
        self.all_gathers = self.gathered_bytes = self.reduce_scatters = self.reduced_bytes = 0

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in self.__slots__}
