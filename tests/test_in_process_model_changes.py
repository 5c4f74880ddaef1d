"""Parameters changed after ``shard()`` (:mod:`paramfsm.sharding.model_changes`), on the one-rank group.

Each change is refused at the next forward with a :class:`ModelChanged` whose fields name the parameter by
its qualified name, its module, the rank and what happened; a shared module is named by its first name;
a closed runtime's model is plain torch again; and the process-wide forward hook lives only while a change
waits to be refused. The two-rank versions (the ranks drifting apart) are in ``test_shard_writes.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn.modules import module as torch_module

import paramfsm
from one_rank import one_rank  # noqa: F401 - fixture
from paramfsm.errors import ModelChanged
from paramfsm.sharding import model_changes


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 3)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _refused(model) -> ModelChanged:
    with pytest.raises(ModelChanged) as caught:
        model(torch.ones(2, 4))
    return caught.value


def _fields(error: ModelChanged) -> tuple:
    return error.param, error.module, error.rank, error.what


@pytest.mark.parametrize("change,fields", [
    (lambda m: delattr(m.b, "bias"), ("b.bias", "b", 0, "deleted")),
    (lambda m: m.b._parameters.__setitem__("weight", nn.Parameter(torch.ones(3, 4))),
     ("b.weight", "b", 0, "replaced by another tensor")),
    (lambda m: setattr(m.a, "weight", nn.Parameter(torch.ones(4, 4))),
     ("a.weight", "a", 0, "added or replaced after paramfsm.shard()")),
    (lambda m: setattr(m, "gain", nn.Parameter(torch.ones(3))),
     ("gain", "<root>", 0, "added or replaced after paramfsm.shard()")),
    (lambda m: setattr(m, "head", nn.Sequential(nn.Linear(3, 2))),
     ("head.0.weight", "<root>", 0, "attached after paramfsm.shard() with a new module")),
])
def test_each_change_is_refused_naming_the_parameter_its_module_the_rank_and_what_happened(one_rank, change,
                                                                                           fields):
    model = Net()
    rt = paramfsm.shard(model)
    change(model)
    error = _refused(model)
    assert _fields(error) == fields
    assert str(error).startswith(f"parameter '{fields[0]}' (module '{fields[1]}') was {fields[3]} on rank 0")
    with pytest.raises(ModelChanged):  # refused again, not only once
        model(torch.ones(2, 4))
    rt.detach()


def test_only_the_first_of_several_changes_is_named(one_rank):
    model = Net()
    rt = paramfsm.shard(model)
    model.gain = nn.Parameter(torch.ones(3))
    model.a.extra = nn.Parameter(torch.ones(1))
    assert _refused(model).param == "gain"
    rt.detach()


def test_a_shared_module_is_named_by_its_first_name(one_rank):
    model = Net()
    model.c = model.a  # the same Linear under a second name
    rt = paramfsm.shard(model)
    model.c.gain = nn.Parameter(torch.ones(4))
    assert _fields(_refused(model))[:2] == ("a.gain", "a")
    rt.detach()


def test_a_deleted_parameter_of_the_root_is_named_without_a_prefix(one_rank):
    model = nn.Linear(4, 3)
    rt = paramfsm.shard(model)
    del model.bias
    assert _fields(_refused(model)) == ("bias", "<root>", 0, "deleted")
    rt.detach()


def test_a_submodule_called_on_its_own_is_refused_too(one_rank):
    model = Net()
    rt = paramfsm.shard(model)
    model.b.weight = nn.Parameter(torch.ones(3, 4))
    with pytest.raises(ModelChanged, match="'b.weight'"):
        model.b(torch.ones(2, 4))
    rt.detach()


def test_changes_that_keep_the_partitioned_parameters_are_allowed(one_rank):
    model = Net()
    rt = paramfsm.shard(model)
    model.a.weight = model.a.weight  # the same parameter registered again
    model.scale = None  # a name without a parameter
    model.register_parameter("nothing", None)
    model.tail = nn.ReLU()  # a module without parameters
    model.add_module("empty", None)  # a name without a module
    model(torch.ones(2, 4))
    assert model_changes._forward_hook is None
    rt.detach()


def test_a_closed_runtime_s_model_is_plain_torch_again(one_rank):
    model = Net()
    rt = paramfsm.shard(model)
    model = rt.close()
    model.gain = nn.Parameter(torch.ones(3))
    model.a.weight = nn.Parameter(torch.ones(4, 4))
    model.head = nn.Linear(3, 2)
    assert model(torch.ones(2, 4)).shape == (2, 3)  # nothing to refuse: the model is no longer sharded


def test_a_plain_module_runs_while_a_sharded_model_s_change_waits(one_rank):
    """The hook that refuses the changed model runs for every module of the process: a model paramfsm does
    not shard computes as in plain torch meanwhile."""
    model = Net()
    rt = paramfsm.shard(model)
    model.gain = nn.Parameter(torch.ones(3))
    plain = nn.Linear(4, 2)
    assert plain(torch.ones(1, 4)).shape == (1, 2)
    rt.detach()


def test_the_process_wide_hook_lives_only_while_a_change_waits(one_rank):
    before = len(torch_module._global_forward_pre_hooks)
    model, other = Net(), Net()
    rt, rt_other = paramfsm.shard(model), paramfsm.shard(other)
    assert len(torch_module._global_forward_pre_hooks) == before  # nothing runs per forward until a change
    model.gain = nn.Parameter(torch.ones(3))
    other.gain = nn.Parameter(torch.ones(3))
    assert len(torch_module._global_forward_pre_hooks) == before + 1  # one hook for every watched model
    rt.detach()
    assert len(torch_module._global_forward_pre_hooks) == before + 1  # the other model still has its change
    rt_other.detach()
    assert len(torch_module._global_forward_pre_hooks) == before
    assert model_changes._forward_hook is None
