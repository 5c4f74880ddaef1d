"""verify's per-block reentrant checkpointing on the blocks users train: Hugging Face's keyword arguments.

``paramfsm verify`` runs some programs with every block of the model under
reentrant activation checkpointing (:func:`paramfsm.verify.loop_helpers.reentrant_blocks`).
Hugging Face calls its blocks with keyword arguments (``attention_mask``,
``encoder_attention_mask``, ...); the wrapper must pass them on, so that
plain torch runs those programs and they are verified, not rejected as a
limit of the model. Checked in plain torch against the same model without
checkpointing.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from paramfsm.verify.loop_helpers import default_blocks, reentrant_blocks

transformers = pytest.importorskip("transformers")


def _grads(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_gpt2_blocks_run_under_reentrant_checkpointing_with_their_keyword_arguments():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=31, n_positions=16,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config)
    plain = copy.deepcopy(model)
    ids = torch.randint(0, 31, (2, 6), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 6)
    blocks = default_blocks(model)
    assert blocks == ("transformer.h.0", "transformer.h.1")
    with reentrant_blocks(model, blocks):
        out = model(ids, attention_mask=mask).logits
    assert model.config.use_cache is True, "the cache setting is restored after the with"
    out.pow(2).mean().backward()
    plain(ids, attention_mask=mask).logits.pow(2).mean().backward()
    got, want = _grads(model), _grads(plain)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-5, msg=name)


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, *, scale, shift=None):
        return self.lin(x) * scale + (0 if shift is None else shift)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Scaled(), Scaled()])

    def forward(self, x, scale):
        for layer in self.layers:
            x = torch.tanh(layer(x, scale=scale, shift=None))
        return x


def test_a_keyword_tensor_that_requires_grad_gets_its_gradient():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(3, 4)
    plain = copy.deepcopy(model)
    scale = torch.tensor(1.5, requires_grad=True)
    plain_scale = scale.detach().clone().requires_grad_()
    with reentrant_blocks(model, default_blocks(model)):
        out = model(x, scale)
    out.sum().backward()
    plain(x, plain_scale).sum().backward()
    torch.testing.assert_close(scale.grad, plain_scale.grad)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
