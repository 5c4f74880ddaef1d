"""Which autograd graph task is running, and whether it keeps its graph.

torch exposes both only through private bindings:
``torch._C._current_graph_task_id()`` (-1 outside backward) and
``torch._C._autograd._get_current_graph_task_keep_graph()``. Both exist in
torch 2.11 and 2.13 (checked by ``tests/test_graph_task.py`` on the installed
version). When either is missing, paramfsm falls back to what it can know
for sure:

- without the task id, ``current_task()`` answers NO_TASK and backward
  hooks report the single anonymous task ``ANONYMOUS`` (nested backward
  passes, as in reentrant checkpointing, then share one task);
- without keep-graph, only ``rt.backward(loss, retain_graph=True)`` marks a
  backward as keeping its graph; a plain ``loss.backward(retain_graph=True)``
  is then treated as non-retained, which is the ``retain="regather"``
  behaviour: correct, with more communication.
"""

from __future__ import annotations

import torch
from torch.autograd import Variable

NO_TASK = -1
ANONYMOUS = 0

_task_id = getattr(torch._C, "_current_graph_task_id", None)
_keep_graph = getattr(getattr(torch._C, "_autograd", None), "_get_current_graph_task_keep_graph", None)

#: Set by rt.backward for the duration of its backward when the private keep-graph query is missing.
explicit_keep_graph: list[bool] = []


def has_private_api() -> bool:
    return _task_id is not None and _keep_graph is not None


def current_task() -> int:
    """The running graph task's id, or NO_TASK outside backward (or when torch cannot say)."""
    return _task_id() if _task_id is not None else NO_TASK


def backward_task() -> int:
    """The graph task a backward hook runs in: never NO_TASK."""
    task = current_task()
    return ANONYMOUS if task == NO_TASK else task


def keeps_graph() -> bool:
    """Whether the running backward keeps its graph (retain_graph=True or create_graph=True)."""
    if _keep_graph is not None:
        return bool(_keep_graph())
    return bool(explicit_keep_graph and explicit_keep_graph[-1])  # pragma: no cover


# Hooks call these on every unit of every step: where torch has the private queries, they are
# the queries themselves, with no Python frame in between (the same answers as above).
if _task_id is not None:
    current_task = _task_id  # noqa: F811
if _keep_graph is not None:
    keeps_graph = _keep_graph  # noqa: F811


def queue_final_callback(callback) -> None:
    """Run ``callback`` when the running graph task finishes (after every node and hook)."""
    Variable._execution_engine.queue_callback(callback)
