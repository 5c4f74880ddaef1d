"""A bucket's exchanges are handed to the exchange thread together (paramfsm.engine.effects.gloo.exchange).

The gather side posts each in-place all-gather and the packed rest inside
``coalesced()``: the thread must receive them as one submission, in the
order they were made, each with its own result; outside the block every
submission goes at once, as before. (The gathers themselves are checked
against plain torch in tests/test_gather_in_place.py.)
"""

from __future__ import annotations

import threading

from paramfsm.engine.effects.gloo import exchange


class _Recording(exchange._Issuer):
    """An issuer whose hand-overs are recorded; the thread still posts them."""

    def __init__(self):
        super().__init__()
        self.handed: list[int] = []

    def _hand_over(self, jobs):
        self.handed.append(len(jobs))
        super()._hand_over(jobs)


def test_coalesced_exchanges_are_handed_over_once_in_order():
    issuer = _Recording()
    posted = []
    lock = threading.Lock()

    def post(tensor, peer, group, tag):
        with lock:
            posted.append(tag)
        return f"work {tag}"

    with issuer.coalesced():
        futures = [issuer.submit([(post, None, 1, None, tag)]) for tag in range(5)]
        assert issuer.handed == [] and posted == []  # nothing goes before the block ends
    assert issuer.handed == [5]
    assert [f.result(timeout=10) for f in futures] == [[f"work {tag}"] for tag in range(5)]
    assert posted == list(range(5))
    alone = issuer.submit([(post, None, 1, None, 9)])  # outside a block: handed over at once
    assert alone.result(timeout=10) == ["work 9"] and issuer.handed == [5, 1]


def test_a_failed_post_fails_only_its_own_exchange():
    issuer = _Recording()

    def post(tensor, peer, group, tag):
        if tag == 1:
            raise RuntimeError("peer gone")
        return tag

    with issuer.coalesced():
        with issuer.coalesced():  # nested: handed over with the outer block
            futures = [issuer.submit([(post, None, 1, None, tag)]) for tag in range(3)]
    assert issuer.handed == [3]
    assert futures[0].result(timeout=10) == [0] and futures[2].result(timeout=10) == [2]
    assert isinstance(futures[1].exception(timeout=10), RuntimeError)
