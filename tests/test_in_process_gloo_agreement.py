"""The gloo transport's size agreement (:mod:`paramfsm.engine.effects.gloo.agreement`), in the test process.

What keeps a desynchronised gloo job from aborting is that every rank reaches
the same verdict on a batch from the same rows, and that a repeating step
stops paying for headers only once the same cycle came twice. Those are plain
functions and one class; the exchanges that carry them run on spawned ranks
(``tests/test_rank_desync_default.py``, ``tests/test_failures.py``).
"""

from __future__ import annotations

import gc

import torch

from paramfsm.engine.effects.gloo import agreement as ag
from paramfsm.engine.effects.gloo.agreement import HEADER, MAGIC, MARK, Agreement, Dropped, Refused

BIG = MARK + 8
#: One exchange with the peer one rank on: a send and a receive of ``n`` bytes each.
def _swap(n: int = BIG) -> tuple:
    return ((True, n, 1), (False, n, 1)),


class Batch:
    """A stand-in for an exchange batch: what the agreement holds weakly."""


def _place(agreement, unit: int, shape=None, kind=ag.GATHER, number=0, step=0, elements=10):
    return agreement.place(Batch(), kind, shape if shape is not None else _swap(), (number, step, unit, elements))


def test_headers_name_the_batch_and_its_sizes():
    assert HEADER == ("named", "kind", "exchanges", "digest", "bytes", "run", "prediction", "number", "step", "unit",
                      "elements")
    assert MARK == 8 * 12
    agreement = Agreement()
    shape = ((True, 100, 1), (False, 100, 1)), ((True, 7, 1),)
    mode, expected, header = agreement.place(Batch(), ag.REDUCE, shape, (4, 2, 3, 25))
    assert (mode, expected) == ("header", None)
    assert header == [1, ag.REDUCE, 2, hash(shape), 107, 0, 0, 4, 2, 3, 25]
    mode, _, unnamed = agreement.place(Batch(), ag.GATHER, _swap(), None)
    assert unnamed == [0, ag.GATHER, 1, hash(_swap()), BIG, 0, 0, -1, -1, -1, -1]


def test_a_cycle_that_repeats_is_announced_as_a_run_then_followed():
    agreement, anchor = Agreement(), Batch()
    for unit in (0, 1, 0, 1):
        assert _place(agreement, unit)[0] == "header"
    mode, expected, header = agreement.place(anchor, ag.GATHER, _swap(), (4, 0, 0, 10))
    assert mode == "header" and expected is None
    unit1 = (ag.GATHER, 1, hash(_swap()), 1, 10)
    assert header[5:7] == [1, hash((unit1,))]  # a run of one batch: unit 1's
    assert len(header) == len(HEADER) and agreement.history[-1].header is header
    assert agreement.anchor() is anchor
    mode, expected, header = _place(agreement, 1, number=5)
    assert mode == "follow" and expected.key == unit1
    assert header[5:7] == [0, 0]
    assert _place(agreement, 0)[0] == "header"  # the run ended; the next cycle is announced again
    del anchor
    gc.collect()
    assert agreement.anchor() is None  # the agreement holds no batch alive


def test_a_batch_other_than_the_announced_one_deviates():
    agreement = Agreement()
    for unit in (0, 1, 0, 1, 0):
        _place(agreement, unit)
    mode, expected, _ = _place(agreement, 2)
    assert mode == "deviate" and expected.key[3] == 1
    _, _, other = _place(agreement, 1, elements=11)
    assert other[5:7] == [0, 0]


def test_a_cycle_that_did_not_repeat_is_no_run():
    agreement = Agreement()
    for unit in (0, 1, 0, 2):
        _place(agreement, unit)
    mode, _, header = _place(agreement, 0)
    assert mode == "header" and header[5:7] == [0, 0]
    assert not agreement.run


def test_a_run_stops_before_a_batch_too_short_for_a_marker():
    agreement = Agreement()
    short = _swap(MARK - 1)
    for unit, shape in ((0, None), (1, None), (2, short), (3, None)) * 2:
        _place(agreement, unit, shape)
    _, _, header = _place(agreement, 0)
    assert header[5] == 1  # unit 1 only: unit 2's messages cannot carry a marker
    assert [entry.key[3] for entry in agreement.run] == [1]
    assert agreement.run[0].marks == {1: (0, 1)}  # its receive carries the marker


def test_a_refusal_starts_a_new_epoch_once_with_no_history():
    agreement = Agreement()
    for unit in (0, 1, 0, 1, 0):
        _place(agreement, unit)
    refused = Refused(torch.zeros(2, len(HEADER), dtype=torch.int64), epoch=0, restart=7)
    assert agreement.observe(refused) is True
    assert agreement.epoch == 1 and agreement.history == [] and agreement.seen == {} and not agreement.run
    assert agreement.anchor is None
    assert agreement.observe(refused) is False and agreement.epoch == 1
    assert agreement.observe(Refused(refused.rows, epoch=1, restart=9)) is True and agreement.epoch == 2
    assert (refused.epoch, refused.restart) == (0, 7)
    assert str(refused).startswith(f"paramfsm: the ranks' exchanges differ (headers {HEADER}: [[0, 0, 0")


def test_a_long_history_starts_afresh():
    agreement = Agreement()
    for unit in range(ag._HISTORY - 1):
        _place(agreement, unit)
    assert len(agreement.history) == ag._HISTORY - 1
    _place(agreement, -1)
    assert agreement.history == [] and agreement.seen == {}


def test_marks_are_read_from_each_peer_s_first_receive_long_enough():
    shape = (((True, BIG, 1), (False, 8, 1), (False, BIG, 2)),
             ((False, BIG, 1), (False, BIG, 2), (True, BIG, 3), (False, MARK, 3)))
    assert ag.marks(shape) == {2: (0, 2), 1: (1, 0), 3: (1, 3)}
    assert ag.marks((((True, BIG, 1),),)) == {}


def _row(named=1, sizes=(1, 1, 5, 80, 0, 0), fields=(3, 1, 2, 10)):
    return [named, *sizes, *fields]


def test_every_rank_agrees_only_on_the_same_sizes_and_named_fields():
    own = _row()
    assert ag.agree([own, _row()], 0)
    assert not ag.agree([own, _row(sizes=(1, 1, 5, 88, 0, 0))], 0)
    assert not ag.agree([own, _row(sizes=(1, 1, 5, 80, 2, 9))], 1)
    assert not ag.agree([own, _row(fields=(3, 1, 4, 10))], 0)
    assert ag.agree([own, _row(named=0, fields=(-1, -1, -1, -1))], 0)  # a full tensor's gather: sizes only
    assert ag.agree([_row(named=0), own, _row(fields=(9, 9, 9, 9))], 1)


def test_a_stand_in_s_marker_is_read_from_the_end_of_what_was_received():
    header = [1, 2, 1, -5, 400, 0, 0, 7, 3, 2, 100]
    mark = torch.tensor([MAGIC, *header], dtype=torch.int64).view(torch.uint8)
    received = torch.zeros(200, dtype=torch.uint8)
    received[-MARK:] = mark
    assert ag.read_marker(received) == header
    assert ag.read_marker(torch.zeros(200, dtype=torch.uint8)) is None
    floats = torch.zeros(50, dtype=torch.float32)
    floats.view(torch.uint8)[-MARK:] = mark
    assert ag.read_marker(floats) == header


def test_the_rows_put_each_peer_s_marker_in_its_place():
    own, other = [0] * len(HEADER), [9] * len(HEADER)
    seen = {1: [1] * len(HEADER), 2: None}
    rows = ag.rows_of(seen, own, other, rank=1, world=4)
    assert rows.dtype == torch.int64
    assert rows.tolist() == [other, own, [1] * len(HEADER), other]


def test_a_dropped_exchange_says_what_to_do():
    message = str(Dropped())
    assert message.startswith("paramfsm: this collective never ran: the ranks desynced at an earlier one")
    assert "What to do: fix that desync; rt.reset() (or the next forward) drops what was left in flight." in message


def test_a_job_without_participants_takes_the_defaults():
    job = ag.Job(("op",), None)
    assert (job.group, job.rank, job.kind, job.peers, job.shape) == (None, 0, 0, None, None)
    assert job.ops == ("op",) and job.batch is None and job.checks == () and not job.posted.done()
    who = ag.Job((), ("g", 1, ag.REDUCE, {0: 0}, _swap()))
    assert (who.group, who.rank, who.kind, who.peers, who.shape) == ("g", 1, ag.REDUCE, {0: 0}, _swap())
