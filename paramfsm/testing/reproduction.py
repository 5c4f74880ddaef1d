"""A program as a runnable script, like the step listing of a hypothesis stateful test.

:func:`render` writes the preamble (process group, the subject from its
factory, ``paramfsm.shard`` with the program's configuration, the optimizer,
a ``batch(i)`` function that gives each rank its share of global batch ``i``)
and then one or a few lines of plain PyTorch and public paramfsm API per op.
The failing op is marked with ``# <- fails here``; the failure is quoted in
the docstring. Run the script with ``torchrun --nproc-per-node WORLD``.
"""

from __future__ import annotations

from paramfsm.testing.programs import (
    PENALTY_WEIGHT, Backward, Drop, Flush, Forward, Gathered, Loss, Penalty, Program, Step, ZeroGrad,
)


def render(program: Program, factory: str, *, per_rank: int, seed: int, fail_at: int | None = None,
           message: str = "", fault: str | None = None) -> str:
    """The program as a script for ``torchrun --nproc-per-node WORLD``; ``fail_at`` marks the failing op.

    ``fault``: the catalogued bug (:mod:`paramfsm.testing.faults`) the run injected; the script injects it too.
    """
    c = program.config
    inject = [f"paramfsm.testing.faults.inject({fault!r})  # the catalogued bug this run injected"] if fault else []
    lines = [
        '"""A failing training loop found by `paramfsm verify`.',
        "",
        *(f"{line}" for line in message.splitlines()),
        '"""',
        "import torch",
        "import torch.distributed as dist",
        "from torch.utils.checkpoint import checkpoint",
        "",
        "import paramfsm",
        *(["import paramfsm.testing.faults"] if fault else []),
        "from paramfsm.testing.subject import load_subject",
        "",
        *inject,
        'dist.init_process_group("gloo")',
        "rank, world = dist.get_rank(), dist.get_world_size()",
        f"torch.manual_seed({seed})",
        f"subject = load_subject({factory!r})",
        "model, make_batch, loss_fn = subject.model, subject.make_batch, subject.loss_fn",
        f"rt = paramfsm.shard(model, units=subject.units, retain={c.retain!r}, prefetch={c.prefetch}, "
        f"bucket_bytes={c.bucket_bytes}, max_deferred_bytes={c.max_deferred_bytes}, trace=True)",
        "opt = subject.optimizer(rt.shard_parameters())",
        "params = [p for p in model.parameters() if p.requires_grad]",
        "",
        "",
        "def batch(i):",
        '    """This rank\'s share of global batch i (identical data on every rank)."""',
        f"    inputs, targets = make_batch(torch.Generator().manual_seed({seed} * 1000 + i), world * {per_rank})",
        "    share = lambda t: t.chunk(world)[rank] if isinstance(t, torch.Tensor) else type(t)(map(share, t))",
        "    return share(inputs), share(targets)",
        "",
        "",
    ]
    seen: set[int] = set()
    for index, op in enumerate(program.ops):
        body = _render_op(op, seen)
        if index == fail_at:
            main = next((i for i in range(len(body) - 1, -1, -1) if not body[i].startswith("del ")), len(body) - 1)
            body[main] += "  # <- fails here"
        lines += body
    lines += ["dist.destroy_process_group()"]
    return "\n".join(lines) + "\n"


def _batch_line(batch: int, seen: set[int]) -> list[str]:
    if batch in seen:
        return []
    seen.add(batch)
    return [f"x{batch}, y{batch} = batch({batch})"]


def _render_op(op, seen: set[int]) -> list[str]:
    if isinstance(op, Forward):
        call = f"model(x{op.batch})"
        pre = _batch_line(op.batch, seen)
        if op.mode == "train":
            return pre + [f"out{op.out} = {call}"]
        if op.mode == "checkpoint":
            return pre + [f"out{op.out} = checkpoint(model, x{op.batch}, use_reentrant=False)"]
        if op.mode == "eval":
            return pre + ["model.eval()", f"out{op.out} = {call}", "model.train()"]
        if op.mode == "no_grad":
            return pre + ["with torch.no_grad():", f"    {call}"]
        return pre + ["model.eval()", "with torch.no_grad():", f"    {call}", "model.train()"]
    if isinstance(op, Loss):
        expr = (f"loss_fn(out{op.out}, y{op.batch})", f"out{op.out}.float().pow(2).mean()",
                f"out{op.out}.float().tanh().mean()")[op.variant]
        return [f"loss{op.loss} = {expr}"]
    if isinstance(op, Backward):
        arg = "retain_graph=True" if op.retain else ""
        if op.via_runtime:
            return [f"rt.backward(loss{op.loss}{', ' + arg if arg else ''})"]
        return [f"loss{op.loss}.backward({arg})"]
    if isinstance(op, Penalty):
        arg = "retain_graph=True" if op.retain else ""
        return [f"grads = torch.autograd.grad(loss{op.loss}, params, create_graph=True, allow_unused=True)",
                "penalty = sum(g.pow(2).sum() for g in grads if g is not None)",
                f"(loss{op.loss} + {PENALTY_WEIGHT} * penalty).backward({arg})",
                "del grads, penalty"]
    if isinstance(op, Drop):
        return ["del " + ", ".join([f"out{op.out}"] + [f"loss{k}" for k in op.losses])]
    if isinstance(op, ZeroGrad):
        return ["opt.zero_grad()"]
    if isinstance(op, Step):
        return ["opt.step()"]
    if isinstance(op, Flush):
        return ["rt.flush()"]
    if isinstance(op, Gathered):
        target = f"model.get_submodule({op.module!r})" if op.module else ""
        inner = ["    pass"] if op.batch is None else \
            ["    with torch.no_grad():", f"        model(x{op.batch})"]
        pre = [] if op.batch is None else _batch_line(op.batch, seen)
        return pre + [f"with rt.gathered({target}):"] + inner
    raise TypeError(f"not a program op: {op!r}")
