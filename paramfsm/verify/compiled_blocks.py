"""Compiled blocks for verify's programs (``Config.compiled``): each block's forward under ``torch.compile``.

The README recommends compiling each block after ``shard()``; an eval segment between a backward and its
step then recompiles the blocks while the parameters hold gradients (paramfsm #53, case 9). The runner and
the rendered reproductions call :func:`compile_blocks` right after ``shard()``.
"""

from __future__ import annotations

import threading

import torch
from torch import nn


def compile_blocks(model: nn.Module, names) -> None:
    """Compile each named block's forward, as the README recommends after ``shard()`` (``Config.compiled``).

    ``names``: the subject's blocks (:func:`paramfsm.verify.loop_helpers.default_blocks`); a model without
    blocks compiles each child that holds parameters. Dynamo's caches are reset first, so a program compiles from scratch whatever ran before it
    in the process. ``aot_eager`` traces forward and backward as inductor does, without generating code.

    Donated buffers are turned off: with them, a compiled backward refuses ``retain_graph=True`` ("compiled
    with non-empty donated buffers"), which verify's programs draw everywhere and its eager reference runs.
    """
    torch._dynamo.reset()
    torch._functorch.config.donated_buffer = False
    _thread_lock_for_progress_bars()
    modules = [model.get_submodule(name) for name in names] or [
        child for child in model.children() if next(child.parameters(), None) is not None]
    for module in modules:
        module.forward = torch.compile(module.forward, backend="aot_eager")


def _thread_lock_for_progress_bars() -> None:
    """Give the progress bar class of torch's FX interpreter a thread lock before it builds its default one.

    That class is tqdm's when tqdm is installed (``torch.hub.tqdm``), whose default lock holds a multiprocessing
    semaphore. A rank process of verify's pool is ended by its parent, so that semaphore is never released, and
    the parent's resource tracker printed a "leaked semaphore" warning under a passing run. Progress bars
    within one rank process need no lock between processes. torch's own fallback class has no lock to set.
    """
    set_lock = getattr(torch.fx.interpreter.tqdm, "set_lock", None)
    if set_lock is not None:
        set_lock(threading.RLock())
