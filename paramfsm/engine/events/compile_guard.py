"""Hooks run eagerly under ``torch.compile``: a compiled model breaks its graph at every unit boundary.

``torch.compile(model)`` on a sharded model makes Dynamo trace the model's
``__call__``, hooks included. The hooks gather and free parameters through
collectives and switch the parameters' classes (:mod:`paramfsm.engine.storage.placeholder`),
none of which Dynamo can trace, and a parameter introspected while it is an
empty placeholder would fail inside Dynamo with an internal error.

[Note: hooks are opaque to Dynamo]
Every module hook paramfsm installs is wrapped by :func:`eager`, which does
what ``torch.compiler.disable`` does without importing Dynamo (importing it
takes seconds, and most programs never compile): the wrapper carries
Dynamo's ``_torchdynamo_disable`` mark, so Dynamo breaks the graph at the
call and runs the hook as plain Python; the wrapper's code is marked for
Dynamo's frame evaluation to skip (what ``torch._dynamo.eval_frame.skip_code``
does), and it turns frame evaluation off for the hook's own frames. These
are torch's C-level entry points (``torch._C._dynamo.eval_frame``), private:
re-check them on every torch version. So the compiled model runs each
unit's forward as a compiled graph between eager hooks, which find and leave
the parameters exactly as in an uncompiled forward, and the numbers are plain
torch's. Compiling each unit (``block.compile()`` or
``block.forward = torch.compile(block.forward)`` for every block, as
torchtitan does) gives the same graphs with fewer breaks to discover. Outside
compilation the wrapper costs two C calls per hook.
"""

from __future__ import annotations

from torch._C._dynamo.eval_frame import _FrameAction, _FrameExecStrategy, set_code_exec_strategy, set_eval_frame


def eager(fn):
    """``fn`` as a hook Dynamo does not trace (see [Note: hooks are opaque to Dynamo])."""

    def run(*args, **kwargs):
        prior = set_eval_frame(None)
        try:
            return fn(*args, **kwargs)
        finally:
            set_eval_frame(prior)

    run._torchdynamo_disable = True
    run._torchdynamo_disable_recursive = True
    return run


# The wrapper's frames are never compiled (one code object for every wrapper).
set_code_exec_strategy(next(c for c in eager.__code__.co_consts if getattr(c, "co_name", None) == "run"),
                       _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.DEFAULT))
