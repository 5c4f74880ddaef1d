"""A plain ``torch.amp.GradScaler`` stepping shards is refused: its skip decision would be one rank's.

The optimizer step pre-hook of :mod:`paramfsm.optim` calls :func:`refuse_local_scaler` directly, so the
frames it reads (the scaler's ``_maybe_opt_step``, a few frames up) are where it looks for them.
"""

from __future__ import annotations

import sys

import torch

from paramfsm.errors import ParamFSMError


def refuse_local_scaler(optimizer) -> None:
    """Raise when a plain ``torch.amp.GradScaler`` is stepping shards (its skip decision is per rank).

    [Note: a scaler's skip decision must be global]
    ``GradScaler.step`` calls ``optimizer.step()`` only when its own rank found
    no inf. On shards, an overflow in one rank's slice would make that rank
    skip while the others step: silently diverging shards. The scaler is
    found as ``self`` of the ``GradScaler._maybe_opt_step`` frame that called
    this step (a few frames up); :class:`paramfsm.amp.GradScaler` agrees
    ``found_inf`` across ranks first and is let through.
    """
    frame = sys._getframe(2)
    for _ in range(6):
        if frame is None:
            return
        if frame.f_code.co_name == "_maybe_opt_step":
            scaler = frame.f_locals.get("self")
            if isinstance(scaler, torch.amp.GradScaler) and not getattr(scaler, "agrees_across_ranks", False):
                raise ParamFSMError(
                    f"a plain torch.amp.GradScaler is stepping {type(optimizer).__name__} over paramfsm shards: "
                    "each rank would decide alone whether a gradient overflowed, so ranks could skip "
                    "different steps and the shards would silently diverge. What to do: use "
                    "paramfsm.amp.GradScaler(rt, ...) (the same API; found_inf is agreed across ranks).")
            return
        frame = frame.f_back
