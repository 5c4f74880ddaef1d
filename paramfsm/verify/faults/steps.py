"""Catalogued bugs around the optimizer step: offloaded steps, whole-parameter optimizers, clipping, refusals.

Each function returns a context manager that patches paramfsm for the duration of the block (see
:mod:`paramfsm.verify.faults.catalogue`). Each one is a silent result ``paramfsm #53`` found in loops from
FSDP2's and DeepSpeed's own tests: a gradient zeroed in place in a bounded resident set read back from its
tier, an offloaded step running the optimizer's hooks once per unit, a shape-dependent optimizer stepped on
flat shards, torch's own clipping over shards clipping each rank by its partial norm, and a write inside
forward dropped at the release; and a subclass's ``super().step()`` stepping every unit a second time. (A refused ``shard()`` that leaves the parameters cut is caught by the saved
reproduction ``tests/reproductions/refused_shard_then_training.py`` and ``tests/test_atomic_refusals.py``: the
broken model fails at setup, where a catalogue entry's reproduction cannot name the check.) ``paramfsm verify``
kills them through the canonical programs of #53
(``Config(optimizer="adafactor", clip_plain=True)``, ``Config(offload="cpu-bounded", zero_grad_to_none=False,
step_hooks=True)``, ``Config(offload="cpu", step_hooks=True, refused_shard=True)`` and ``Config(offload="cpu",
optimizer="subclass")``).
"""

from __future__ import annotations

from paramfsm import optim
from paramfsm.optim import grad_norm, offload_step
from paramfsm.engine.effects import lost_writes
from paramfsm.engine.schedule import residency
from paramfsm.verify.faults.patching import patched


def write_in_forward_dropped():
    """A gathered parameter written in place inside forward is released unchecked: the write reaches only the
    full copy and is dropped (a layer clamping its weight trains on the unclamped one)."""
    return patched(lost_writes, "checked", lambda original: lambda free, recovering, rank: free)


def resident_write_dropped():
    """A resident offloaded value changed in place outside the schedule is paged out as clean: after
    ``zero_grad(set_to_none=False)`` the next backward adds into the tier's copy of the last step's gradient."""
    return patched(residency, "_LEAVING", lambda original: frozenset())


def hooks_per_unit():
    """An offloaded step steps each unit through the optimizer's public ``step()``: its own hooks run once per
    unit (a learning rate decayed in a pre-hook decays once per unit)."""
    def make(original):
        def _step_only(optimizer, saved, ids):
            for group, params in zip(optimizer.param_groups, saved):
                group["params"] = [p for p in params if id(p) in ids]
            offload_step._inner.unit = True
            try:
                optimizer.step()
            finally:
                offload_step._inner.unit = False
        return _step_only
    return patched(offload_step, "_step_only", make)


def whole_params_as_shards():
    """Every optimizer is taken for element-wise: Adafactor steps each rank's flat shard, with an unfactored
    second moment."""
    return patched(optim, "is_elementwise", lambda original: lambda optimizer: True)


def plain_clip_partial():
    """torch's own ``clip_grad_norm_`` over shard gradients computes each rank's partial norm: every rank clips
    by another coefficient."""
    return patched(grad_norm, "_owners", lambda original: lambda: {})  # no tensor is seen as a shard gradient


def parent_step_restores():
    """A parent class's step reached through ``super().step()`` inside the user's step is taken for a new step:
    it puts the emptied groups back and steps every unit again."""
    return patched(offload_step, "within_step", lambda original: lambda optimizer: False)


#: The entries, as the fields of :class:`~paramfsm.verify.faults.catalogue.Fault` (name, bug, source, kind,
#: inject).
STEPS = (
    ("write_in_forward_dropped",
     "an in-place write to a gathered parameter inside forward reaches only the full copy, which is released",
     "paramfsm #53, item 1 (a layer clamping its weight in forward, a MoCo momentum encoder: rt.full_param "
     "still 0.377 where plain torch keeps 0.1; DeepSpeed ZeRO-3 drops such writes the same way)",
     "correctness", write_in_forward_dropped),
    ("resident_write_dropped",
     "a gradient zeroed in place by zero_grad(set_to_none=False) while resident in a bounded tier is paged out "
     "as clean, so the next backward adds into the last step's gradient",
     "paramfsm #53, item 4 (Offload(grads=..., max_resident_bytes=...) with accumulation: 0.43 off plain torch)",
     "correctness", resident_write_dropped),
    ("hooks_per_unit",
     "an offloaded optimizer step runs the optimizer's own step hooks once per unit",
     "paramfsm #53, item 3 (Offload(optimizer='cpu'): a post-hook counting parameters saw [2, 2, 0] where plain "
     "torch sees [4]; DeepSpeed's offloaded optimizer steps its groups apart too)",
     "correctness", hooks_per_unit),
    ("whole_params_as_shards",
     "a shape-dependent optimizer (Adafactor) steps each rank's flat 1-D shard",
     "paramfsm #53, item 2 (one Adafactor step on a sharded Linear(7, 15) 0.035 off plain torch; FSDP2 and "
     "DeepSpeed had to add whole-parameter stepping for Muon)",
     "correctness", whole_params_as_shards),
    ("plain_clip_partial",
     "torch.nn.utils.clip_grad_norm_ over the shards clips each rank by its own partial norm",
     "paramfsm #53, item 5 (5.87 and 5.39 against a true norm of 7.97; Lightning routes around the same trap)",
     "correctness", plain_clip_partial),
    ("parent_step_restores",
     "an optimizer subclass's super().step(), wrapped by torch's hooks, re-enters the offloaded step",
     "paramfsm, found by tests/test_user_paths.py, which passed alone and failed after any test that built a "
     "plain SGD (torch wraps a class's step with its hooks when its first instance is built)",
     "correctness", parent_step_restores),
)
