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
2. a full-precision stand-in for each holds its full value and, as ``.grad``, its full gradient, with the
   parameter's optimizer state, while the optimizer's own step runs over that unit's stand-ins alone
   ([Note: a stand-in for the parameter]);
3. each rank copies its slice of the updated value into its shard, and the state goes back to the parameter.

Every rank runs the same update on the same values, so the slices agree, and the result is the optimizer's
own on the full parameters, as in plain torch. Its state is the state of full parameters (Muon's momentum,
Adafactor's row and column factors), kept on every rank: for these parameters the optimizer state is
replicated, as under DDP, rather than sharded. Stepping each parameter on one owner rank and scattering the
result would shard it by parameter; that is not built. Hooks see one step
(:mod:`paramfsm.optim.offload_step` runs the units through the optimizer's bare step function).
A closure (LBFGS evaluates it between updates) and an offloaded model are refused at the first step.
"""

from __future__ import annotations

import torch

from paramfsm.sharding import full_state


def step_runtime(optimizer, rt, records, saved, stepped: set, step_only) -> None:
    """Step ``optimizer`` over ``records`` of ``rt`` on whole parameters, unit by unit (see the Note).

    ``saved``: the param groups' parameters; ``step_only(optimizer, groups, ids)`` steps the tensors of
    ``groups`` in ``ids`` alone; ``stepped`` collects the ids of the parameters stepped here."""
    wanted = set(records)
    seen: set = set()
    for unit in rt.units:
        recs = [rec for rec in unit.records if rec in wanted and rec not in seen and rec.shard.grad is not None]
        if not recs:
            continue
        seen.update(recs)
        _step_unit(optimizer, rt, recs, saved, step_only)
        stepped.update(id(rec.param) for rec in recs)


def _step_unit(optimizer, rt, recs, saved, step_only) -> None:
    """One unit's parameters stepped whole: each through a full-precision stand-in holding its state.

    [Note: a stand-in for the parameter]
    The parameter itself is not made whole: its ``.data`` has the compute dtype (``param_dtype``) and its
    autograd node was made for it, and giving it a tensor of another dtype makes autograd drop that node (the
    hooks paramfsm put on it with it), so the next backward reduced a gradient twice. So each parameter is
    stood in for by a new full-precision tensor with its full gradient, and its optimizer state moves to the
    stand-in for the step and back after it: the state stays keyed by the parameter (checkpoints, ``state_dict``).
    """
    state = optimizer.state
    with torch.no_grad():
        proxies = {}
        for rec in recs:
            proxy = torch.nn.Parameter(full_state.gather(rt, rec, rec.shard), requires_grad=rec.requires_grad)
            proxy.grad = full_state.gather(rt, rec, rec.shard.grad, full_state.GRADIENT)
            proxies[id(rec.param)] = proxy
    groups = [[proxies.get(id(p), p) for p in params] for params in saved]
    for rec in recs:
        held = state.pop(rec.param, None)
        if held is not None:
            state[proxies[id(rec.param)]] = held
    try:
        step_only(optimizer, groups, {id(proxy) for proxy in proxies.values()})
    finally:
        for rec in recs:
            held = state.pop(proxies[id(rec.param)], None)
            if held is not None:
                state[rec.param] = held
    with torch.no_grad():
        for rec in recs:
            _write_slice(rt, rec, proxies[id(rec.param)])


def _write_slice(rt, rec, proxy) -> None:
    """Copy this rank's slice of the whole parameter's new value into its shard (the layout of ``make_shard``)."""
    value = proxy.detach().reshape(-1)
    lo = min(rt.rank * rec.shard_numel, rec.numel)
    hi = min((rt.rank + 1) * rec.shard_numel, rec.numel)
    rec.shard.detach()[: hi - lo].copy_(value[lo:hi])
