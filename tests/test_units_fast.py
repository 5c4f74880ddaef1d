"""In-process tests of the pure pieces the multi-rank suite only reaches through workers.

``grad_norm`` at world 1 (the all-reduce is the only part left out; the
multi-rank clip tests cover it) against ``torch.nn.utils.clip_grad_norm_``,
and ``plan`` bucketing and re-recording. Fast enough for mutation testing
(``make mutate``), which only sees code that runs in the test process.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from paramfsm.optim import grad_norm
from paramfsm.engine.schedule.plan import Plan
from paramfsm.errors import ParamFSMError


def _shards(seed: int, sparse: bool = False):
    gen = torch.Generator().manual_seed(seed)
    shards = []
    for n in (7, 1, 13, 5):
        s = torch.nn.Parameter(torch.zeros(n))
        g = torch.randn(n, generator=gen)
        if sparse:
            g[::2] = 0
        s.grad = g
        shards.append(s)
    shards.append(torch.nn.Parameter(torch.zeros(3)))  # no gradient: ignored, as torch ignores it
    return shards


@pytest.mark.parametrize("norm_type", [0.0, 0.5, 1.0, 2.0, 3.0, math.inf])
@pytest.mark.parametrize("max_norm", [0.1, 1e6], ids=["clips", "leaves"])
def test_clip_matches_torch(norm_type, max_norm):
    ours, theirs = _shards(0, sparse=True), _shards(0, sparse=True)
    if norm_type == 0.0:
        theirs[1].grad.zero_()  # a parameter whose gradient is all zero: torch's 0-norm does not count it
        ours[1].grad.zero_()
    total = grad_norm.clip_grad_norm_(ours, max_norm, norm_type)
    expected = torch.nn.utils.clip_grad_norm_(theirs, max_norm, norm_type)
    assert torch.allclose(total, expected, rtol=1e-6), (total, expected)
    for a, b in zip(ours, theirs):
        if a.grad is not None:
            assert torch.allclose(a.grad, b.grad, rtol=1e-6, atol=1e-9)


def test_clip_nonfinite():
    shards = _shards(1)
    shards[0].grad[0] = float("inf")
    with pytest.raises(ParamFSMError) as info:
        grad_norm.clip_grad_norm_(shards, 1.0, error_if_nonfinite=True)
    assert str(info.value) == ("the total norm of order 2.0 of the gradients is not finite "
                               "(clip_grad_norm_ was called with error_if_nonfinite=True)")
    assert not math.isfinite(float(grad_norm.clip_grad_norm_(_inf_shards(), 1.0)))


def _inf_shards():
    shards = _shards(2)
    shards[2].grad[3] = float("inf")
    return shards


def test_clip_without_gradients_is_zero():
    empty = [torch.nn.Parameter(torch.zeros(3))]
    assert float(grad_norm.clip_grad_norm_(empty, 1.0)) == 0.0
    assert float(grad_norm.clip_grad_norm_(empty, 1.0, norm_type=math.inf)) == 0.0


def _units(*nbytes):
    return [SimpleNamespace(index=i, nbytes=n) for i, n in enumerate(nbytes)]


def test_plan_cuts_buckets_at_the_byte_bound():
    units = _units(40, 40, 40, 100, 10)
    plan = Plan([0, 1, 2, 3, 4], units, bucket_bytes=100)
    assert [[u.index for u in b] for b in plan.buckets] == [[0, 1], [2], [3], [4]]
    assert [plan.bucket_index(u) for u in units] == [0, 0, 1, 2, 3]
    exact = Plan([0, 1, 4], units, bucket_bytes=90)
    assert [[u.index for u in b] for b in exact.buckets] == [[0, 1, 4]]


def test_plan_follows_the_recorded_order_once_per_unit():
    units = _units(10, 10, 10)
    plan = Plan([2, 0, 2, 1], units, bucket_bytes=15)
    assert [[u.index for u in b] for b in plan.buckets] == [[2], [0], [1]]
    assert plan.order == (2, 0, 2, 1)


def test_plan_is_re_recorded_only_when_the_order_changes():
    units = _units(10, 10, 10)
    plan = Plan([0, 1, 2], units, bucket_bytes=100)
    assert plan.updated([0, 1, 2]) is plan and plan.updated([]) is plan
    changed = plan.updated([2, 1])
    assert changed is not plan and changed.order == (2, 1)
    assert changed.bucket_index(units[0]) is None
    assert [[u.index for u in b] for b in changed.buckets] == [[2, 1]]


def test_clip_defaults_to_the_two_norm():
    ours, theirs = _shards(3), _shards(3)
    assert torch.allclose(grad_norm.clip_grad_norm_(ours, 0.1), torch.nn.utils.clip_grad_norm_(theirs, 0.1))
