"""Helpers verify's training-loop ops share: the runner, the plain-torch reference and saved reproductions.

* :data:`SCALER`, :func:`compute_dtype` and :func:`tolerances`: what a
  program's :class:`~paramfsm.verify.ops.Config` means for mixed precision.
* :func:`reshard_policy`: a configuration's ``reshard_after_forward``.
* :func:`reentrant_blocks`: per-block reentrant activation checkpointing of
  any model, for the duration of one forward.
* :func:`perturbed`: the state dict a round trip loads when it must change
  something (the Save and Restore ops are :mod:`paramfsm.verify.state_ops`).
* :func:`force_overflow`: a forced fp16 overflow in one element of one
  gradient, on the one rank whose shard holds it.
* :func:`scratch_dir`: one temporary folder for a DCP checkpoint, the same on
  every rank.
"""

from __future__ import annotations

import contextlib
import logging
import math
import tempfile
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

import paramfsm
from paramfsm.errors import ArgumentError
from paramfsm.sharding.offload import Offload

#: The loss scaler of fp16 programs, in paramfsm (``paramfsm.amp.GradScaler``) and in the reference
#: (``torch.amp.GradScaler``): a small initial scale that grows every second step, so a program of a few
#: steps both grows and (with a forced or a real overflow) backs off.
SCALER = {"init_scale": 1024.0, "growth_interval": 2}

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}

#: (atol, rtol) for programs that compute in a low precision. The reference repeats paramfsm's arithmetic
#: (see :class:`~paramfsm.verify.mirror.Mirror`) except for the order in which ranks' gradients are summed,
#: so values agree to fp32 rounding until a difference of one ulp flips a rounding to the compute dtype; the
#: tolerance allows a few such flips (bf16 keeps 8 significant bits, fp16 11). Under fp16 the gradients are
#: compared scaled (by 1024 or more) until unscaled, and a backward adds scaled gradients to unscaled ones
#: left by a step, so one flipped ulp of a scaled element (2**-6 at 16 to 32) can stand beside a small sum:
#: the absolute tolerance covers it (seen on experts_lm: differences of exactly 2**-7 and 2**-6).
MIXED_TOLERANCES = {"bfloat16": (1e-2, 1e-2), "float16": (2e-2, 2e-3)}


def compute_dtype(config) -> torch.dtype | None:
    """The ``param_dtype`` a program's configuration asks for (None: compute in the parameters' dtype)."""
    return DTYPES[config.param_dtype] if config.param_dtype else None


def tolerances(subject, config) -> tuple[float, float]:
    """(atol, rtol) for comparing with the reference: the subject's, loosened for low-precision compute."""
    atol, rtol = subject.tolerances()
    if config.param_dtype:
        low_atol, low_rtol = MIXED_TOLERANCES[config.param_dtype]
        atol, rtol = max(atol, low_atol), max(rtol, low_rtol)
    return atol, rtol


def unit_arguments(subject, config) -> dict:
    """The ``units=`` and ``min_unit_bytes=`` of ``shard()`` for a program's unit choice (see
    :data:`paramfsm.verify.ops.UNIT_CHOICES`)."""
    from paramfsm.engine.storage.default_units import MIN_UNIT_BYTES
    from paramfsm.engine.storage.units import by_size
    from paramfsm.verify.ops import BY_SIZE_BYTES

    choice = config.units
    if choice == "one":
        return {"units": one_unit, "min_unit_bytes": None}
    if choice == "by_size":
        return {"units": by_size(min_bytes=BY_SIZE_BYTES), "min_unit_bytes": None}
    size = {"default": subject.min_unit_bytes, "per_module": 0, "merged": MIN_UNIT_BYTES}[choice]
    return {"units": subject.units, "min_unit_bytes": size}


def one_unit(name, module) -> bool:
    """The ``units=`` predicate that makes the whole model one unit (the root)."""
    return False


class _ExpectedRecovery(logging.Filter):
    """Drops the notices of the recoveries verify causes on purpose (an :class:`~paramfsm.verify.ops.Interrupted`
    op's, the reset after an accepted ``RankDesync``), and holds back every notice naming a flight-recorder
    dump until the program ends (:func:`quiet_recoveries`)."""

    def __init__(self):
        super().__init__()
        self.held: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "resetting gathered parameters" in message or " interrupted on rank " in message:
            return False
        if any(isinstance(arg, Path) for arg in record.args or ()):
            self.held.append(record)
            return False
        return True


#: The loggers of a recovery's notices: the scheduler's reset, the flight recorder's dump.
_RECOVERY_LOGGERS = ("paramfsm.engine.schedule.scheduler", "paramfsm.engine.schedule.flight")


@contextlib.contextmanager
def quiet_recoveries():
    """Within the block, a recovery's notices are not printed (a program whose interruptions are expected).

    [Note: a passing verify names no file it removed]
    A flight-recorder dump is written, and its notice logged, where the error is
    raised: before the checker knows whether the outcome is accepted (every rank
    raised ``RankDesync``, or refused a write inside forward) or a failure. An
    accepted outcome removes its dumps, so its notice would name a file that is
    gone. The notices are held back until the program ends and then printed for
    the dumps that are still there: a failure's, which its report names.
    """
    quiet = _ExpectedRecovery()
    for name in _RECOVERY_LOGGERS:
        logging.getLogger(name).addFilter(quiet)
    try:
        yield
    finally:
        for name in _RECOVERY_LOGGERS:
            logging.getLogger(name).removeFilter(quiet)
        for record in quiet.held:
            if all(arg.exists() for arg in record.args if isinstance(arg, Path)):
                logging.getLogger(record.name).handle(record)


def forget_recoveries(rt) -> None:
    """Remove the flight-recorder dumps of the recoveries after an expected interruption (an
    :class:`~paramfsm.verify.ops.Interrupted` op): verify leaves nothing behind for an accepted outcome."""
    for path in [path for path in rt.flight.dumps if path.name.endswith("-interrupted.jsonl")]:
        path.unlink(missing_ok=True)
        rt.flight.dumps.remove(path)


def reshard_policy(config):
    """The ``reshard_after_forward`` argument of a program's configuration: True, False, or a predicate that
    keeps the named units (``""``: the root) from their forward to their backward."""
    kept = config.reshard_after_forward
    if isinstance(kept, bool):
        return kept
    return lambda name, module: name not in kept


def offload_policy(subject, config, world: int):
    """The ``offload`` argument of a program: the subject's own (``Subject(offload=...)``), else the
    configuration's tier for the shards (on two or more ranks: one rank's parameters are views of their
    shards) and the optimizer state. A disk tier gets a new folder of this rank's, returned to be removed."""
    if subject.offload is not None:
        return subject.offload, None
    if config.offload is None:
        return None, None
    if config.offload == "cpu-bounded":  # about a third of the offloaded values fit: paging between uses
        bound = sum(-(-p.numel() // world) * p.element_size() for p in subject.model.parameters())
        return Offload(params="cpu" if world > 1 else None, optimizer="cpu", grads="cpu",
                       max_resident_bytes=bound), None
    folder = tempfile.mkdtemp(prefix="paramfsm-verify-offload-") if config.offload == "disk" else None
    return Offload(params=config.offload if world > 1 else None, optimizer=config.offload, grads=config.offload,
                   path=folder), folder


def refused_shard(model, group=None) -> None:
    """``shard()`` with an offload bound below one unit (``Config.refused_shard``): it must raise
    ``ArgumentError`` and leave ``model`` as it was, trainable and shardable again (paramfsm #53, item 6)."""
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    try:
        paramfsm.shard(model, group=group, offload=Offload(optimizer="cpu", grads="cpu", max_resident_bytes=1))
    except ArgumentError:
        left = {name: tuple(p.shape) for name, p in model.named_parameters()}
        broken = [name for name in shapes if left.get(name) != shapes[name]]
        if broken:  # every rank alike: the refusal is deterministic
            raise AssertionError(f"the refused shard() left parameter '{broken[0]}' with shape {left.get(broken[0])}"
                                 f", not {shapes[broken[0]]}") from None
        return
    raise AssertionError("shard(offload=Offload(max_resident_bytes=1)) did not refuse the bound")


class AnotherRun:
    """A second training run on this machine whose tier shares the program's offload folder (:func:`another_run`).

    :meth:`step` trains it one more step (after each of the program's optimizer steps, when the program's
    runtime has just written its tier); :meth:`close` ends it. Without a disk tier both do nothing."""

    def __init__(self, model=None, rt=None, groups=()):
        self.model, self.rt, self.groups = model, rt, groups
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-3) if model is not None else None
        self.steps = 0
        if rt is not None:
            _OPEN.add(self)

    def step(self) -> None:
        if self.rt is None:
            return
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.steps)
            self.model(torch.randn(4, 16)).pow(2).mean().backward()
        self.opt.step()
        self.opt.zero_grad()
        self.steps += 1

    def close(self, *, strict: bool = True) -> None:
        """End the run: ``rt.close()``, or (``strict=False``, the harness after a program failed, when the
        fault that made it fail may break this run too) ``rt.detach()``, which raises nothing."""
        if self.rt is None:
            return
        rt, self.rt = self.rt, None
        _OPEN.discard(self)
        rt.close() if strict else rt.detach()
        for group in self.groups:
            if group is not None and group != dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(group)


#: Runs not closed yet: a reproduction whose check fails stops before its ``neighbour.close()``.
_OPEN: weakref.WeakSet = weakref.WeakSet()


def close_left_open() -> None:
    """Detach every other run still open (its runtime's page-in threads and its group go with it)."""
    for run in list(_OPEN):
        run.close(strict=False)


def another_run(offload, rank: int, world: int) -> AnotherRun:
    """A second run in the folder of ``offload``'s disk tier, trained one step now (a no-op run without one).

    Two runs on one machine may be pointed at one folder; each must keep to its own file (see [Note: one
    file per rank and run] in paramfsm.engine.storage.tiers). This one is a small model on a process group
    of this rank alone (so it issues no collective the program's ranks would have to pair), with its
    optimizer state on disk in the same folder. It trains after each of the program's
    optimizer steps (:meth:`AnotherRun.step`), so it writes its tier after the program's runtime has written
    its own: a run that reused the other's file would read values it never wrote. The global random state
    is left as it was.
    """
    if not isinstance(offload, Offload) or offload.path is None:
        return AnotherRun()
    import paramfsm

    groups = [dist.new_group([r]) for r in range(world)]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1234 + rank)
        model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))
    rt = paramfsm.shard(model, group=groups[rank], trace=0,
                        offload=Offload(optimizer="disk", path=offload.path))
    run = AnotherRun(model, rt, groups)
    run.step()
    return run


def default_blocks(model: nn.Module) -> tuple[str, ...]:
    """The children of the model's first ``nn.ModuleList`` (a transformer's layers), or none."""
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module):
            return tuple(f"{name}.{child}" if name else child for child, _ in module.named_children())
    return ()


class _Reentrant(nn.Module):
    """Runs a block under ``checkpoint(block, ..., use_reentrant=True)``, calling the block itself.

    The block is called as a module (not its bare ``forward``), so its hooks,
    and paramfsm's unit hooks, run in the forward and again in the
    recomputation inside backward, as with Hugging Face's gradient
    checkpointing or torch's ``checkpoint_wrapper``.

    Keyword arguments (Hugging Face passes ``attention_mask``,
    ``encoder_attention_mask``, ``use_cache``, ... to its blocks) are passed
    on: reentrant checkpointing takes positional inputs only, so their values
    ride after the positional ones and the block gets them back by name. A
    tensor among them that requires grad is then an input of the checkpoint
    like any other and gets its gradient.
    """

    def __init__(self, block: nn.Module):
        super().__init__()
        object.__setattr__(self, "block", block)  # not a submodule: the model's names stay unchanged

    def forward(self, *args, **kwargs):
        names, positional = tuple(kwargs), len(args)

        def run(*inputs):
            return self.block(*inputs[:positional], **dict(zip(names, inputs[positional:])))

        return checkpoint(run, *args, *kwargs.values(), use_reentrant=True)


@contextlib.contextmanager
def reentrant_blocks(model: nn.Module, names):
    """Within the block, each named submodule of ``model`` runs under reentrant activation checkpointing.

    Each block is swapped for a wrapper in its parent for the duration of the
    ``with`` (one forward) and put back afterwards; the recomputation in a
    later backward still runs the block (the autograd graph keeps it).

    A Hugging Face model whose config turns on its key/value cache
    (``use_cache``) runs without it inside the ``with``, as under its own
    gradient checkpointing: the recomputation would append the block's keys
    and values to the cache a second time and attend over both.
    """
    swapped = []
    config = getattr(model, "config", None)
    cached = getattr(config, "use_cache", None) is True
    try:
        if cached:
            config.use_cache = False
        for name in names:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            block = parent._modules[child]
            parent._modules[child] = _Reentrant(block)
            swapped.append((parent, child, block))
        yield
    finally:
        for parent, child, block in reversed(swapped):
            parent._modules[child] = block
        if cached:
            config.use_cache = True


def perturbed(state_dict: dict) -> dict:
    """A state dict whose floating-point values all differ from ``state_dict``'s.

    Every key gets a tensor of its own: the keys of a tied parameter hold
    equal values in distinct tensors, as in a state dict copied or converted
    key by key (``{k: v.to(dtype)}``), which a load must accept.
    """
    return {key: value * 0.75 + 0.125 if value.is_floating_point() else value.clone()
            for key, value in state_dict.items()}


def force_overflow(rt, name: str, index: int) -> None:
    """An inf in element ``index`` of ``name``'s flattened gradient: only the rank whose shard holds it writes it."""
    rec = rt.record(name)
    owner = index // rec.shard_numel
    if rt.rank == owner:
        if rec.shard.grad is None:
            rec.shard.grad = torch.zeros_like(rec.shard)
        rec.shard.grad[index - owner * rec.shard_numel] = math.inf


def overflow_reference(param: torch.Tensor, index: int) -> None:
    """The same forced overflow in the reference's full gradient."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    param.grad.view(-1)[index] = math.inf


def scratch_dir(group=None) -> str:
    """A new temporary folder made by rank 0 of ``group`` and named to every rank (collective)."""
    name = [tempfile.mkdtemp(prefix="paramfsm-verify-dcp-") if dist.get_rank(group) == 0 else None]
    dist.broadcast_object_list(name, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    return name[0]
