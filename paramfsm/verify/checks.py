"""The checks ``paramfsm verify`` runs on one rank after every op of a program.

Each check returns a list of problems (strings naming the parameter and what
is wrong); an empty list means the check passed. None of them communicates:
every rank holds the full plain-torch reference (see
:mod:`paramfsm.verify.runner`), so shards and shard gradients are compared
with this rank's slice of the reference locally.

[Note: invariants come from the spec]
The invariant names a state must satisfy are read from the compiled spec
(``table.spec.states[name].invariants``); :data:`INVARIANTS` implements each
name as a predicate over a parameter record. A spec naming an invariant this
module does not implement fails loudly, so the spec and the checks cannot
drift apart.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Mapping

import torch
from torch.distributed.tensor import DTensor

from paramfsm.checkpoint.layout import ShardPieces
from paramfsm.core.replay import replay
from paramfsm.core.spec import State
from paramfsm.engine.storage.placeholder import storage
from paramfsm.errors import StaleOffloadCopy


def _data_empty(rec) -> str | None:
    numel = storage(rec.param).numel()
    return None if numel == 0 else f"param.data holds {numel} elements, expected an empty tensor"


def _data_full(rec) -> str | None:
    shape = tuple(storage(rec.param).shape)
    return None if shape == tuple(rec.shape) else f"param.data has shape {shape}, expected {tuple(rec.shape)}"


def _shard_intact(rec) -> str | None:
    shard = rec.shard
    if shard.dim() != 1 or shard.numel() != rec.shard_numel:
        return f"the shard has shape {tuple(shard.shape)}, expected ({rec.shard_numel},)"
    if not shard.is_leaf or shard.requires_grad != rec.requires_grad:
        return "the shard is no longer a leaf with the parameter's requires_grad"
    return None


def _no_handle(rec) -> str | None:
    return None if rec.pending is None else "a gather is still pending on it"


def _pending_handle(rec) -> str | None:
    return None if rec.pending is not None else "no gather is pending on it"


def _retained_graph_live(rec) -> str | None:
    if any(u.live_graphs > 0 for u in rec.units):
        return None
    return "no live retained graph references any of its units"


#: Invariant name (as written in the spec) -> predicate returning a problem or None.
INVARIANTS: Mapping[str, Callable] = {
    "data_empty": _data_empty,
    "data_full": _data_full,
    "shard_intact": _shard_intact,
    "no_handle": _no_handle,
    "pending_handle": _pending_handle,
    "retained_graph_live": _retained_graph_live,
}


def records(rt) -> list:
    """The runtime's parameter records (its side table), one per distinct parameter."""
    return rt.scheduler.records


def state_invariants(rt) -> list[str]:
    """Every parameter satisfies every invariant the spec names for its state."""
    states = rt.table.spec.states
    problems = []
    for rec in records(rt):
        for name in states[rec.state.name].invariants:
            check = INVARIANTS.get(name)
            if check is None:
                raise KeyError(f"the spec names invariant {name!r}, which paramfsm.verify.checks does not implement")
            problem = check(rec)
            if problem:
                problems.append(f"'{rec.name}' in {rec.state.name} breaks invariant {name}: {problem}")
    return problems


def at_rest(rt, graph_alive: bool, retain: str, released_by: str = "") -> list[str]:
    """Between ops nothing is in flight or held; deferred only under retain="defer" while a graph is alive.

    ``graph_alive``: the program still references an autograd graph.
    ``released_by``: what the op was when it must leave nothing deferred
    (``rt.flush()``; a backward without ``retain_graph`` when no retained
    graph is alive), or empty.
    """
    problems = []
    # Units a forward keeps for its backward (reshard_after_forward, the root by default) while its graph lives.
    kept = {rec for unit in rt.scheduler.holds.kept.values() for rec in unit.records} if graph_alive else set()
    for rec in records(rt):
        state = rec.state
        if state is State.INFLIGHT:
            problems.append(f"'{rec.name}' is left INFLIGHT between ops (an abandoned prefetch?)")
        elif state is State.AVAILABLE and rec not in kept:
            problems.append(f"'{rec.name}' is left AVAILABLE (holds={rec.holds}) between ops: gathered with no user")
        elif state is State.DEFERRED_RELEASE and released_by:
            problems.append(f"'{rec.name}' is still DEFERRED_RELEASE after {released_by}")
        elif state is State.DEFERRED_RELEASE and not (graph_alive and retain == "defer"):
            why = "the program references no autograd graph" if retain == "defer" else 'retain="regather"'
            problems.append(f"'{rec.name}' is DEFERRED_RELEASE but {why}")
    return problems


def retained_window(rt, op_kind: str, config) -> list[str]:
    """After a backward that retained a plain forward's graph, under unbounded ``retain="defer"``, the units
    it used wait DEFERRED_RELEASE for the next backward over that graph: some parameter must be deferred."""
    if config.retain != "defer" or config.max_deferred_bytes is not None:
        return []
    recs = records(rt)
    if not any(rec.requires_grad for rec in recs) or any(rec.state is State.DEFERRED_RELEASE for rec in recs):
        return []
    return [f"a {op_kind} op with retain_graph=True left nothing DEFERRED_RELEASE under retain=\"defer\": "
            "the next backward over the retained graph gathers every unit again"]


def shard_slice(full: torch.Tensor | None, rec, rank: int, world: int, pad: float = 0.0) -> torch.Tensor | None:
    """This rank's slice of the flattened full tensor padded with ``pad`` (what paramfsm's shard should hold).

    The padding is zero, except in a gradient a clip multiplied by a NaN coefficient (see
    :func:`matches_reference`).
    """
    if full is None:
        return None
    flat = torch.full((rec.shard_numel * world,), pad, dtype=full.dtype)
    flat[:full.numel()] = full.detach().reshape(-1)
    return flat[rank * rec.shard_numel:(rank + 1) * rec.shard_numel]


#: How many times plain torch's own spread (two valid summation orders of the same math) a difference may be, on
#: top of the fixed tolerances: see [Note: plain torch's own noise] in :mod:`paramfsm.verify.mirror`.
NOISE_FACTOR = 4.0


def spread(a, b) -> float:
    """The largest difference between the two references' values of one tensor (0 where either is None)."""
    if a is None or b is None or a.shape != b.shape:
        return 0.0
    diff = (a.detach().float() - b.detach().float()).abs()
    diff = diff[torch.isfinite(diff)]
    return float(diff.max().item()) if diff.numel() else 0.0


def noise(params: Mapping, other: Mapping) -> dict:
    """name -> (parameter, gradient) spread between the two references' parameters."""
    return {name: (spread(p, other[name]), spread(p.grad, other[name].grad)) for name, p in params.items()}


def same_values(got: list, want: list, other: list, atol: float, rtol: float, what: str) -> list[str]:
    """An op's tensors against the reference's (``want``), allowing the spread to the noise reference's
    (``other``): one problem per tensor outside it."""
    if len(got) != len(want):
        return [f"the {what} gave {len(got)} floating-point tensors, plain torch {len(want)}"]
    problems = []
    for i, (g, w, o) in enumerate(zip(got, want, other)):
        n = spread(w, o)
        d = close(g.detach(), w.detach(), atol + NOISE_FACTOR * n, rtol)
        if d is not None:
            problems.append(f"tensor {i} of the {what}'s value differs from plain torch's by {d:.3g} "
                            f"({allowance(d, atol, n)})")
    return problems


def allowance(diff: float, atol: float, noise: float) -> str:
    """What a difference was allowed, and how far outside it is, for a failure message."""
    if not noise:
        return f"atol {atol}"
    allowed = atol + NOISE_FACTOR * noise
    return (f"atol {atol} + {NOISE_FACTOR:g} x plain torch's own noise {noise:.3g} here: "
            f"{diff / allowed:.3g} times the allowance")


def close(got, want, atol: float, rtol: float) -> float | None:
    """None when equal within tolerance (None matches None or zeros), else the largest difference.

    An inf or NaN matches the same value in the same place (an fp16 overflow
    reaches paramfsm's and the reference's gradients alike).
    """
    if got is None or want is None:
        other = want if got is None else got
        return None if other is None or not other.abs().max().item() else float(other.abs().max().item())
    if got.shape != want.shape:
        return float("inf")
    if torch.allclose(got.float(), want.float(), atol=atol, rtol=rtol, equal_nan=True):
        return None
    return float((got.float() - want.float()).abs().nan_to_num(float("inf")).max().item())


def sharded_problems(state_dict, want: Mapping, noise: Mapping, rank: int, world: int, atol: float,
                     rtol: float) -> list[str]:
    """What a sharded state dict of a DCP save holds wrong against the reference's ``want`` (its
    ``state_dict()``): each parameter's value must be exactly this rank's ``Shard(0)`` chunk of the
    flattened reference parameter (a flat DTensor's local tensor, or the range a model-shaped value's
    pieces cover; ``noise``: plain torch's own, as for parameters), each buffer the reference's."""
    problems = []
    for key, value in state_dict.items():
        if not isinstance(value, (DTensor, ShardPieces)):
            if close(value, want[key], atol, rtol) is not None:
                problems.append(f"buffer '{key}' of the sharded state dict differs from the reference's")
            continue
        flat = want[key].detach().reshape(-1)
        size = -(-flat.numel() // world)
        chunk = flat[min(rank * size, flat.numel()):min((rank + 1) * size, flat.numel())]
        local = value.flat if isinstance(value, ShardPieces) else value.to_local()
        if isinstance(value, ShardPieces) and tuple(value.shape) != tuple(want[key].shape):
            problems.append(f"'{key}': saved with shape {tuple(value.shape)}, the model's is {tuple(want[key].shape)}")
        elif local.shape != chunk.shape:
            problems.append(f"'{key}': this rank's DTensor chunk has {local.numel()} elements, its Shard(0) "
                            f"chunk of {flat.numel()} on {world} ranks has {chunk.numel()}")
        elif close(local, chunk, atol + NOISE_FACTOR * noise.get(key, (0.0,))[0], rtol) is not None:
            problems.append(f"'{key}': this rank's DTensor chunk differs from the reference's slice")
    return problems


def matches_reference(rt, ref_params: Mapping, ref_grads: Mapping, rank: int, world: int,
                      atol: float, rtol: float, kept: frozenset = frozenset(),
                      nan_padded: frozenset = frozenset(), noise: Mapping = {}) -> list[str]:
    """Shards and shard gradients equal this rank's slice of the reference parameters and gradients.

    ``kept``: parameters whose gradients are not compared while gradients are kept unsynchronised (see
    [Note: comparing gradients while some are kept] in :mod:`paramfsm.verify.sync_checks`).
    ``nan_padded``: parameters whose gradient's padding must be NaN, not zero. A clip scales every element
    of a shard gradient, its padding included, by one coefficient, as torch scales every element of the full
    gradient; when the total norm is NaN (an fp16 overflow made a gradient NaN) the coefficient is NaN, every
    real element becomes NaN on both sides and the padding's zeros become ``0 * nan = nan``. Later
    accumulation, unscaling and clipping keep it NaN until the gradient is set to None.
    """
    problems = []
    observe = _observer(rt)
    for rec in records(rt):
        try:
            shard, grad = observe(rec.shard), rec.shard.grad
            grad = observe(grad) if grad is not None else None
        except StaleOffloadCopy as exc:  # the next page-in would raise it: a lost write-back
            problems.append(str(exc))
            continue
        p_noise, g_noise = noise.get(rec.name, (0.0, 0.0))
        diff = close(shard.detach(), shard_slice(ref_params[rec.name], rec, rank, world),
                     atol + NOISE_FACTOR * p_noise, rtol)
        if diff is not None:
            problems.append(f"'{rec.name}' differs from the reference parameter by {diff:.3g} "
                            f"({allowance(diff, atol, p_noise)})")
        if rec.name in kept:
            continue
        pad = float("nan") if rec.name in nan_padded else 0.0
        diff = close(grad, shard_slice(ref_grads[rec.name], rec, rank, world, pad), atol + NOISE_FACTOR * g_noise,
                     rtol)
        if diff is not None:
            problems.append(f"the gradient of '{rec.name}' differs from the reference by {diff:.3g} "
                            f"({allowance(diff, atol, g_noise)})")
    return problems


def _observer(rt):
    """How the checks read an offloaded value: as its next use would see it, without paging it in (an on-demand
    page-in counts the value as written, which would hide a lost write-back from the check)."""
    plan = getattr(rt, "offload", None)
    return plan.residency.peek if plan is not None else (lambda tensor: tensor)


def full_values(rt, ref_params: Mapping, atol: float, rtol: float,
                states=(State.AVAILABLE, State.DEFERRED_RELEASE), noise: Mapping = {}) -> list[str]:
    """Every gathered parameter's full data equals the reference parameter (not a stale copy).

    Parameters missing from ``ref_params`` are not checked (modified since a forward last ran them).
    """
    problems = []
    for rec in records(rt):
        if rec.name not in ref_params:
            continue
        data = rec.param.data  # in the compute dtype under param_dtype: compare with the reference cast to it
        allowed = atol + NOISE_FACTOR * noise.get(rec.name, (0.0, 0.0))[0]
        if rec.state in states and close(data, ref_params[rec.name].detach().to(data.dtype), allowed, rtol) is not None:
            problems.append(f"'{rec.name}' is {rec.state.name} but its full data differs from the current parameter")
    return problems


def communication(op_kind: str, before: Mapping, after: Mapping, *, all_deferred: bool, grad_params: int,
                  units: int, extra_gathers: int = 0) -> list[str]:
    """Communication counts of one op are sane (see the module docstring of paramfsm.verify.runner).

    ``extra_gathers``: all-gathers the op may issue beyond the units' (one per parameter for a state dict).
    """
    gathers = after["all_gathers"] - before["all_gathers"]
    reduces = after["reduce_scatters"] - before["reduce_scatters"]
    problems = []
    closure = op_kind == "ClosureStep"  # a forward and a backward inside opt.step
    backward = op_kind in ("Backward", "Penalty", "Interrupted") or closure
    if backward and not closure and all_deferred and gathers:
        problems.append(f"{gathers} all-gather(s) in a backward that found every parameter DEFERRED_RELEASE "
                        "(reuse of deferred parameters must not communicate)")
    passes = 2 if op_kind == "Penalty" else 1
    if reduces > passes * max(grad_params, 1):
        problems.append(f"{reduces} reduce-scatters for {grad_params} parameters that require grad")
    if not backward and reduces and op_kind != "SyncGradients":
        problems.append(f"{reduces} reduce-scatter(s) outside backward")
    bound = units * (6 if closure else 4 if backward else 2) * passes + extra_gathers
    if gathers > bound:
        problems.append(f"{gathers} all-gathers, more than {bound} for {units} units")
    return problems


def trace_problems(records, table) -> tuple[int | None, list[str]]:
    """Replay the trace through the spec; each parameter's gradient reduced at most once per graph task.

    Returns the index of the first offending record (or None) and the problems.
    """
    error = replay(records, table)
    if error is not None:
        return error.index, [f"the trace does not replay through the spec: {error}"]
    reduced = Counter((r.graph_task, r.param) for r in records if "reduce_grad" in r.effects)
    for (task, param), count in reduced.items():
        if count > 1:
            first = next(i for i, r in enumerate(records)
                         if r.graph_task == task and r.param == param and "reduce_grad" in r.effects)
            return first, [f"'{param}' had its gradient reduced {count} times in graph task {task}"]
    return None, []
