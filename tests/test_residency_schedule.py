"""The schedule's side of offload residency (:class:`paramfsm.engine.schedule.residency.Residency`), driven
directly over a host tier: which values stay resident under ``max_resident_bytes``, which one is paged in
ahead of use, and what a use from outside the schedule does.

Each value here is four float32 (16 bytes), its own unit. The offload tests run the same component through a
training loop against plain torch; these pin the policy its module notes promise ([Note: the resident set],
[Note: paging follows the recorded order], [Note: streaming through the tier]) one rule at a time, so a change
to a rule fails here by name and not as a byte count somewhere in a training test.
"""

from __future__ import annotations

import threading

import pytest
import torch

from paramfsm.core.fsm import StepContext
from paramfsm.core.spec import Residency as States
from paramfsm.engine.effects.paging import Pager
from paramfsm.engine.schedule.residency import Paged, Residency
from paramfsm.engine.storage import paged
from paramfsm.engine.storage.tiers import HostTier
from paramfsm.errors import NotResident, StaleOffloadCopy

NBYTES = 16  # four float32


class Values:
    """Placements of named 16-byte values over one host tier, each its own record in ``residency.shards``."""

    def __init__(self, names: str, bound: int | None):
        self.residency = Residency(StepContext(), max_resident_bytes=bound)
        self.pager = Pager(HostTier(0, pin_memory=False), 0)
        self.tensors, self.p = {}, {}
        for name in names:
            self.add(name)

    def add(self, name: str) -> None:
        tensor = self.tensors[name] = torch.full((4,), float(len(self.p) + 1))
        self.p[name] = self.residency.shards[name] = Paged(name, f"unit.{name}", "shard", lambda: [(name, tensor)],
                                                           self.pager, name)
        self.residency.add(self.p[name])

    def states(self) -> str:
        """Each value's residency, one letter each in the order added: D (resident, changed since its tier
        copy), R (resident, as its tier copy), I (paging in), O (paged out)."""
        letter = {States.DIRTY: "D", States.RESIDENT: "R", States.PAGING_IN: "I", States.PAGED_OUT: "O"}
        return "".join(letter[p.state] for p in self.p.values())

    def need(self, names: str, ahead: bool = True) -> None:
        self.residency.need([self.p[name] for name in names], ahead=ahead)

    def release(self, names: str) -> None:
        self.residency.release([self.p[name] for name in names])

    def use(self, names: str) -> None:
        """A unit's use in the schedule: needed (in the recorded order), read, released."""
        self.need(names)
        self.residency.read([self.p[name] for name in names])
        self.release(names)

    def step(self, *units: str) -> None:
        """One training step that uses ``units`` (each a string of value names) in order, then ends."""
        for unit in units:
            self.use(unit)
        self.residency.end_step()


def test_released_values_stay_resident_up_to_the_bound_least_recently_used_out_first():
    values = Values("abc", bound=3 * NBYTES)
    assert values.states() == "DDD", "three values fit a bound of exactly three: none is paged out"
    values.use("a")  # now the most recently used
    values.add("d")
    assert values.states() == "DODD", "b, the least recently used, is paged out"
    assert values.pager.bytes_written == NBYTES, "a changed value is written to its tier before it is dropped"
    values.need("b", ahead=False)
    assert torch.equal(values.tensors["b"], torch.full((4,), 2.0)), "and reads back as it was"


def test_without_a_bound_every_released_value_is_paged_out_and_the_next_unit_of_the_order_comes_ahead():
    values = Values("abc", bound=None)
    assert values.states() == "OOO"
    values.step("a", "b", "c")
    assert values.states() == "OOO", "the first step has no order to follow: nothing was paged in ahead"
    values.need("a")
    assert values.states() == "RIO", "needing a, the first of the last step's order, pages in b, the next"
    values.release("a")
    values.need("b")
    assert values.states() == "ORI", "then b's need pages in c"
    values.release("b")
    values.need("c")
    assert values.states() == "OOR", "c was the last: nothing comes after it"
    values.release("c")
    assert values.pager.bytes_read == 6 * NBYTES


def test_a_step_that_leaves_the_recorded_order_pages_nothing_ahead():
    values = Values("abc", bound=None)
    values.step("a", "b", "c")
    values.need("b")
    assert values.states() == "ORO", "b was second in the last step, not first: nothing is guessed"
    values.release("b")
    values.need("a", ahead=False)
    assert values.states() == "ROO", "a use outside the recorded order pages nothing ahead"


def test_one_unit_at_most_is_paged_in_ahead():
    """A unit paged in ahead and never used keeps its place: the next match pages in no second one."""
    values = Values("abcx", bound=None)
    values.step("a", "b")
    values.need("a")  # b comes ahead ...
    values.release("a")
    values.use("x")  # ... but the step goes elsewhere
    values.residency.end_step()  # the recorded order is now a, x
    values.need("a")
    assert values.states() == "RIOO", "b, still ahead, holds the place: x is not paged in too"


def test_a_unit_paged_in_ahead_under_a_bound_evicts_the_least_recently_used_only_as_far_as_it_must():
    values = Values("abcde", bound=3 * NBYTES)
    values.step("a", "b", "c", "d", "e")
    assert values.states() == "OORRR", "the last three used stay resident"
    values.need("a")
    # a in use and c, d, e resident (64 bytes) are over the bound (48); b (16) fits once c and d, the least
    # recently used, are paged out, and e stays: the bound may be met exactly.
    assert values.states() == "RIOOR"


def test_a_next_unit_still_resident_is_left_as_it_is():
    values = Values("abcd", bound=3 * NBYTES)
    values.step("a", "b", "c", "d")
    assert values.states() == "ORRR"
    values.need("a")
    assert values.states() == "RRRR", "b is resident already: nothing is paged out to page it in again"


def test_a_unit_that_cannot_fit_beside_the_one_in_use_is_not_paged_in_ahead():
    values = Values("abcdefg", bound=3 * NBYTES)
    values.step("abc", "d", "e", "f", "g")
    assert values.states() == "OOOORRR"
    values.need("abc")
    assert values.states() == "RRROOOO", "a, b and c in use fill the bound: d waits for its need"
    values.release("abc")
    values.need("d")
    assert values.states()[3] == "R", "and its need pages it in"


@pytest.mark.parametrize("write", [False, True])
def test_a_streamed_use_marks_its_values_changed_only_when_it_writes(write):
    values = Values("ab", bound=2 * NBYTES)
    values.residency.write_back([values.p["a"], values.p["b"]])
    assert values.states() == "RR"
    version = values.p["a"].version
    with values.residency.using(["a", "nothing offloaded"], write=write):
        assert values.p["a"].state is States.RESIDENT
    assert values.states() == ("DR" if write else "RR")
    assert (values.p["a"].version > version) is write, "a write gives the value a new version for its tier copy"


@pytest.mark.parametrize("write", [False, True])
def test_holding_one_tensor_marks_it_changed_only_when_it_writes(write):
    values = Values("ab", bound=2 * NBYTES)
    values.residency.write_back([values.p["a"], values.p["b"]])
    with values.residency.holding(values.tensors["b"], write=write):
        pass
    with values.residency.holding(torch.zeros(2), write=True):  # not offloaded: passes through
        pass
    assert values.states() == ("RD" if write else "RR")


@pytest.mark.parametrize("write", [False, True])
def test_using_an_optimizers_state_takes_only_the_values_this_residency_still_tracks(write):
    values = Values("", bound=4 * NBYTES)
    optimizer, held = object(), {"a": torch.zeros(4), "b": torch.ones(4)}
    for name in "ab":
        p = Paged(name, f"unit.{name}", "optim", lambda name=name: [(name, held[name])], values.pager, name)
        values.residency.optim[(id(optimizer), name)] = values.p[name] = values.residency.add(p)
    values.residency.write_back(list(values.p.values()))
    held["b"] = torch.ones(4)  # an optimizer load replaced b's state tensor: its placement no longer stands for it
    with values.residency.using_state(optimizer, ["a", "b", "no state"], write=write):
        pass
    with values.residency.using_state(object(), ["a"], write=True):  # another optimizer keeps no state here
        pass
    assert values.states() == ("DR" if write else "RR"), "only a, tracked, is marked changed by a write"


def test_a_paged_out_value_read_on_the_training_thread_is_paged_in_and_kept_until_settle():
    values = Values("ab", bound=None)
    version = values.p["a"].version
    assert values.tensors["a"].sum().item() == 4.0, "read outside the schedule: paged in on demand"
    assert values.states() == "DO", "counted as changed (the use may write it) and kept resident"
    assert values.p["a"].version > version
    values.residency.settle()
    assert values.states() == "OO", "settle releases it, and the bound of none pages it out (written first)"
    values.residency.need([values.p["a"]], ahead=False)
    assert torch.equal(values.tensors["a"], torch.full((4,), 1.0))


def test_a_use_outside_the_schedule_is_not_part_of_the_recorded_order():
    values = Values("abc", bound=None)
    values.step("a", "b", "c")
    values.tensors["c"].sum()  # paged in on demand, before the step's first need
    values.residency.settle()
    values.need("a")
    assert values.states() == "RIO", "a is still first in the order, so b comes ahead"


def test_a_paged_out_value_read_on_another_thread_or_after_close_raises_not_resident():
    values = Values("ab", bound=None)
    raised = []

    def other():
        try:
            values.tensors["a"].sum()
        except NotResident as exc:
            raised.append(str(exc))

    thread = threading.Thread(target=other)
    thread.start()
    thread.join()
    assert raised and "parameter 'a' (unit 'unit.a', rank 0)" in raised[0], raised
    assert values.states() == "OO", "nothing was paged in for the other thread"
    tensor = values.tensors["b"]
    values.residency.page_in_all()
    assert values.residency.placement_of(tensor) is None, "a closed residency places nothing"
    assert torch.equal(tensor, torch.full((4,), 2.0)), "closing hands every value back resident"


def test_a_value_needed_twice_stays_in_use_until_released_twice():
    values = Values("a", bound=None)
    values.need("a", ahead=False)
    values.need("a", ahead=False)
    values.release("a")
    assert values.states() == "R", "one user is left"
    values.release("a")
    values.release("a")  # a release too many is ignored
    assert values.states() == "O"


def test_written_values_get_a_new_version_and_write_back_keeps_them_resident():
    values = Values("ab", bound=2 * NBYTES)
    values.residency.write_back([values.p["a"], None])
    assert values.states() == "RD" and values.pager.bytes_written == NBYTES
    version = values.p["a"].version
    values.residency.written([values.p["a"], None])
    assert values.states() == "DD" and values.p["a"].version > version


def test_a_resident_value_changed_in_place_without_a_word_is_written_before_it_is_dropped():
    """[Note: a write nobody announced]: a clean value changed in place outside the schedule is not lost."""
    values = Values("a", bound=NBYTES)
    values.residency.write_back([values.p["a"]])
    values.tensors["a"].add_(10.0)  # zero_grad(set_to_none=False), clip_grad_value_, a user's write
    values.residency.add(Paged("b", "unit.b", "shard", lambda: [("b", torch.zeros(4))], values.pager, "b"))
    assert values.p["a"].state is States.PAGED_OUT
    values.need("a", ahead=False)
    assert torch.equal(values.tensors["a"], torch.full((4,), 11.0)), "the change was written before the drop"


def test_a_change_in_place_before_a_later_use_is_still_written():
    values = Values("a", bound=None)
    values.need("a", ahead=False)
    values.residency.write_back([values.p["a"]])
    values.tensors["a"].add_(10.0)
    values.need("a", ahead=False)  # used again: the change must not be taken for the tier copy's value
    values.release("a")
    values.release("a")
    values.need("a", ahead=False)
    assert torch.equal(values.tensors["a"], torch.full((4,), 11.0))


def test_a_replaced_value_is_changed_and_no_longer_paged():
    values = Values("ab", bound=None)
    values.need("a", ahead=False)
    values.residency.renew([values.p["a"]])
    values.residency.release([values.p["a"]])
    assert values.states() == "DO", "renewed: its tier copy is of the old value, and the schedule lets it be"


def test_peek_reads_a_value_as_its_next_use_would_see_it_and_pages_nothing():
    values = Values("ab", bound=NBYTES)
    resident, out = values.tensors["b"], values.tensors["a"]
    assert values.states() == "OD"
    assert values.residency.peek(resident) is resident
    copy = values.residency.peek(out)
    assert torch.equal(copy, torch.full((4,), 1.0)) and copy is not out and values.states() == "OD"
    stranger = torch.zeros(4)
    assert values.residency.peek(stranger) is stranger
    values.p["a"].version += 1  # a write that never reached the tier
    with pytest.raises(StaleOffloadCopy, match="parameter 'a' \\(unit 'unit.a', rank 0\\)"):
        values.residency.peek(out)


def test_a_gather_needs_and_reads_its_shards_first_and_releases_them_once_landed():
    values = Values("abc", bound=None)
    seen = []
    start = values.residency.gathering(lambda records: seen.append(("start", list(records), values.states())))
    done = values.residency.gathered(lambda records: seen.append(("done", list(records), values.states())))
    start(["a", "b", "not offloaded"])
    done(["a", "b", "not offloaded"])
    assert seen == [("start", ["a", "b", "not offloaded"], "RRO"), ("done", ["a", "b", "not offloaded"], "RRO")]
    assert values.states() == "OOO"


def test_a_write_back_from_gathered_marks_the_shards_changed_while_resident():
    values = Values("ab", bound=None)
    seen = []
    values.residency.writing(lambda records: seen.append((records, values.states())))(["a"])
    assert seen == [(["a"], "DO")] and values.states() == "OO"
    values.need("a", ahead=False)
    assert values.pager.bytes_written == 3 * NBYTES, "a and b at the start, a again after the write"


def test_shards_written_from_outside_stay_resident_until_settle():
    values = Values("abc", bound=None)
    values.residency.writing_shards(["a", "b", "not offloaded"])
    values.tensors["a"].fill_(7.0)
    assert values.states() == "DDO"
    values.residency.writing_shards([])
    values.residency.end_step()
    assert values.states() == "DDO", "still resident after the step: the next root forward or step settles"
    values.residency.settle()
    assert values.states() == "OOO"
    values.residency.settle()  # nothing left to settle
    values.need("a", ahead=False)
    assert torch.equal(values.tensors["a"], torch.full((4,), 7.0))


def test_closing_hands_every_value_back_and_raises_the_first_failure_after_trying_all():
    values = Values("abc", bound=None)
    values.p["b"].version += 1  # b's tier copy is stale: its page-in fails
    with pytest.raises(StaleOffloadCopy, match="'b'"):
        values.residency.page_in_all()
    assert values.p["a"].state is States.RESIDENT and values.p["c"].state is States.RESIDENT, \
        "c was paged in after b failed"
    assert values.residency.closed and not values.residency._cached


def test_a_lenient_close_raises_nothing():
    values = Values("ab", bound=None)
    values.p["a"].version += 1
    values.residency.page_in_all(strict=False)
    assert values.p["b"].state is States.RESIDENT and values.residency.closed


def test_a_clean_value_paged_in_and_out_again_is_dropped_without_a_write():
    values = Values("a", bound=None)
    written = values.pager.bytes_written
    for _ in range(3):
        values.need("a", ahead=False)
        values.release("a")
    assert values.states() == "O" and values.pager.bytes_written == written, "its tier copy is current"


def test_a_release_goes_on_past_values_not_in_use():
    values = Values("ab", bound=None)
    values.need("b", ahead=False)
    values.residency.release([values.p["a"], None, values.p["b"]])  # a is not in use
    assert values.states() == "OO"


def test_a_value_replaced_while_resident_or_paged_in_ahead_leaves_the_resident_set():
    values = Values("abc", bound=2 * NBYTES)
    assert values.states() == "ODD"
    values.residency.renew([values.p["b"]])
    values.add("d")
    assert values.states() == "ODDD", "b no longer counts: adding d pages nothing out"
    ahead = Values("abc", bound=None)
    ahead.step("a", "b", "c")
    ahead.need("a")  # b comes ahead
    ahead.residency.renew([ahead.p["b"]])
    ahead.release("a")
    ahead.use("c")
    ahead.residency.end_step()
    ahead.need("a")
    assert ahead.states()[2] == "I", "b, replaced, no longer holds the place of the unit ahead"


def test_a_write_back_or_a_load_is_not_part_of_the_recorded_order():
    values = Values("abc", bound=None)
    values.step("a", "b", "c")
    values.residency.writing(lambda records: None)(["c"])  # rt.gathered(writeback=True) before the step
    values.need("a")
    assert values.states() == "RIO", "a is still first in the order, so b comes ahead"
    loaded = Values("abc", bound=None)
    loaded.step("a", "b", "c")
    loaded.residency.writing_shards(["c"])  # a load before the step: c is held until settle
    loaded.need("a")
    assert loaded.states() == "RID"


def test_gathers_through_the_schedule_page_the_next_unit_in_ahead():
    values = Values("abc", bound=None)
    seen = []
    start = values.residency.gathering(lambda records: None)
    done = values.residency.gathered(lambda records: seen.append(records))
    for _ in range(2):
        for unit in "abc":
            start([unit])
            done([unit])
        values.residency.end_step()
    start(["a"])
    assert values.states() == "RIO" and seen[0] == ["a"]


def test_closing_pages_in_the_optimizer_state_too():
    values = Values("a", bound=None)
    state = torch.full((4,), 3.0)
    p = Paged("a", "unit.a", "optim", lambda: [("a-state", state)], values.pager, "a-state")
    values.residency.optim[(1, "a")] = values.residency.add(p)
    assert paged.is_paged_out(state)
    values.residency.page_in_all()
    assert not paged.is_paged_out(state) and torch.equal(state, torch.full((4,), 3.0))


def test_peek_passes_a_paged_out_tensor_it_does_not_own_through():
    values = Values("a", bound=None)
    foreign = torch.zeros(4)
    paged.conceal(foreign)
    assert values.residency.peek(foreign) is foreign
