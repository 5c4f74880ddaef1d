"""The private autograd queries paramfsm relies on, checked on the installed torch."""

from __future__ import annotations

import torch

from paramfsm.engine.events import graph_task as gt


def test_private_api_present_on_this_torch():
    assert gt.has_private_api(), f"torch {torch.__version__} lacks the graph-task queries; the fallback is in use"


def test_task_ids_and_keep_graph_per_backward():
    seen = []
    x = torch.randn(3, requires_grad=True)
    y = (x * 2).sin()
    y.register_hook(lambda g: seen.append((gt.current_task(), gt.keeps_graph())))
    y.sum().backward(retain_graph=True)
    torch.autograd.grad(y.sum(), x, create_graph=True)
    y.sum().backward()
    assert gt.current_task() == gt.NO_TASK
    assert [keep for _, keep in seen] == [True, True, False]
    assert len({task for task, _ in seen}) == 3, "each backward must be its own graph task"


def test_final_callback_runs_at_the_end_of_each_task():
    order = []
    x = torch.randn(2, requires_grad=True)
    y = x.exp()

    def hook(grad):
        order.append("hook")
        gt.queue_final_callback(lambda: order.append("final"))

    y.register_hook(hook)
    y.sum().backward(retain_graph=True)
    y.sum().backward()
    assert order == ["hook", "final", "hook", "final"]
