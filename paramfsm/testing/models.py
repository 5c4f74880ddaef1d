"""Small models shared by the tests, the demo, ``paramfsm verify`` and the benchmarks."""

from __future__ import annotations

import collections
import dataclasses

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """A pre-norm transformer block: single-head causal self-attention and an MLP."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device).triu(1)
        attn = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        x = x + self.proj(attn)
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm2(x))))


class TinyTransformer(nn.Module):
    """Token embedding, a few blocks, a final norm and an LM head (optionally tied to the embedding)."""

    def __init__(self, vocab: int = 32, dim: int = 16, depth: int = 2, seq: int = 8, tied: bool = False):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def mlp(width: int = 8, depth: int = 3, d_in: int = 4, d_out: int = 3) -> nn.Sequential:
    """Linear layers with tanh between them."""
    layers: list[nn.Module] = [nn.Linear(d_in, width), nn.Tanh()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.Tanh()]
    layers.append(nn.Linear(width, d_out))
    return nn.Sequential(*layers)


class GanPair(nn.Module):
    """A generator and a discriminator in one root, as a GAN sharded as one model: ``disc(gen(z))``."""

    def __init__(self, noise: int = 5, width: int = 7, data: int = 6):
        super().__init__()
        self.gen = nn.Sequential(nn.Linear(noise, width), nn.Tanh(), nn.Linear(width, data))
        self.disc = nn.Sequential(nn.Linear(data, width), nn.Tanh(), nn.Linear(width, 1))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.disc(self.gen(z))


@dataclasses.dataclass
class Encoded:
    """What :class:`Encoder` returns: a plain dataclass, not a registered pytree node."""

    features: torch.Tensor
    gate: torch.Tensor


#: What :class:`Scorer` returns: a namedtuple holding a nested container.
Scored = collections.namedtuple("Scored", "value extras")


class Encoder(nn.Module):
    """A unit whose forward returns a dataclass."""

    def __init__(self, d_in: int = 5, width: int = 7):
        super().__init__()
        self.proj = nn.Linear(d_in, width)
        self.gate = nn.Linear(d_in, width)

    def forward(self, x: torch.Tensor) -> Encoded:
        return Encoded(self.proj(x), self.gate(x))


class Scorer(nn.Module):
    """A unit whose forward returns a namedtuple with a dict of lists inside."""

    def __init__(self, width: int = 7, d_out: int = 5):
        super().__init__()
        self.value = nn.Linear(width, d_out)
        self.aux = nn.Linear(width, 3)

    def forward(self, h: torch.Tensor) -> Scored:
        return Scored(self.value(h), {"aux": [self.aux(h)]})


class StructuredNet(nn.Module):
    """Units returning a dataclass and a namedtuple of nested containers (make each class one unit)."""

    def __init__(self):
        super().__init__()
        self.enc = Encoder()
        self.scorer = Scorer()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        encoded = self.enc(x)
        scored = self.scorer(encoded.features * torch.sigmoid(encoded.gate))
        return scored.value + scored.extras["aux"][0].mean(-1, keepdim=True)


class Lift(nn.Module):
    """A unit that returns a view of its result (``linear(x).unsqueeze(0)``)."""

    def __init__(self, d_in: int = 5, width: int = 7):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, d_in) / d_in ** 0.5)
        self.bias = nn.Parameter(torch.zeros(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias).unsqueeze(0)


class ViewNet(nn.Module):
    """An in-place op on a view of a unit's output: ``h = lift(x).squeeze(0); h += mix(x)``."""

    def __init__(self, d_in: int = 5, width: int = 7):
        super().__init__()
        self.lift = Lift(d_in, width)
        self.mix = nn.Linear(d_in, width)
        self.out = nn.Linear(width, d_in)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.lift(x).squeeze(0)
        h += self.mix(x)
        return self.out(torch.tanh(h))


class FrozenNormNet(nn.Module):
    """A batch norm frozen in eval mode between two linear layers, as detection backbones freeze theirs.

    Its statistics are the running ones, whatever mode the model is in, so each sample is normalised alone
    (a training-mode batch norm would couple a rank's samples, which verify cannot compare with the global
    batch). Its weight and bias still train. The running statistics are drawn from torch's generator, so the
    normalisation is not the identity.
    """

    def __init__(self, d_in: int = 5, width: int = 7):
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.norm = nn.BatchNorm1d(width)
        self.out = nn.Linear(width, d_in)
        with torch.no_grad():
            self.norm.running_mean.normal_(0.0, 0.3)
            self.norm.running_var.uniform_(0.5, 2.0)
        self.norm.eval()

    def train(self, mode: bool = True):
        super().train(mode)
        self.norm.eval()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.norm(self.inp(x))))
