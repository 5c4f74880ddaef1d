"""The errors paramfsm raises. Each one reads like help: what happened, to what, and what to do.

All derive from :class:`ParamFSMError` so a training loop can catch the family.
The constructors take the facts as keyword arguments and keep them as
attributes, so tests and the command line read the facts instead of parsing messages.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any, Sequence


class ParamFSMError(RuntimeError):
    """Base class of every error raised by paramfsm."""


class ArgumentError(ParamFSMError, ValueError):
    """An argument of a paramfsm call has a value it cannot take (a number out of range, a ``units=``
    entry that matches nothing): names the argument and what it takes. Raised before anything changes."""


class ArgumentTypeError(ParamFSMError, TypeError):
    """An argument of a paramfsm call has a type it cannot take: names the argument and what it takes.
    Raised before anything changes."""


class SpecError(ParamFSMError):
    """A lifetime spec file is malformed: names the file, the entry and the reason."""

    def __init__(self, file: str, entry: str, reason: str):
        self.file, self.entry, self.reason = str(file), entry, reason
        super().__init__(f"{self.file}: {entry}: {reason}")


class IllegalTransition(ParamFSMError):
    """An event arrived in a state where the spec forbids it (or has no row for it).

    The parameter's state is unchanged when this is raised.
    """

    def __init__(
        self,
        *,
        param: str,
        unit: str,
        state: str,
        event: str,
        rank: int,
        reason: str,
        holds: int = 0,
        history: Sequence[Any] = (),
        hint: str = "",
    ):
        self.param, self.unit, self.state, self.event = param, unit, state, event
        self.rank, self.reason, self.holds = rank, reason, holds
        self.history = tuple(history)
        lines = [
            f"illegal transition on rank {rank}: event '{event}' in state {state} "
            f"for parameter '{param}' (unit '{unit}', holds={holds}): {reason}.",
        ]
        if self.history:
            lines.append("last events that touched this parameter (oldest first):")
            lines.extend(f"  {h}" for h in self.history)
        lines.append(
            hint
            or "What to do: this is a lifetime bug in the training loop or in paramfsm. "
            "Re-run with paramfsm.shard(..., trace=True), dump rt.trace and run "
            "`paramfsm trace check` on it to see the full sequence."
        )
        super().__init__("\n".join(lines))


class RankDesync(ParamFSMError):
    """Ranks issued collectives in different orders; raised instead of hanging."""

    def __init__(self, *, rank: int, unit: str, step: int, detail: str, advice: str = ""):
        self.rank, self.unit, self.step, self.detail = rank, unit, step, detail
        super().__init__(
            f"rank desync detected on rank {rank} at step {step}, unit '{unit}': {detail}. "
            "What to do: every rank must run the same modules in the same order "
            "(data-dependent branches must agree across ranks); make branch decisions "
            "from values that are identical on all ranks" + (f", or {advice}" if advice else ".")
        )


class CollectiveTimeout(ParamFSMError):
    """A wait on a collective passed its limit: a peer rank is stalled, dead, or on another code path."""

    def __init__(self, *, collective: str, unit: str, step: int, rank: int, waited_s: float, limit_s: float):
        self.collective, self.unit, self.step, self.rank = collective, unit, step, rank
        self.waited_s, self.limit_s = waited_s, limit_s
        super().__init__(
            f"collective timeout on rank {rank} at step {step}: {collective} for unit '{unit}' did not "
            f"complete within {limit_s:g}s (waited {waited_s:.1f}s). What to do: another rank is stalled, "
            "dead or running a different program; read its log and its flight-recorder dump "
            "(paramfsm trace diff compares two ranks' dumps). If a peer is only slow (a long data load, a "
            "checkpoint), raise the limit: paramfsm.shard(..., collective_timeout=SECONDS) or "
            "PARAMFSM_COLLECTIVE_TIMEOUT."
        )


class NotInitialized(ParamFSMError):
    """torch.distributed is not initialised and no process group was given."""


class NotGathered(ParamFSMError):
    """A partitioned parameter was used while only this rank's shard is present.

    Raised by the placeholder of a parameter that is NOT_AVAILABLE (see
    :mod:`paramfsm.engine.storage.placeholder`) when an operation reads it outside its unit's
    forward or backward.
    """

    def __init__(self, *, param: str, unit: str, rank: int, op: str, grad: bool = False):
        self.param, self.unit, self.rank, self.op = param, unit, rank, op
        if grad:
            super().__init__(
                f"the gradient of parameter '{param}' (unit '{unit}') lives on rank {rank}'s shard: {op} would "
                "read this rank's slice as if it were the whole gradient. What to do: read the full gradient "
                f"with rt.full_grad('{param}') (collective), clip with rt.clip_grad_norm_(max_norm) (the global "
                "norm over all ranks), or work on the shards (rt.shard_parameters()). Zeroing, clamping "
                "(clip_grad_value_) and optimizer steps through model.parameters() work as they are.")
            return
        super().__init__(
            f"parameter '{param}' (unit '{unit}') is not gathered on rank {rank}: {op} was used on it "
            "outside its unit's forward/backward, where paramfsm keeps only this rank's shard. "
            f"What to do: read a full copy with rt.full_param('{param}') (collective: every rank calls it), "
            "or use it in place inside `with rt.gathered(module):` (collective). If another unit's forward "
            "uses it, make both modules one unit (paramfsm.shard(..., units=...)). "
            "State dicts come from rt.full_state_dict() or rt.sharded_state_dict()."
        )


class ModelMismatch(ParamFSMError):
    """The ranks hold models with different parameters (names, shapes, dtypes or tying); raised by
    ``paramfsm.shard`` on every rank (see :mod:`paramfsm.sharding.rank_agreement`)."""


class UnsyncedGradients(ParamFSMError):
    """Something needs the synchronised gradients while this rank still holds unsynchronised ones.

    Raised by an optimizer step, ``rt.clip_grad_norm_``, a GradScaler's ``unscale_``, ``rt.full_grad``
    and ``rt.close()`` after backward passes under ``rt.no_sync()`` (see :mod:`paramfsm.engine.effects.grad_sync`).
    """

    def __init__(self, *, param: str, unit: str, rank: int, what: str, detail: str):
        self.param, self.unit, self.rank, self.what = param, unit, rank, what
        super().__init__(f"{what}: the gradient of parameter '{param}' (unit '{unit}', rank {rank}) {detail}")


class ModelChanged(ParamFSMError):
    """A parameter of a sharded model was added, replaced or deleted after ``paramfsm.shard()``
    (see :mod:`paramfsm.sharding.model_changes`); raised at the next forward."""

    def __init__(self, *, param: str, module: str, rank: int, what: str):
        self.param, self.module, self.rank, self.what = param, module, rank, what
        super().__init__(
            f"parameter '{param}' (module '{module}') was {what} on rank {rank}: paramfsm partitions the "
            "parameters a model has when it is sharded, so this one would be trained by each rank alone (never "
            "averaged: the ranks drift apart) or left behind. What to do: change the model before "
            "paramfsm.shard(), or shard after the change: model = rt.close(); <change it>; "
            "rt = paramfsm.shard(model, ...), then build the optimizer anew.")


class ConversionRefused(ParamFSMError):
    """``model.double()``, ``.half()`` or ``.to(...)`` would change a partitioned parameter's dtype or device;
    nothing was converted (see :mod:`paramfsm.sharding.conversions`)."""


class UnsupportedOutput(ParamFSMError):
    """A unit's forward returned tensors of the autograd graph inside an object the hooks cannot look into
    (see :mod:`paramfsm.engine.events.outputs`); raised at that forward, before any backward could crash."""

    def __init__(self, *, module: str, type_name: str, full_type_name: str):
        self.module, self.type_name = module, type_name
        super().__init__(
            f"the forward of module '{module}' returned a {full_type_name} object holding tensors that "
            f"need gradients, and paramfsm cannot look inside a {type_name} to find where this unit's backward "
            "begins: that backward would run without the unit's parameters gathered. What to do: return a "
            "tensor, or a tuple, list, dict, dataclass or namedtuple of them (nested as deep as you like), or "
            f"register {type_name} with torch.utils._pytree.register_pytree_node so its tensors can be found.")


class OffloadError(ParamFSMError):
    """The offload tier could not hold a value (a folder that cannot be written, a full disk, a size that
    changed): names the parameter, the rank and the folder. The working copy is kept, so nothing is lost."""


class StaleOffloadCopy(ParamFSMError):
    """A tier copy older than the working value was about to be read back (a write-back was lost):
    refused, never returned. Names the parameter, what of it (shard or optimizer state) and the rank."""


class NotResident(ParamFSMError):
    """An offloaded value (a shard, an optimizer state tensor) was read while paged out and could not be
    paged in for the reader: names the parameter, what of it, the rank and what to do."""


_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn_at_caller(warning: Warning) -> None:
    """Warn ``warning`` at the user's line: the first frame outside paramfsm, however many of paramfsm's own
    calls stand between (a fixed ``stacklevel`` broke whenever a call moved, and under mutmut's trampolines)."""
    frame, level = sys._getframe(1), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    warnings.warn(warning, stacklevel=level)
