"""A paged-out tensor (:mod:`paramfsm.engine.storage.paged`): metadata passes, every read pages it in through its
pager or raises :class:`~paramfsm.errors.NotResident` naming the parameter, and revealing it gives back a plain
tensor of its own class ([Note: the class of a paged-out tensor])."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from paramfsm.engine.storage import paged
from paramfsm.errors import NotResident


def _out(tensor: torch.Tensor, page_in=None, owner=("layer.weight", "shard", "layer", 1)) -> torch.Tensor:
    paged.OWNERS[tensor] = owner
    if page_in is not None:
        paged.PAGERS[tensor] = page_in
    paged.conceal(tensor)
    return tensor


def _users_tensor() -> torch.Tensor:
    """A tensor of a user's subclass, named in lower case; a new class each call, so its paged-out class is made
    by the test that conceals it and not taken from an earlier one."""
    return torch.arange(6.0).reshape(2, 3).as_subclass(type("scaledTensor", (torch.Tensor,), {}))


@pytest.mark.parametrize("make, name", [(lambda: torch.arange(6.0).reshape(2, 3), "PagedOutTensor"),
                                        (lambda: nn.Parameter(torch.arange(6.0).reshape(2, 3)), "PagedOutParameter"),
                                        (_users_tensor, "PagedOutScaledTensor")])
def test_a_paged_out_tensor_keeps_its_metadata_and_its_own_class_underneath(make, name):
    tensor = make()
    plain = type(tensor)
    _out(tensor)
    guard = type(tensor)
    assert paged.is_paged_out(tensor) and guard.__name__ == name and issubclass(guard, plain)
    assert guard.__module__ == "paramfsm.engine.storage.paged" and plain.__name__ in guard.__doc__
    assert tensor.shape == (2, 3) and tensor.dtype == torch.float32 and tensor.numel() == 6 and tensor.dim() == 2
    assert tensor.size(1) == 3 and tensor.size(dim=0) == 2 and tensor.element_size() == 4
    assert tensor.is_floating_point()
    assert paged.working(tensor).stride() == (0, 0), "no storage is held: one element expanded to the shape"
    with pytest.raises(NotResident):
        tensor.sum()
    again = torch.zeros(2, 3).as_subclass(plain)
    _out(again)
    assert type(again) is guard, "one paged-out class per plain class"
    paged.reveal(tensor, torch.ones(2, 3))
    assert type(tensor) is plain and not paged.is_paged_out(tensor) and torch.equal(tensor, torch.ones(2, 3))
    paged.conceal(tensor)
    paged.conceal(tensor)  # concealing a paged-out tensor again keeps its class
    assert type(tensor) is guard


def test_a_read_with_no_pager_raises_not_resident_naming_the_parameter():
    tensor = _out(torch.zeros(4))
    with pytest.raises(NotResident) as info:
        tensor.sum()
    assert str(info.value) == (
        f"{torch.Tensor.sum.__qualname__} read the shard of parameter 'layer.weight' (unit 'layer', rank 1) while "
        "it is paged out to its offload tier, and it could not be paged in here (the runtime is closed, or the "
        "read runs on another thread). What to do: read it on the training thread while the runtime is open, or "
        "after rt.close() read the model's parameters instead.")
    unnamed = _out(torch.zeros(2), owner=None)
    del paged.OWNERS[unnamed]
    with pytest.raises(NotResident, match="the value of parameter '<unknown>' \\(unit '<unknown>', rank -1\\)"):
        unnamed + 1


def test_a_read_pages_in_through_the_pager_every_operand_included():
    calls = []

    def page_in(tensor):
        calls.append(tensor)
        paged.reveal(tensor, torch.full((3,), 2.0))
        return True

    first, second = _out(torch.zeros(3), page_in), _out(torch.zeros(3), page_in)
    total = torch.cat([first, second]).sum()  # operands inside a list are paged in too
    assert total.item() == 12.0 and len(calls) == 2 and not paged.is_paged_out(first)
    third = _out(torch.zeros(3), page_in)
    assert torch.add(torch.ones(3), other=third).tolist() == [3.0, 3.0, 3.0], "a keyword operand too"
    refused = _out(torch.zeros(3), lambda tensor: False)
    with pytest.raises(NotResident):
        refused * 2


def test_gradient_and_hooks_pass_without_a_page_in():
    weight = nn.Parameter(torch.zeros(3))
    _out(weight, lambda tensor: pytest.fail("a metadata access paged the value in"))
    weight.grad = torch.ones(3)  # a shard gradient assigned to a paged-out shard
    assert torch.equal(weight.grad, torch.ones(3)) and weight.requires_grad and weight.is_leaf
    handle = weight.register_post_accumulate_grad_hook(lambda p: None)
    handle.remove()
    del weight.grad
    assert weight.grad is None
    weight.data = torch.full((3,), 5.0)  # setting .data is how finish_read restores it
    assert paged.is_paged_out(weight) and torch.equal(paged.working(weight), torch.full((3,), 5.0))


def test_reading_data_is_a_read():
    tensor = _out(torch.zeros(3))
    with pytest.raises(NotResident, match="parameter 'layer.weight'"):
        tensor.data
