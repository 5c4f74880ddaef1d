"""Optimizers whose update reads a whole parameter, stepped on whole parameters, one unit at a time.

[Note: whole-parameter optimizers]
paramfsm steps an element-wise optimizer (:data:`paramfsm.optim.ELEMENTWISE`, or one declared with
:func:`paramfsm.optim.elementwise`) on each rank's flat 1-D shard: its update of each element depends on
that element alone, so the shards' updates are the full parameter's. Any other optimizer may read the
parameter's shape or a whole-tensor quantity (Adafactor's factored second moment over rows and columns,
Muon's orthogonalisation of the 2-D update, the trust ratios of LAMB and LARS). Such an optimizer keeps the
model's own parameters in its groups (a shard given to it is swapped back for its parameter) and each
``step()`` runs it on whole parameters, unit by unit:

1. the unit's parameters that have a gradient are all-gathered at full precision (the shards' dtype, not
   ``param_dtype``), and so are their gradients (the reduce-scattered shard gradients);
2. each parameter's ``.data`` is its full value and its ``.grad`` the full gradient while the optimizer's
   own step runs over that unit's parameters alone;
3. each rank copies its slice of the updated value back into its shard, and the parameter is emptied again.

Every rank runs the same update on the same values, so the slices agree, and the result is the optimizer's
own on the full parameters, as in plain torch. Its state is the state of full parameters (Muon's momentum,
Adafactor's row and column factors), kept on every rank: for these parameters the optimizer state is
replicated, as under DDP, rather than sharded. Stepping each parameter on one owner rank and scattering the
result would shard it by parameter; that is not built. Hooks see one step
(:mod:`paramfsm.offload_step` runs the units through the optimizer's bare step function).
A closure (LBFGS evaluates it between updates) and an offloaded model are refused at the first step.
"""

from __future__ import annotations

import contextlib

import torch

from paramfsm import full_state
from paramfsm.core.spec import State
from paramfsm.engine.storage import placeholder
from paramfsm.engine.storage.partitioned import set_real_grad
from paramfsm.errors import ParamFSMError


def step_runtime(optimizer, rt, records, saved, stepped: set, step_only) -> None:
    """Step ``optimizer`` over ``records`` of ``rt`` on whole parameters, unit by unit (see the Note).

    ``saved``: the param groups' parameters; ``step_only(optimizer, saved, ids)`` steps those in ``ids``
    alone; ``stepped`` collects the ids of the parameters stepped here."""
    wanted = set(records)
    seen: set = set()
    for unit in rt.units:
        recs = [rec for rec in unit.records if rec in wanted and rec not in seen and rec.shard.grad is not None]
        if not recs:
            continue
        seen.update(recs)
        with _whole(rt, recs):
            step_only(optimizer, saved, {id(rec.param) for rec in recs})
        stepped.update(id(rec.param) for rec in recs)


@contextlib.contextmanager
def _whole(rt, recs):
    """Each parameter of ``recs`` whole, with its full gradient, for the block; then its slice written back
    into its shard (unless the block raised) and the parameter emptied again."""
    for rec in recs:
        if rec.state is not State.NOT_AVAILABLE:
            raise ParamFSMError(
                f"parameter '{rec.name}' (module '{rec.name.rpartition('.')[0] or '<root>'}', unit "
                f"'{rec.unit}', state {rec.state.name}, event 'optimizer step', rank {rt.rank}) is gathered "
                "while a whole-parameter optimizer steps it. What to do: step the optimizer after the "
                "backward, outside rt.gathered() and with no retained graph holding the parameter.")
    with torch.no_grad():
        fulls = [(full_state.gather(rt, rec, rec.shard),
                  full_state.gather(rt, rec, rec.shard.grad, full_state.GRADIENT)) for rec in recs]
        for rec, (value, grad) in zip(recs, fulls):
            placeholder.reveal(rec.param)
            rec.param.data = value
            set_real_grad(rec.param, grad)
    done = False
    try:
        yield
        done = True
    finally:
        with torch.no_grad():
            for rec in recs:
                if done:
                    _write_slice(rt, rec)
                set_real_grad(rec.param, None)
                rt.executor.free((rec,))


def _write_slice(rt, rec) -> None:
    """Copy this rank's slice of the whole parameter's value into its shard (the layout of ``make_shard``)."""
    value = placeholder.storage(rec.param).reshape(-1)
    lo = min(rt.rank * rec.shard_numel, rec.numel)
    hi = min((rt.rank + 1) * rec.shard_numel, rec.numel)
    rec.shard.detach()[: hi - lo].copy_(value[lo:hi])
