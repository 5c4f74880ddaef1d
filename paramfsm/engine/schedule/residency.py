"""Where offloaded values live, step by step: the schedule's side of the residency machine.

Every offloaded value has a :class:`Paged` placement (one per parameter shard,
one per shard gradient and one per parameter's optimizer state) that the residency machine
(``[residency]`` in the spec) moves between DIRTY, RESIDENT, PAGING_IN and
PAGED_OUT. This component decides when: it steps the placements and hands
their effects to the tier's :class:`~paramfsm.engine.effects.paging.Pager`.

* Before a unit's all-gather starts, its shards are needed (paged in at once
  unless a page-in ahead of use already brought them) and read; the unit after
  it in the recorded order is paged in ahead, on the tier's thread.
* When the gather has landed (unpacked, or dropped unused) the shards are
  released: they may be paged out.
* The optimizer step (:mod:`paramfsm.sharding.offload`) runs unit by unit, needing the
  unit's shards and optimizer state, then writing them and releasing them.

[Note: the resident set]
``max_resident_bytes`` bounds the working copies of offloaded values resident
at once. Values in use (a unit being gathered or stepped) and one unit paged
in ahead are always allowed; released values stay resident, least recently
used first out, while the total stays within the bound, so a bound that holds
the whole model pages nothing after the first step. With no bound, every
released value is paged out at once (the least memory; most traffic).

[Note: streaming through the tier]
A pass over the whole model from outside the training step (``rt.init_weights``,
``rt.load_full_state_dict``, ``load_pretrained``, ``rt.full_state_dict``) takes
the shards of one module or parameter at a time in :meth:`Residency.using`:
paged in (or read from the resident set), used, released, and so trimmed back
to the bound (written to the tier first when the pass wrote them). It never
holds more than one block's shards beyond the resident set, where an
on-demand page-in would keep every value it touched until the next step.

[Note: paging follows the recorded order]
The order in which units' values are needed repeats from one training step to
the next (forward, backward, optimizer step). The order of the previous step
(between two optimizer steps) is kept; when the value needed now is the one
needed at the same position then, the next one of then is paged in ahead.
Where the order changed, nothing is guessed: the next need reads at once.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections import OrderedDict

from torch.utils.weak import WeakIdKeyDictionary

from paramfsm.core.fsm import Placement, residency_table, step
from paramfsm.core.spec import Residency as States
from paramfsm.engine.storage import paged


class Paged(Placement):
    """One offloaded value: its residency (the Placement), its version, its tensors and its tier."""

    __slots__ = ("version", "values", "pager", "key", "tensor", "synced")

    def __init__(self, name: str, unit: str, kind: str, values, pager, key, tensor=None):
        tensors = values()
        super().__init__(name, unit, kind, sum(t.numel() * t.element_size() for _, t in tensors))
        self.version = 0  # numbered by its Residency (add), so a run's numbers do not depend on earlier runs
        self.values, self.pager, self.key = values, pager, key
        self.tensor = tensor  # a shard gradient's: a weak reference to the one tensor it was made for
        self.synced = ()  # its tensors' autograd versions when it last became RESIDENT (see [Note: ...])


class Residency:
    """Steps the placements of one runtime's offloaded values (see the module docstring)."""

    def __init__(self, ctx, *, max_resident_bytes: int | None):
        self.ctx = ctx
        self.table = residency_table()
        self.bound = max_resident_bytes or 0
        self.shards: dict = {}  # record -> Paged (its shard)
        self.optim: dict = {}  # (id(optimizer), record) -> Paged (its optimizer state)
        self._in_use: dict = {}  # Paged -> how many users
        self._cached: OrderedDict = OrderedDict()  # released and resident, least recently used first
        self._ahead: set = set()  # paged in ahead of use, not used yet
        self._order: list = []  # groups of placements needed this step, in order
        self._previous: list = []
        self._writing: list = []  # shards kept resident for a write from outside (writing_shards)
        self._by_tensor = WeakIdKeyDictionary()  # offloaded tensor -> its placement
        self.closed = False
        self._thread = threading.current_thread()  # the one that drives the schedule
        self._versions = itertools.count(1)  # versions of working values: a tier copy must carry the latest

    # ------------------------------------------------------------------ placements
    def add(self, p: Paged) -> Paged:
        """Take a new placement (DIRTY) and page it out unless it fits in the resident set."""
        p.version = next(self._versions)
        for _, tensor in p.values():
            paged.PAGERS[tensor] = self._on_demand
            paged.OWNERS[tensor] = (p.name, p.what, p.unit, self.ctx.rank)
            self._by_tensor[tensor] = p
        self._cached[p] = None
        self._trim()
        return p

    def placement_of(self, tensor) -> Paged | None:
        """The placement ``tensor`` is the value of (None: not offloaded here)."""
        return None if self.closed else self._by_tensor.get(tensor)

    def tracks(self, p: Paged) -> bool:
        """Whether every tensor ``p`` stands for now is one this residency placed (none was replaced)."""
        return all(self._by_tensor.get(tensor) is p for _, tensor in p.values())

    def renew(self, placements) -> None:
        """The values of ``placements`` were replaced by new tensors outside the schedule (``zero_grad``, an
        optimizer load): each is stepped to DIRTY (its tier copy is of the old value) and no longer tracked;
        the new tensor gets a placement of its own, which starts there."""
        for p in placements:
            self._run(p, "renew")
        self.forget(placements)

    def forget(self, placements) -> None:
        """Stop tracking ``placements`` (closing: their values go back to the model)."""
        for p in placements:
            self._cached.pop(p, None)
            self._in_use.pop(p, None)
            self._ahead.discard(p)

    @property
    def resident_bytes(self) -> int:
        return sum(p.nbytes for p in itertools.chain(self._in_use, self._cached, self._ahead))

    def peek(self, tensor):
        """What ``tensor`` holds as its next use would see it, paging nothing and stepping nothing: the working
        copy when resident, else a copy of its tier copy (:class:`~paramfsm.errors.StaleOffloadCopy` when that
        copy is older than the value, as the page-in would raise). For observers that must not disturb the
        schedule (verify's checks): an on-demand page-in would count the value as written and hide a lost
        write-back."""
        if not paged.is_paged_out(tensor):
            return tensor
        p = self._by_tensor.get(tensor)
        key = next((key for key, value in p.values() if value is tensor), None) if p is not None else None
        if key is None:
            return tensor  # not ours: reading it raises NotResident, as any reader's would
        return p.pager.peek(p, key, tensor)

    # ------------------------------------------------------------------ use
    def need(self, placements, *, ahead: bool = True) -> None:
        """``placements`` are about to be used: resident now, kept so until :meth:`release`. ``ahead``:
        a use in the recorded order, which pages in the next one ahead (see [Note: paging follows the
        recorded order])."""
        placements = [p for p in placements if p is not None]
        if not placements:
            return
        for p in placements:
            self._run(p, "need")
            self._cached.pop(p, None)
            self._ahead.discard(p)
            self._in_use[p] = self._in_use.get(p, 0) + 1
        if ahead:
            self._page_in_next(placements)

    def read(self, placements) -> None:
        for p in placements:
            if p is not None:
                self._run(p, "read")

    def written(self, placements) -> None:
        """The working copies of ``placements`` changed (an optimizer step, a load)."""
        for p in placements:
            if p is not None:
                self._run(p, "write")
                p.version = next(self._versions)

    def release(self, placements) -> None:
        """Done using ``placements``: they join the resident set, which is trimmed to its bound."""
        for p in placements:
            if p is None or p not in self._in_use:
                continue
            users = self._in_use.pop(p) - 1
            if users:
                self._in_use[p] = users
            else:
                self._cached[p] = None
        self._trim()

    def write_back(self, placements) -> None:
        """Write changed working copies to their tiers now, keeping them resident."""
        for p in placements:
            if p is not None:
                self._run(p, "write_back")

    def end_step(self) -> None:
        """An optimizer step finished: the order recorded since the last one is the one to follow."""
        self._previous, self._order = self._order, []

    # ------------------------------------------------------------------ gathers
    def gathering(self, start_gather):
        """Wrap the ``start_gather`` effect: the records' shards are needed and read before it starts."""
        shards = self.shards

        def start(records):
            placements = [shards.get(rec) for rec in records]
            self.need(placements)
            self.read(placements)
            start_gather(records)
        return start

    def gathered(self, effect):
        """Wrap ``unpack`` / ``discard_gather``: once the gather has landed, the shards are released."""
        shards = self.shards

        def done(records):
            effect(records)
            self.release([shards.get(rec) for rec in records])
        return done

    def writing(self, effect):
        """Wrap ``write_back`` (``rt.gathered(writeback=True)``): the shards are written while resident."""
        shards = self.shards

        def write(records):
            placements = [shards.get(rec) for rec in records]
            self.need(placements, ahead=False)
            self.written(placements)
            effect(records)
            self.release(placements)
        return write

    def writing_shards(self, records) -> None:
        """The shards of ``records`` are about to be written from outside (a load, ``rt.init_weights``):
        resident and marked changed now, released at :meth:`settle`."""
        placements = [p for p in map(self.shards.get, records) if p is not None]
        if placements:
            self.need(placements, ahead=False)
            self.written(placements)
            self._writing.extend(placements)

    def using(self, records, *, write: bool):
        """The shards of ``records`` resident for the block, then released (see [Note: streaming through the
        tier]); ``write``: the block writes them (a load, an initialisation), so they are marked changed."""
        return self._held([p for p in map(self.shards.get, records) if p is not None], write)

    def using_state(self, optimizer, records, *, write: bool):
        """The optimizer state ``optimizer`` keeps for ``records`` resident for the block, then released, as
        :meth:`using` does for their shards (a streamed checkpoint load writes it one unit at a time)."""
        placements = [self.optim.get((id(optimizer), rec)) for rec in records]
        return self._held([p for p in placements if p is not None and p.values() and self.tracks(p)], write)

    def holding(self, tensor, *, write: bool):
        """``tensor`` (an offloaded value; anything else passes through) resident for the block, then
        released: a reader outside the step (clipping) takes one value at a time, as :meth:`using` does."""
        p = self.placement_of(tensor)
        return self._held([p] if p is not None else [], write)

    @contextlib.contextmanager
    def _held(self, placements: list, write: bool):
        self.need(placements, ahead=False)
        self.read(placements)
        try:
            yield
        finally:
            if write:
                self.written(placements)
            self.release(placements)

    def settle(self) -> None:
        """Release the shards kept for writes from outside (the next root forward or optimizer step)."""
        if self._writing:
            placements, self._writing = self._writing, []
            self.written(placements)
            self.release(placements)

    # ------------------------------------------------------------------ paging
    def _run(self, p: Paged, event: str) -> None:
        if event in _LEAVING and p.state is States.RESIDENT and p.synced != _versions(p):
            self.written([p])  # changed in place outside the schedule: see [Note: a write nobody announced]
        before = p.state
        for effect in step(self.table, p, event, self.ctx):
            getattr(p.pager, effect)((p,))
        if p.state is States.RESIDENT and before is not States.RESIDENT:
            p.synced = _versions(p)

    def _trim(self) -> None:
        while self._cached and self.resident_bytes > self.bound:
            p, _ = self._cached.popitem(last=False)
            self._run(p, "page_out")

    def _page_in_next(self, placements) -> None:
        key = frozenset(placements)
        position = len(self._order)
        self._order.append(key)
        if position + 1 >= len(self._previous) or self._previous[position] != key:
            return
        ahead = [p for p in self._previous[position + 1] if p not in self._in_use and p not in self._cached]
        if not ahead or self._ahead:
            return
        size = sum(p.nbytes for p in ahead)
        if self.bound and self.resident_bytes + size > self.bound and not self._evictable(size):
            return
        for p in ahead:
            self._ahead.add(p)
            self._run(p, "page_in")

    def _evictable(self, size: int) -> bool:
        """Page out released values until ``size`` more bytes fit; whether they now do."""
        while self._cached and self.resident_bytes + size > self.bound:
            p, _ = self._cached.popitem(last=False)
            self._run(p, "page_out")
        return self.resident_bytes + size <= self.bound

    def _on_demand(self, tensor) -> bool:
        """A paged-out tensor was used outside the schedule (a save, a load, user code).

        Its placement is paged in and kept resident until :meth:`settle`, and counted as changed, since
        the use may write it in place: a write-back too many is safe, a lost one is not.
        """
        if self.closed or threading.current_thread() is not self._thread:
            return False
        p = self._by_tensor.get(tensor)
        if p is None:
            return False
        self.need([p], ahead=False)  # a use outside the schedule is not part of the recorded order
        self.written([p])
        self._writing.append(p)
        return not paged.is_paged_out(tensor)

    # ------------------------------------------------------------------ teardown
    def page_in_all(self, *, strict: bool = True, also=()) -> None:
        """Every value resident and untracked (close, detach): the model owns its tensors again.

        Every value is tried even when one fails (a stale tier copy, a read error), so the others are
        handed back; the first failure is then raised, unless ``strict`` is False (detach after a failure,
        where the runtime's state may already be inconsistent and nothing may raise). ``also``: placements
        kept elsewhere (the shard gradients' of paramfsm.engine.schedule.grad_paging)."""
        placements = list(itertools.chain(self.shards.values(), also, self.optim.values()))
        first = None
        for p in placements:
            try:
                self._run(p, "need")
            except Exception as exc:  # noqa: BLE001 - raised below, after every value was tried
                first = first or exc
        self.forget(placements)
        self.closed = True
        for p in placements:
            for _, tensor in p.values():
                paged.PAGERS.pop(tensor, None)
        if first is not None and strict:
            raise first


#: [Note: a write nobody announced]
#: A RESIDENT value's working copy equals its tier copy, so paging it out only drops it. But a resident value is
#: an ordinary tensor, and code outside the schedule may change it in place without paging anything in:
#: ``zero_grad(set_to_none=False)`` zeroing a shard gradient kept in the resident set, ``clip_grad_value_`` on
#: shard gradients, a user's write to a shard. Dropped as clean, such a change would be lost and the tier's old
#: value read back at the next use (a gradient then adds the last step's to the new one). So each placement
#: keeps its tensors' autograd versions from when it became RESIDENT; before a page-out or a write-back, a
#: version that moved steps the placement with ``write`` (to DIRTY), so the change is written first.
_LEAVING = frozenset({"page_out", "write_back"})


def _versions(p: Paged) -> tuple:
    return tuple(tensor._version for _, tensor in p.values())
