"""Small models shared by the tests, the demo, ``paramfsm verify`` and the benchmarks."""

from __future__ import annotations

import torch
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
