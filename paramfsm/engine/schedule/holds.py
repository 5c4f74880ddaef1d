"""Holds taken outside a forward or backward: a forward's hold kept for its backward, and ``rt.gathered``.

A unit that ``reshard_after_forward`` keeps (see [Note: a forward's hold kept for its backward] in
:mod:`paramfsm.engine.schedule.reshard`) keeps its forward's hold, keyed by the forward call, until the
call's backward takes it over or its graph is freed.

:class:`ForwardHolds` owns both kinds of hold; it releases through the
deferral's ``release`` it is given.
"""

from __future__ import annotations

from paramfsm.engine.storage.placeholder import unwatch, watch


class ForwardHolds:
    """Kept forward holds and ``rt.gathered`` holds; see the module docstring.

    While a forward hold is kept, its unit's parameters report every read (see [Note: a read of a kept
    parameter outside its unit] in :mod:`paramfsm.engine.storage.placeholder`): ``watching`` counts the kept
    holds over each record, and the last one to go switches the parameter back before it is released.
    """

    __slots__ = ("_release", "keep_after_forward", "kept", "outside", "watched", "watching")

    def __init__(self, release, keep_after_forward: frozenset = frozenset()):
        self._release = release
        self.keep_after_forward = keep_after_forward  # units whose forward hold is kept (reshard.py)
        self.kept: dict = {}  # id of the forward call -> unit
        self.outside: dict = {}  # unit -> holds taken by rt.gathered
        self.watched: dict = {}  # id of the forward call -> the records its hold watches
        self.watching: dict = {}  # record -> kept holds over it

    def after_forward(self, unit, call) -> bool:
        """A root forward of ``unit`` ended: keep its hold for the backward (True), or not."""
        if call is not None and unit in self.keep_after_forward:
            records = self.watched[id(call)] = unit.records
            self.kept[id(call)] = unit
            watching = self.watching
            for rec in records:
                count = watching.get(rec, 0)
                watching[rec] = count + 1
                if not count:
                    watch(rec.param)
            return True
        return False

    def hand_over(self, call_id: int) -> None:
        """The call's backward began (or its graph was freed): release the hold its forward kept."""
        if self.kept:
            unit = self.kept.pop(call_id, None)
            if unit is not None:
                self._let_go(call_id, unit)

    def release_all(self) -> None:
        """Release every kept forward hold."""
        if self.kept:
            holds, self.kept = self.kept, {}
            for call_id, unit in holds.items():
                self._let_go(call_id, unit)

    def release_kept(self, units) -> None:
        """Release the forward holds kept for a backward of any of ``units`` (their shards are written)."""
        if self.kept:
            for call_id, unit in list(self.kept.items()):
                if unit in units:
                    del self.kept[call_id]
                    self._let_go(call_id, unit)

    def _let_go(self, call_id: int, unit) -> None:
        """Stop watching what the hold watched (the last hold over a record switches it back), then release."""
        watching = self.watching
        for rec in self.watched.pop(call_id, ()):
            count = watching.pop(rec, 1) - 1
            if count:
                watching[rec] = count
            else:
                unwatch(rec.param)
        self._release(unit, False)

    def take_outside(self, unit) -> None:
        """``rt.gathered`` holds ``unit`` (the caller fetches it)."""
        self.release_all()
        self.outside[unit] = self.outside.get(unit, 0) + 1

    def drop_outside(self, unit) -> None:
        self.outside[unit] -= 1
        if not self.outside[unit]:
            del self.outside[unit]
        self._release(unit, False)

    def outside_count(self, unit) -> int:
        return self.outside.get(unit, 0)

    def held_units(self) -> list:
        """Every unit a hold of this kind keeps gathered (for the leak audit)."""
        return [*self.outside, *self.kept.values()]

    def reset(self) -> None:
        for rec in self.watching:
            unwatch(rec.param)
        self.watching.clear()
        self.watched.clear()
        self.kept.clear()
        self.outside.clear()
