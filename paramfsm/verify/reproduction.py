"""A program as a runnable script that checks itself, like the step listing of a hypothesis stateful test.

:func:`render` writes a script whose ``main`` builds the subject from its
factory, a :class:`~paramfsm.verify.checker.Checker` (the plain-torch
reference and verify's checks), ``paramfsm.shard`` with the program's
configuration, the optimizer and a ``batch(i)`` function that gives each rank
its share of global batch ``i``, and then runs each op as one or a few lines
of plain PyTorch and public paramfsm API inside ``with check(<op>):``. The
block runs the op on the reference first and checks gradients, parameters,
states and communication after it, as ``paramfsm verify`` does; the trace
and ``rt.close()`` are checked at the end. The failing op is marked with
``# <- fails here`` and the failure is quoted in the docstring. A loss that
reads another output on each rank (``RankLoss``) is one line picking this
rank's output; if every rank then raises ``RankDesync`` (naming a unit and the
fix), the script stops there and exits 0, as verify accepts that outcome.

Run the script with ``torchrun --nproc-per-node WORLD``: :func:`run_reproduction`
prints the check's message and exits 1 while the bug is present, and exits 0
once it is fixed. The script records the folder ``paramfsm verify`` imported the
factory's module from, so it runs wherever it is saved. :func:`run_saved` runs
a saved script on the ranks of a :class:`~paramfsm.verify.launch.RankPool` instead.
"""

from __future__ import annotations

import attrs

from paramfsm.engine.storage.default_units import MIN_UNIT_BYTES
from paramfsm.verify.ops import (
    BY_SIZE_BYTES, PENALTY_WEIGHT, RANK_WRITE, TREE_VARIANTS, WRITE_MODE, Attach, Backward, Checkpoint, Clip, ClosureStep, Drop, Evaluate, Flush, Forward,
    FullState, Gathered, GatheredWrite, GradSync, Interrupted, Loss, NoSync, Overflow, PartStep, PartZeroGrad, Penalty, Program,
    RankLoss, RequiresGrad, Restore, Save, Step, SubForward, SyncGradients, Unscale, ZeroGrad,
)
from paramfsm.verify.loop_helpers import SCALER
from paramfsm.verify.running_reproductions import run_reproduction, run_saved  # noqa: F401 - the scripts import them here
from paramfsm.verify.user_loops import WRITES

INDENT = "    "


def render(program: Program, factory: str, *, per_rank: int, seed: int, fail_at: int | None = None,
           message: str = "", fault: str | None = None, path: str | None = None, world: int | None = None,
           meta: bool = False, parts: tuple[str, ...] = (), offload: bool = False) -> str:
    """The program as a script for ``torchrun --nproc-per-node WORLD``; ``fail_at`` marks the failing op.

    ``fault``: the catalogued bug (:mod:`paramfsm.verify.faults`) the run injected; the script injects it too.
    ``path``: a folder the script puts first on ``sys.path`` (where the factory's module was imported from).
    ``meta``: the subject is ``Subject(meta=True)``: the script shards a meta build and initialises it.
    ``parts``: the subject's ``parts``: the script builds one optimizer per part, ``opts``.
    ``offload``: the subject sets ``Subject(offload=...)``; the script shards with it (as it does with the
    configuration's ``offload``).
    """
    script = _Script(frozenset(op.source for op in program.ops if isinstance(op, SubForward)), bool(parts),
                     program.config.clip_plain)
    loops = sorted(({"record_inputs"} if script.sources else set())
                   | {"detached" for op in program.ops if isinstance(op, SubForward) and op.detach}
                   | {"in_place_on_view" for op in program.ops if isinstance(op, SubForward) and op.view}
                   | {"tree_loss" for op in program.ops if isinstance(op, Loss) and op.variant in TREE_VARIANTS
                      or isinstance(op, RankLoss)}
                   | {"interrupt" for op in program.ops if isinstance(op, Interrupted)}
                   | {"write_in_forward" for op in program.ops if getattr(op, "mode", "") == WRITE_MODE}
                   | {name for op in program.ops if _refused(op) for name in ("not_refused",) + (
                       ("attach",) if isinstance(op, Attach) else ())}
                   | {"optimizers"})
    inner = [i for op in program.ops if isinstance(op, ClosureStep) for i in op.inner]
    used = sorted({type(op).__name__ for op in (*program.ops, *inner)} | {"Config"})
    tiered = bool(offload or program.config.offload)  # the script shards with an offload policy
    helpers = sorted({"perturbed" for op in program.ops if isinstance(op, (FullState, Checkpoint))}
                     | {"force_overflow" for op in program.ops if isinstance(op, Overflow)}
                     | {"reentrant_blocks" for op in program.ops if getattr(op, "mode", "") == "reentrant"}
                     | {"forget_recoveries" for op in program.ops if isinstance(op, Interrupted)}
                     | ({"another_run", "offload_policy"} if tiered else set())
                     | ({"refused_shard"} if program.config.refused_shard else set()))
    scaled = program.config.scaled
    quoted = message.replace("\\", "\\\\").replace('"""', '\\"\\"\\"')
    ranks = str(world) if world else "WORLD"
    lines = [
        '"""A failing training loop found by `paramfsm verify`.',
        "",
        *quoted.splitlines(),
        "",
        f"Run it with `torchrun --nproc-per-node {ranks} THIS_FILE`. Every op runs inside `with check(op):`, which",
        "runs the op on an unsharded plain-torch copy of the model first and then checks paramfsm against it",
        "(gradients, parameters, states, communication), as `paramfsm verify` does. The script prints the",
        "failed check and exits 1 while the bug is present, and exits 0 once it is fixed.",
        '"""',
        *(["import contextlib"] if "NoSync" in used else []),
        *(["import copy"] if any(isinstance(op, Save) and op.optimizer for op in program.ops) else []),
        *(["import gc"] if program.config.compiled else []),
        "import sys",
        *(["from math import inf"] if "Clip" in used else []),
        "",
        "import torch",
        *(["import torch.distributed.checkpoint as dcp"]
          if any(isinstance(op, Restore) and op.plain for op in program.ops) else []),
        "from torch.utils.checkpoint import checkpoint",
        "",
        "import paramfsm",
        *(["import paramfsm.amp"] if scaled else []),
        *(["import paramfsm.checkpoint"] if {"Checkpoint", "Save"} & set(used) else []),
        "from paramfsm.verify.checker import Checker",
        f"from paramfsm.verify.programs import {', '.join(used)}",
        "from paramfsm.verify.reproduction import run_reproduction",
        f"from paramfsm.verify.subject import {'for_sharding, initialise, ' if meta else ''}load_subject",
        *([f"from paramfsm.verify.loop_helpers import {', '.join(helpers)}"] if helpers else []),
        *(["from paramfsm.verify.compiled_blocks import compile_blocks"] if program.config.compiled else []),
        *([f"from paramfsm.verify.user_loops import {', '.join(loops)}"] if loops else []),
        "",
        *([f"sys.path.insert(0, {path!r})  # where `paramfsm verify` imported the factory's module from"]
          if path else []),
        f"FAULT = {fault!r}  # the catalogued bug the verify run injected (paramfsm.verify.faults), if any",
        "",
        "",
        "def main(rank, world):",
        f"    torch.manual_seed({seed})",
        f"    subject = load_subject({factory!r})",
        *([f"    reference, subject = for_sharding(subject, {factory!r}, {seed})  # plain init; a meta build"]
          if meta else []),
        "    model, make_batch, loss_fn = subject.model, subject.make_batch, subject.loss_fn",
        f"    config = {program.config!r}",
        f"    check = Checker(subject, config, seed={seed}, per_rank={per_rank}"
        f"{', reference=reference' if meta else ''})  # plain torch, verify's checks",
        *(["    offload = offload_policy(subject, config, world)[0]"] if tiered else []),
        *_shard_lines(program, meta, offload),
        *([f"    initialise(rt, subject, {seed})  # rt.init_weights(subject.init) after torch.manual_seed"]
          if meta else []),
        *(["    compile_blocks(model, check.blocks)  # each block's forward torch.compile'd (aot_eager)"]
          if program.config.compiled else []),
        *(["    neighbour = another_run(offload, rank, world)  # a second run sharing a disk tier's folder"]
          if tiered else []),
        *([f"    scaler = paramfsm.amp.GradScaler(rt, {', '.join(f'{k}={v!r}' for k, v in SCALER.items())})"]
          if scaled else []),
        f"    check.attach(rt{', scaler' if scaled else ''})",
        ("    opts = optimizers(subject, model, rt.shard_parameters(), config)  # one per part, as config says"
         if parts else "    opt, = optimizers(subject, model, rt.shard_parameters(), config)  # built as config says"),
        *(["    window = contextlib.ExitStack()  # a rt.no_sync() window spanning several ops"]
          if "NoSync" in used else []),
        "",
        "    def batch(i):",
        '        """This rank\'s share of global batch i (identical data on every rank)."""',
        f"        inputs, targets = make_batch(torch.Generator().manual_seed({seed} * 1000 + i), world * {per_rank})",
        "        share = lambda t: t.chunk(world)[rank] if isinstance(t, torch.Tensor) else type(t)(map(share, t))",
        "        return share(inputs), share(targets)",
        "",
    ]
    seen: set[int] = set()
    for index, op in enumerate(program.ops):
        body = _render_op(op, seen, program.config, script)
        if index == fail_at:
            mark = next((i for i in range(len(body) - 1, -1, -1)
                         if not body[i].lstrip().startswith(("del ", "check."))), len(body) - 1)
            body[mark] += "  # <- fails here"
        if tiered and isinstance(op, Step):
            body.append("neighbour.step()  # the other run in the offload folder trains too")
        lines.append(f"    with check({op!r}):")
        lines += [INDENT * 2 + line for line in body]
    lines += [
        *(["    neighbour.close()"] if tiered else []),
        "    check.finish()",
        "",
        "",
        'if __name__ == "__main__":',
        "    sys.exit(run_reproduction(main, fault=FAULT))",
    ]
    return "\n".join(lines) + "\n"


#: ``shard()``'s unit arguments for each unit choice, as :func:`paramfsm.verify.loop_helpers.unit_arguments`
#: passes them.
_UNIT_LINES = {
    "default": "units=subject.units, min_unit_bytes=subject.min_unit_bytes",
    "per_module": "units=subject.units, min_unit_bytes=0",
    "merged": f"units=subject.units, min_unit_bytes={MIN_UNIT_BYTES}",
    "one": "units=lambda name, module: False",
    "by_size": f"units=paramfsm.by_size(min_bytes={BY_SIZE_BYTES})",
}


def _shard_lines(program: Program, meta: bool = False, offload: bool = False) -> list[str]:
    c = program.config
    tier = ",\n                        offload=offload" if offload or c.offload else ""
    dtype = (f", param_dtype=torch.{c.param_dtype}, reduce_dtype=torch.float32" if c.param_dtype else "")
    device = ", device=next(reference.parameters()).device" if meta else ""
    kept = c.reshard_after_forward
    reshard = ("" if kept is True else f", reshard_after_forward={kept}" if kept is False else
               f",\n                        reshard_after_forward=lambda name, module: name not in {kept!r}")
    refused = (["    refused_shard(model)  # a shard() that refused an offload setting first, on this model"]
               if c.refused_shard else [])
    return [*refused, f"    rt = paramfsm.shard(model, {_UNIT_LINES[c.units]}, retain={c.retain!r},",
            f"                        prefetch={c.prefetch}, bucket_bytes={c.bucket_bytes},",
            f"                        max_deferred_bytes={c.max_deferred_bytes}, trace=True{dtype}{device}{reshard}"
            f"{tier})"]


def _batch_line(batch: int, seen: set[int]) -> list[str]:
    if batch in seen:
        return []
    seen.add(batch)
    return [f"x{batch}, y{batch} = batch({batch})"]


@attrs.frozen(slots=True)
class _Script:
    """What rendering an op needs to know of the whole program: the forwards whose inputs are recorded,
    whether the optimizers are one per part (``opts``) or one (``opt``)."""

    sources: frozenset
    parts: bool
    clip_plain: bool = False  # Config.clip_plain: a Clip is torch's own call over the shards

    def each(self, line: str) -> str:
        """``line`` (about ``opt``) for the one optimizer, or in a loop over every part's."""
        return f"for o in opts: {line.replace('opt', 'o')}" if self.parts else line


def _refused(op) -> bool:
    """Whether ``op`` must be refused on every rank (its script line after the op says so if it is not)."""
    return isinstance(op, Attach) or isinstance(op, GatheredWrite) and op.variant == RANK_WRITE


def _render_op(op, seen: set[int], config, script: _Script) -> list[str]:
    if isinstance(op, Forward):
        call = f"model(x{op.batch})"
        pre = _batch_line(op.batch, seen)
        if op.mode == WRITE_MODE:  # paramfsm raises WriteToGathered on every rank: accepted, the program stops
            return pre + ["with write_in_forward(model):  # its first parameter's module halves it in its forward",
                          f"    out{op.out} = {call}"]
        if op.mode == "train" and op.out in script.sources:
            return pre + [f"with record_inputs(model) as acts{op.out}:  # each module's inputs, for SubForward ops",
                          f"    out{op.out} = {call}"]
        if op.mode == "train":
            return pre + [f"out{op.out} = {call}"]
        if op.mode == "checkpoint":
            return pre + [f"out{op.out} = checkpoint(model, x{op.batch}, use_reentrant=False)"]
        if op.mode == "reentrant":
            return pre + ["with reentrant_blocks(model, check.blocks):  # each block: checkpoint(use_reentrant=True)",
                          f"    out{op.out} = {call}"]
        if op.mode == "eval":
            return pre + ["model.eval()", f"out{op.out} = {call}", "model.train()"]
        if op.mode == "no_grad":
            return pre + ["with torch.no_grad():", f"    {call}"]
        return pre + ["model.eval()", "with torch.no_grad():", f"    {call}", "model.train()"]
    if isinstance(op, Loss):
        upcast = ".float()" if config.param_dtype else ""
        expr = (f"loss_fn(out{op.out}{upcast}, y{op.batch})", f"out{op.out}.float().pow(2).mean()",
                f"out{op.out}.float().tanh().mean()", f"tree_loss(3, out{op.out})  # sum of mean squares",
                f"tree_loss(4, out{op.out})  # sum of mean tanh")[op.variant]
        return [f"loss{op.loss} = {expr}", f"check.same(loss{op.loss})  # plain torch's value"]
    if isinstance(op, Backward):
        arg = "retain_graph=True" if op.retain else ""
        loss = f"scaler.scale(loss{op.loss})" if config.scaled else f"loss{op.loss}"
        if op.via_runtime:
            return [f"rt.backward({loss}{', ' + arg if arg else ''})"]
        return [f"{loss}.backward({arg})"]
    if isinstance(op, Penalty):
        arg = "retain_graph=True" if op.retain else ""
        return ["params = [p for p in model.parameters() if p.requires_grad]",
                f"grads = torch.autograd.grad(loss{op.loss}, params, create_graph=True, allow_unused=True)",
                "penalty = sum(g.pow(2).sum() for g in grads if g is not None)",
                f"(loss{op.loss} + {PENALTY_WEIGHT} * penalty).backward({arg})",
                "del params, grads, penalty"]
    if isinstance(op, Drop):
        acts = [f"acts{op.out}"] if op.out in script.sources else []
        return ["del " + ", ".join([f"out{op.out}"] + [f"loss{k}" for k in op.losses] + acts),
                *(["gc.collect()  # compiled blocks' graphs are in reference cycles"] if config.compiled else [])]
    if isinstance(op, ZeroGrad):
        return [script.each("opt.zero_grad(set_to_none=config.zero_grad_to_none)")]
    if isinstance(op, Interrupted):
        return [*_batch_line(op.batch, seen),
                f"interrupt(model, {op.module!r}, x{op.batch})  # its backward raises inside an autograd.Function",
                *(["rt.reset()"] if op.reset else []), script.each("opt.zero_grad(set_to_none=True)"),
                "forget_recoveries(rt)  # the recovery's flight-recorder dump"]
    if isinstance(op, Step):
        return [script.each("scaler.step(opt)"), "scaler.update()"] if config.scaled else [script.each("opt.step()")]
    if isinstance(op, Flush):
        return ["rt.flush()"]
    if isinstance(op, Gathered):
        target = f"model.get_submodule({op.module!r})" if op.module else ""
        inner = [] if op.batch is None else ["    with torch.no_grad():", f"        model(x{op.batch})"]
        pre = [] if op.batch is None else _batch_line(op.batch, seen)
        return pre + [f"with rt.gathered({target}):"] + inner + [f"    check.inside_gathered({target})"]
    if isinstance(op, ClosureStep):
        pre = [line for batch in op.batches for line in _batch_line(batch, seen)]
        made = [f"out{i.out}" for i in op.inner if isinstance(i, Forward)] + [f"loss{op.loss}"]
        body = [line for i in op.inner for line in _render_op(i, seen, config, script)]
        return pre + [f"{' = '.join(made)} = None", "def closure():  # opt.step runs the forward and backward",
                      f"    nonlocal {', '.join(made)}", *(INDENT + line for line in body), f"    return loss{op.loss}",
                      "opt.step(closure)"]
    return _render_training_op(op, seen, script)


def _render_training_op(op, seen: set[int], script: _Script) -> list[str]:
    if isinstance(op, Unscale):
        return [script.each("scaler.unscale_(opt)")]
    if isinstance(op, Overflow):
        return [f"force_overflow(rt, {op.param!r}, {op.index})  # an inf in one gradient element, on its owner rank"]
    if isinstance(op, Clip):
        clip = (f"torch.nn.utils.clip_grad_norm_(rt.shard_parameters(), {op.max_norm!r}, {op.norm_type!r})"
                if script.clip_plain else f"rt.clip_grad_norm_({op.max_norm!r}, norm_type={op.norm_type!r})")
        return [f"total = {clip}", "check.clipped(total)  # the total norm is plain torch's"]
    if isinstance(op, FullState):
        load = "perturbed(sd)" if op.perturb else "sd"
        return ["sd = rt.full_state_dict()", "check.full_state(sd)  # the reference's state dict",
                f"rt.load_full_state_dict({load})", "del sd"]
    if isinstance(op, Checkpoint):
        return ["path = check.scratch_dir()  # one folder for every rank", "paramfsm.checkpoint.save(rt, path)",
                "check.sharded(rt.sharded_state_dict())  # each value holds this rank's Shard(0) range",
                "rt.load_full_state_dict(perturbed(rt.full_state_dict()))", "paramfsm.checkpoint.load(rt, path)"]
    if isinstance(op, RequiresGrad):
        return [f"model.get_parameter({op.param!r}).requires_grad_({op.flag})"]
    if isinstance(op, NoSync):
        return ["window.enter_context(rt.no_sync())  # until the NoSync(enter=False) op"] if op.enter else [
            "window.close()  # leaves rt.no_sync()"]
    if isinstance(op, GradSync):
        return [f"rt.set_requires_gradient_sync({op.flag})"]
    if isinstance(op, SyncGradients):
        return ["rt.sync_gradients()"]
    return _render_user_loop_op(op, seen, script)


def _render_user_loop_op(op, seen: set[int], script: _Script) -> list[str]:
    if isinstance(op, SubForward):
        saved = f"acts{op.source}[{op.module!r}]"
        return [f"args, kwargs = {f'detached({saved})' if op.detach else saved}  # its inputs in forward {op.source}",
                f"out{op.out} = model.get_submodule({op.module!r})(*args, **kwargs)",
                *([f"in_place_on_view(out{op.out})  # h = (its first float tensor)[...]; h += 0.5"] if op.view else []),
                f"check.same(out{op.out})  # plain torch's output", "del args, kwargs"]
    if isinstance(op, RankLoss):
        outs = ", ".join(f"out{out}" for out in op.outs)
        return [f"loss{op.loss} = tree_loss({op.variant}, ({outs})[rank % {len(op.outs)}])  # another output per rank",
                f"check.same(loss{op.loss})  # plain torch's value of this rank slice's loss"]
    if isinstance(op, PartStep):
        return [f"opts[{op.part}].step()  # subject.parts[{op.part}] only"]
    if isinstance(op, PartZeroGrad):
        return [f"opts[{op.part}].zero_grad()  # subject.parts[{op.part}] only"]
    if isinstance(op, GatheredWrite):
        target = f"model.get_submodule({op.module!r})" if op.module else ""
        lines = [f"with torch.no_grad(), rt.gathered({target}):",
                 f"    model.get_parameter({op.param!r}).{WRITES[op.variant]}"]
        if op.variant == RANK_WRITE:  # every rank must raise at the block's end (accepted): the program stops
            return lines + [f"not_refused({op!r})"]
        return lines + [f"    check.inside_gathered({target})"]
    if isinstance(op, Attach):  # every rank must raise ModelChanged at the forward (accepted): the program stops
        return _batch_line(op.batch, seen) + [
            f"attach(model, {op.module!r})  # a module whose parameters sit in its child, after shard()",
            "with torch.no_grad():", f"    model(x{op.batch})", f"not_refused({op!r})"]
    if isinstance(op, Evaluate):
        pre = [line for batch in op.batches for line in _batch_line(batch, seen)]
        mode = "torch.inference_mode()" if op.inference else "torch.no_grad()"
        return pre + ["model.eval()", f"with {mode}:",
                      f"    outs = [{', '.join(f'model(x{b})' for b in op.batches)}]",
                      "model.train()", "check.same(outs)  # plain torch's outputs", "del outs"]
    optimizers = "enumerate(opts)" if script.parts else "[(0, opt)]"
    if isinstance(op, Save):
        if op.full and op.optimizer:
            return ["saved_sd_and_opt = rt.full_state_dict()",
                    "check.full_state(saved_sd_and_opt)  # the reference's state dict",
                    f"saved_opt = [copy.deepcopy(o.state_dict()) for _, o in {optimizers}]"]
        if op.full:
            return ["saved_sd = rt.full_state_dict()", "check.full_state(saved_sd)  # the reference's state dict"]
        return ["saved_path = check.checkpoint_dir()  # one folder for every rank, kept to the end",
                f"for i, o in {optimizers}:",
                '    paramfsm.checkpoint.save(rt, f"{saved_path}/{i}", optimizer=o)',
                "check.sharded(rt.sharded_state_dict())  # each value holds this rank's Shard(0) range"]
    if isinstance(op, Restore):
        if op.full and op.optimizer:
            return ["rt.load_full_state_dict(saved_sd_and_opt)",
                    f"for (_, o), state in zip({optimizers}, saved_opt):", "    o.load_state_dict(state)"]
        if op.full:
            return ["rt.load_full_state_dict(saved_sd)"]
        if op.plain:  # paramfsm.verify.state_ops.load_plain_dcp, written out
            return [f"for i, o in {optimizers}:",
                    "    model_sd, optim_sd = rt.sharded_state_dict(), paramfsm.checkpoint.sharded_optim_state_dict(rt, o)",
                    "    loaded = {**model_sd, **optim_sd}",
                    '    dcp.load(loaded, checkpoint_id=f"{saved_path}/{i}")',
                    "    rt.load_sharded_state_dict({k: loaded[k] for k in model_sd})",
                    "    paramfsm.checkpoint.load_sharded_optim_state_dict(rt, o, {k: loaded[k] for k in optim_sd})"]
        return [f"for i, o in {optimizers}:", '    paramfsm.checkpoint.load(rt, f"{saved_path}/{i}", optimizer=o)']
    raise TypeError(f"not a program op: {op!r}")
