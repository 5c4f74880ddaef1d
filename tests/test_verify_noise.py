"""verify's tolerance comes from plain torch's own noise: two references, two valid summation orders.

The checker runs a second plain-torch reference that computes the same math in another order
(``Mirror(rank_order=True)``: each slice's backward on its own, in rank order). A difference from the
reference is allowed ``NOISE_FACTOR`` times the spread between the two references on top of the fixed
tolerances, and a failure says how far outside that allowance it is.
"""

from __future__ import annotations

import torch
from torch import nn

from paramfsm.verify import checks
from paramfsm.verify.mirror import Mirror
from paramfsm.verify.ops import Backward, Forward, Loss
from paramfsm.verify.subject import Subject


def test_a_difference_within_the_noise_passes_and_one_outside_says_how_far():
    want = torch.tensor([1.0, 2.0, 3.0])
    other = want + torch.tensor([0.0, 2e-4, 0.0])  # the second reference: plain torch's spread is 2e-4
    noise = checks.spread(want, other)
    assert noise == torch.tensor(2e-4).item() or abs(noise - 2e-4) < 1e-7
    within = want + 5e-4  # over atol, but inside NOISE_FACTOR x the spread
    assert checks.close(within, want, 1e-5 + checks.NOISE_FACTOR * noise, 0.0) is None
    assert checks.close(within, want, 1e-5, 0.0) is not None  # the fixed tolerance alone would cry wolf
    far = want + 0.5
    diff = checks.close(far, want, 1e-5 + checks.NOISE_FACTOR * noise, 0.0)
    assert diff is not None
    message = checks.allowance(diff, 1e-5, noise)
    assert "plain torch's own noise" in message and "times the allowance" in message
    assert float(message.rsplit(": ", 1)[1].split()[0]) > 100  # 0.5 against 8e-4: hundreds of times outside


def test_the_two_references_agree_to_rounding_and_differ_only_by_order(monkeypatch):
    """One backward of a batch split in three slices: the noise reference's gradients are the reference's up to
    rounding (the same math), and not bit for bit a copy of its arithmetic."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 64))
    subject = Subject(model, lambda g, n: (torch.randn(n, 64, generator=g), torch.randn(n, 64, generator=g)),
                      lambda out, y: (out - y).pow(2).mean())
    first, second = Mirror(subject, 3), Mirror(subject, 3, rank_order=True)  # 1/3 is not exact in binary
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(63, 64, generator=gen) * 30, torch.randn(63, 64, generator=gen)
    slices = {0: (list(x.chunk(3)), list(y.chunk(3)))}
    for mirror in (first, second):
        for op in (Forward(0, 0, "train"), Loss(0, 0, 0, 0), Backward(0, False, False)):
            mirror.apply(op, slices)
    spreads = [checks.spread(p.grad, second.params[name].grad) for name, p in first.params.items()]
    assert 0 < max(spreads) < 1e-4, spreads  # the same gradients, rounded differently
    for name, p in first.params.items():
        torch.testing.assert_close(p.grad, second.params[name].grad, atol=1e-4, rtol=1e-4)
