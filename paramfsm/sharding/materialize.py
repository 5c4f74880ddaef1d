"""``rt.init_weights(fn=None)``: initialise a sharded model module by module, as plain torch would.

For each module in turn, each rank makes the full tensors of the parameters
the module's initialisation writes, runs it, keeps its own slice of each in
the shard and frees the rest. So a rank holds its shards plus, at any moment,
the parameters of one module (of one subtree when a module's initialisation
writes its children's parameters). Without ``fn`` every module that defines
``reset_parameters()`` has it called, in ``model.modules()`` order; with
``fn``, ``fn(module)`` is called in the order ``model.apply(fn)`` calls it.

The contract: the parameters come out bit-identical to the same
initialisation of an unsharded copy of the model under the same RNG state, at
any world size (every rank computes every full tensor; see [Note: the RNG
stream of a sharded init]). So every rank must be seeded identically
(``torch.manual_seed(seed)`` on each) before calling it; ranks seeded
differently keep slices of different draws, a valid but different
initialisation.

Calling it again, or on a model that was not built on the meta device,
re-initialises, as calling ``reset_parameters()`` again on a plain model does:
a parameter that already has values is all-gathered first (one collective per
parameter, every rank calls ``init_weights``), so an initialisation that
writes only part of it keeps the rest. On a meta-built model, a parameter no
initialisation writes in full is an error naming it, not values left to chance.

[Note: the RNG stream of a sharded init]
Plain torch draws random numbers module by module, in the order above, each
module's ``reset_parameters`` drawing for its parameters in its own order.
Here the same calls run in the same order on tensors of the same shapes, dtypes
and device, so they draw the same numbers; only where the values end up differs.
A module's initialisation is first given its own parameters only. If it
touches another one (a block's ``reset_parameters`` writing its children's
weights), the placeholder of that parameter raises ``NotGathered`` before any
value is read; the RNG state (CPU and, for a CUDA model, that device's) is
then put back, and the module runs again with its whole subtree materialised,
so nothing is drawn twice. A tied parameter is written by each module that
owns it, in order, and the last write wins, as in plain torch.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from paramfsm.sharding import full_state, meta
from paramfsm.core.spec import State
from paramfsm.engine.storage import placeholder
from paramfsm.errors import NotGathered, ParamFSMError
from paramfsm.sharding.rank_errors import agreed, groups_of


def init_weights(rt, fn=None) -> None:
    """Initialise every parameter of ``rt.model`` (see the module docstring). Every rank calls it."""
    if fn is not None and not callable(fn):
        raise ParamFSMError(f"rt.init_weights(fn={fn!r}): fn must be a callable taking a module")
    rt.flush()
    busy = [rec.name for rec in rt._by_id.values() if rec.state is not State.NOT_AVAILABLE]
    if busy:
        raise ParamFSMError(f"rt.init_weights: parameters {busy[:5]} are gathered; call it between iterations")
    records = tuple(rt._by_id.values())
    # Offloaded shards are paged in module by module below (see [Note: streaming through the tier]).
    rt.scheduler.shards_written(records, records, "rt.init_weights()", paging=False)
    model = rt.model
    if fn is None:
        calls = [m for m in model.modules() if callable(getattr(m, "reset_parameters", None))]
        run = _reset_parameters
    else:
        calls, run = apply_order(model), fn
    names = {id(m): name or type(m).__name__ for name, m in model.named_modules(remove_duplicate=False)}
    # Parameters whose current values are real (all of them unless the model has none yet),
    # and whether each one's last initialisation left it written in full.
    written = set(rt._by_id) if rt._values.unset is None else set()
    complete: dict[int, bool] = {}
    with meta.setting_values(rt, "rt.init_weights"), torch.no_grad():
        groups = groups_of(rt)
        for module in calls:  # a fn can fail on one rank's module only ([Note: an error one rank meets])
            with agreed(groups, f"rt.init_weights (module '{names[id(module)]}')"):
                _init_module(rt, module, names[id(module)], run, written, complete)
        missing = [rec.name for key, rec in rt._by_id.items() if key not in written or not complete.get(key, True)]
        if missing:
            how = "fn" if fn is not None else "reset_parameters()"
            raise ParamFSMError(
                f"rt.init_weights: parameters {missing[:5]} were not written in full by any {how} (rank "
                f"{rt.rank}); a model built on the meta device has no other values. What to do: give their "
                f"modules a reset_parameters() that writes them, or pass fn that does (rt.init_weights(fn)), "
                "or load them (paramfsm.integrations.hf.load_pretrained, rt.load_full_state_dict)")


def apply_order(model: nn.Module) -> list[nn.Module]:
    """The modules in the order ``model.apply(fn)`` visits them (children first; a shared module each time)."""
    order: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        for child in module.children():
            visit(child)
        order.append(module)

    visit(model)
    return order


def _reset_parameters(module: nn.Module) -> None:
    module.reset_parameters()


def _records(rt, params) -> list:
    seen, out = set(), []
    for p in params:
        rec = rt._by_id.get(id(p))
        if rec is not None and id(rec) not in seen:
            seen.add(id(rec))
            out.append(rec)
    return out


def _init_module(rt, module: nn.Module, name: str, run, written: set, complete: dict) -> None:
    """Run one module's initialisation on full tensors and keep this rank's slices ([Note: the RNG stream ...])."""
    own = _records(rt, module.parameters(recurse=False))
    scopes = [own]
    below = _records(rt, module.parameters())
    if len(below) > len(own):
        scopes.append(below)
    for attempt, scope in enumerate(scopes):
        with rt.scheduler.shard_scope(scope, write=True):
            rng = _rng_state(rt)
            fulls = [(rec, _materialise(rt, rec, written)) for rec in scope]
            try:
                run(module)
            except NotGathered as exc:
                rt.executor.free([rec for rec, _ in fulls])
                _set_rng_state(rt, rng)
                if attempt + 1 < len(scopes):
                    continue
                raise ParamFSMError(
                    f"rt.init_weights: the initialisation of module '{name}' ({type(module).__name__}) uses "
                    f"parameter '{exc.param}', which is neither its own nor below it (rank {rt.rank}); "
                    "initialise each parameter from a module that owns it or contains it") from exc
            except BaseException:
                rt.executor.free([rec for rec, _ in fulls])
                raise
            _keep(rt, module, name, fulls, written, complete)
        return


def _materialise(rt, rec, written: set) -> torch.Tensor:
    """The parameter's full tensor, installed as its data: its values if it has any, else NaN (unwritten)."""
    if id(rec.param) in written:
        full = full_state.gather(rt, rec, rec.shard)
    else:
        full = torch.full(rec.shape, math.nan, dtype=rec.shard.dtype, device=rec.shard.device)
    placeholder.reveal(rec.param)
    rec.param.data = full
    return full


def _keep(rt, module: nn.Module, name: str, fulls, written: set, complete: dict) -> None:
    """Copy this rank's slice of each initialised tensor into its shard and free the full tensors."""
    try:
        for key, param in module.named_parameters():
            if id(param) not in rt._by_id:
                raise ParamFSMError(
                    f"rt.init_weights: the initialisation of module '{name}' ({type(module).__name__}) replaced "
                    f"parameter '{key}' with a new tensor (rank {rt.rank}); paramfsm partitions the original "
                    "object, so write its values in place (nn.init.normal_(self.weight), self.weight.copy_(...))")
        for rec, _ in fulls:
            value = rec.param.data
            if tuple(value.shape) != tuple(rec.shape):
                raise ParamFSMError(f"rt.init_weights: the initialisation of module '{name}' changed the shape of "
                                    f"'{rec.name}' from {tuple(rec.shape)} to {tuple(value.shape)} (rank {rt.rank})")
            lo = min(rt.rank * rec.shard_numel, rec.numel)
            hi = min(lo + rec.shard_numel, rec.numel)
            rec.shard[: hi - lo].copy_(value.reshape(-1)[lo:hi])
            rec.shard[hi - lo:].zero_()
            complete[id(rec.param)] = value.is_meta or not bool(torch.isnan(value).any())  # meta: a plan's rehearsal
            written.add(id(rec.param))
    finally:
        rt.executor.free([rec for rec, _ in fulls])


def _rng_state(rt):
    device = next(iter(rt._by_id.values())).shard.device if rt._by_id else torch.device("cpu")
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda, device


def _set_rng_state(rt, state) -> None:
    cpu, cuda, device = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)
