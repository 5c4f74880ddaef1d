"""An fp16 overflow followed by a clip: the NaN total norm reaches the padding of the shard gradients.

On gan_pair at 2 ranks, a scaled backward of ``out.pow(2).mean()`` (outputs near -34, scale 1024) overflows
fp16 in paramfsm and in plain torch alike: the same elements are inf or NaN on both sides, and the total
norm of the following ``clip_grad_norm_`` is NaN on both. The clip's NaN coefficient then turns the zeros
padding each shard gradient into NaN (``0 * nan``) while every real element is NaN anyway; the reference
check models that padding and the program passes.
"""

from __future__ import annotations

import torch

from paramfsm.verify.mirror import Mirror
from paramfsm.verify.ops import (
    Backward, Clip, Config, Drop, Forward, Loss, Program, Step, SubForward, Unscale, ZeroGrad,
)
from paramfsm.verify.runner import Options, run_program
from paramfsm.verify.subject import global_batch, load_subject, split

GAN = "paramfsm.testing.subjects:gan_pair"
FP16 = Config(param_dtype="float16")
#: Found by ``paramfsm verify``: a clip, a discriminator step on a retained graph, then a forward whose
#: scaled backward overflows and a clip whose total norm is NaN (op 21).
OVERFLOW_THEN_CLIP = (
    Forward(0, 0, "train"), Loss(0, 0, 0, 0), Backward(0, False, False), Unscale(), Clip(0.05, 2.0),
    Forward(1, 0, "train"), ZeroGrad(), SubForward(2, "disc", 1, False, False), Loss(1, 2, 0, 3),
    Backward(1, True, False), Step(), ZeroGrad(), SubForward(3, "disc", 1, False, False), Loss(2, 3, 0, 3),
    Drop(3, (2,)), Drop(2, (1,)), Drop(1, ()), Forward(4, 0, "train"), Loss(3, 4, 0, 1),
    Backward(3, False, False), Unscale(), Clip(0.05, 2.0), Drop(0, (0,)), Drop(4, (3,)))


def test_the_program_clips_with_a_nan_norm_in_plain_torch():
    """The reference overflows too: its last clip sees a NaN total norm, and no gradient stays finite."""
    subject = load_subject(GAN, 0)
    mirror = Mirror(subject, 2, FP16)
    slices = {b: tuple(split(part, 2) for part in global_batch(subject, b, 0, 2, 2)) for b in range(4)}
    for op in OVERFLOW_THEN_CLIP[:22]:
        mirror.apply(op, slices)
    assert torch.isnan(mirror.norm)
    assert all(g.isnan().all() for g in mirror.grads().values())


def test_an_overflow_then_a_clip_passes_every_check_on_2_ranks(ranks2):
    outcomes = ranks2.run(run_program, GAN, Program(FP16, OVERFLOW_THEN_CLIP), Options())
    for rank, outcome in enumerate(outcomes):
        assert not outcome.failed and not outcome.kind, (rank, outcome.kind, outcome.op, outcome.message[:600])
