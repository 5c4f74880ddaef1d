"""The :class:`~paramfsm.verify.ops.Save` and :class:`~paramfsm.verify.ops.Restore` ops on a rank: what a
program keeps of the model and its optimizers, and the ways it loads them back (a full state dict with
torch's own optimizer state dicts, ``paramfsm.checkpoint.load``, or plain DCP in place).
"""

from __future__ import annotations


def load_plain_dcp(rt, optimizer, path: str) -> None:
    """Load a ``paramfsm.checkpoint.save`` folder with plain DCP, in place into the runtime's own state dicts
    (the :class:`~paramfsm.verify.ops.Restore` op's ``plain`` way; the lines a reproduction renders)."""
    import torch.distributed.checkpoint as dcp

    from paramfsm.checkpoint import state_dicts as ck

    model, optim = rt.sharded_state_dict(), ck.sharded_optim_state_dict(rt, optimizer)
    loaded = {**model, **optim}
    # Tensors in place; other values (param_groups) replaced in ``loaded``. On the runtime's own group: a rank
    # that stops before this load must not leave the other waiting in a collective of the default group.
    dcp.load(loaded, checkpoint_id=path, process_group=ck._dcp_group(rt))
    rt.load_sharded_state_dict({key: loaded[key] for key in model})
    ck.load_sharded_optim_state_dict(rt, optimizer, {key: loaded[key] for key in optim})


def save_state(rt, optimizers, op, check):
    """A :class:`~paramfsm.verify.ops.Save`: what a later Restore of its kind loads back. A full state dict
    (checked against the reference's) with torch's own optimizer state dicts when ``op.optimizer``, or a DCP
    folder the same on every rank holding a checkpoint per optimizer (each value of the sharded state dict
    checked to hold this rank's range)."""
    import copy

    import paramfsm.checkpoint as ck

    if op.full:
        sd = rt.full_state_dict()
        check.full_state(sd)
        return sd, [copy.deepcopy(opt.state_dict()) for opt in optimizers] if op.optimizer else []
    path = check.checkpoint_dir()
    for i, opt in enumerate(optimizers):
        ck.save(rt, f"{path}/{i}", optimizer=opt)
    check.sharded(rt.sharded_state_dict())
    return path


def restore_state(rt, optimizers, op, kept) -> None:
    """A :class:`~paramfsm.verify.ops.Restore` of ``kept`` (:func:`save_state`'s): the full state dict and the
    optimizers' own ``load_state_dict``, or each optimizer's DCP checkpoint by ``paramfsm.checkpoint.load``
    (by plain DCP in place when ``op.plain``)."""
    import paramfsm.checkpoint as ck

    if op.full:
        sd, optimizer_states = kept
        rt.load_full_state_dict(sd)
        for opt, state in zip(optimizers, optimizer_states):
            opt.load_state_dict(state)
        return
    for i, opt in enumerate(optimizers):
        if op.plain:
            load_plain_dcp(rt, opt, f"{kept}/{i}")
        else:
            ck.load(rt, f"{kept}/{i}", optimizer=opt)
