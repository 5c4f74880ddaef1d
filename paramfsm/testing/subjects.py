"""Verification subjects (factories for ``paramfsm verify``) built from the shared test models.

Each function here is a factory: ``paramfsm verify paramfsm.testing.subjects:tiny_transformer``.
``branchy_lm`` is the model the fault catalogue is checked against: it has
tied embedding and head weights, and an adapter used only in training mode,
so an eval-mode forward changes the unit order and leaves a prefetch unused.
``experts_lm`` is the subject of the catalogue's faults about gradients
missing on some ranks and reads outside a unit: a mixture of experts routed
by token id, made one unit, and an output layer tied through ``F.linear``.
``sized_lm`` is sized so that the default units merge some modules and keep
others, and its root reads the embedding's weight (a tied output layer).
``once_differentiable_mlp`` has an activation without double backward, so
plain torch cannot run its gradient penalties: verify rejects those programs.
The subjects of the user-loop ops (:mod:`paramfsm.verify.user_loop_intents`):
``gan_pair``, a generator and a discriminator in one root with an optimizer
each; ``structured_outputs``, units returning a dataclass and a namedtuple of
nested containers; ``view_outputs``, a unit returning a view and an in-place
op on a view of a unit's output; ``mlp_one_unit``, a model sharded as one
unit (no unit below the root for a sub-forward to run). ``frozen_norm_mlp``
holds a batch norm frozen in eval mode, kept in full precision under
``param_dtype``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from paramfsm.testing.models import Block, Encoder, FrozenNormNet, GanPair, Scorer, StructuredNet, TinyTransformer, ViewNet, mlp
from paramfsm.verify.subject import Subject

# Odd sizes on purpose: with a width of 13 and a vocabulary of 29, most parameters (embedding and
# head 377, projections 169, norms and biases 13) divide by neither 2 nor 3, so every run at world 2
# or 3 pads shards and exercises the padded pack, unpack, reduce and state-dict paths.
VOCAB, SEQ, DIM = 29, 8, 13


def token_batch(generator: torch.Generator, n: int):
    """Random token sequences and next-token targets."""
    tokens = torch.randint(0, VOCAB, (n, SEQ), generator=generator)
    targets = torch.randint(0, VOCAB, (n, SEQ), generator=generator)
    return tokens, targets


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def tiny_transformer() -> Subject:
    """The demo model: ``paramfsm.testing.models.TinyTransformer``."""
    return Subject(TinyTransformer(vocab=VOCAB, dim=DIM, depth=2, seq=SEQ), token_batch, lm_loss)


def tiny_transformer_tied() -> Subject:
    """The demo model with its LM head tied to the token embedding."""
    return Subject(TinyTransformer(vocab=VOCAB, dim=DIM, depth=2, seq=SEQ, tied=True), token_batch, lm_loss)


def init_tiny_transformer(module: nn.Module) -> None:
    """``fn`` for ``rt.init_weights``: ``reset_parameters()``, and the learned positions of the model itself."""
    if callable(getattr(module, "reset_parameters", None)):
        module.reset_parameters()
    if isinstance(module, TinyTransformer):
        nn.init.normal_(module.pos, std=0.02)


def tiny_transformer_meta() -> Subject:
    """The tied demo model built on the meta device and initialised with ``rt.init_weights`` (``Subject(meta=True)``)."""
    return Subject(TinyTransformer(vocab=VOCAB, dim=DIM, depth=2, seq=SEQ, tied=True), token_batch, lm_loss,
                   meta=True, init=init_tiny_transformer)


def regression_batch(generator: torch.Generator, n: int):
    return torch.randn(n, 5, generator=generator), torch.randn(n, 5, generator=generator)


def mlp_regression() -> Subject:
    """A tanh MLP with a mean-squared-error loss (sizes 35, 49, 7, 5: none divisible by 2 or 3)."""
    return Subject(mlp(width=7, depth=3, d_in=5, d_out=5), regression_batch, F.mse_loss)


def mlp_one_unit() -> Subject:
    """``mlp_regression`` sharded as one unit (``units=lambda name, module: False``)."""
    return Subject(mlp(width=7, depth=3, d_in=5, d_out=5), regression_batch, F.mse_loss,
                   units=lambda name, module: False)


def frozen_norm_mlp() -> Subject:
    """``FrozenNormNet``: a batch norm in eval mode (its weight and bias trained) between linear layers. Under
    ``param_dtype`` it computes in full precision, as FSDP's mixed precision does by default."""
    return Subject(FrozenNormNet(), regression_batch, F.mse_loss)


def noise_batch(generator: torch.Generator, n: int):
    """Noise for the generator and a real-or-fake label per sample."""
    return torch.randn(n, 5, generator=generator), torch.randint(0, 2, (n, 1), generator=generator).float()


def gan_pair() -> Subject:
    """``GanPair``: G and D one unit each, one optimizer each (``parts``; D, the last, is the critic)."""
    return Subject(GanPair(), noise_batch, F.binary_cross_entropy_with_logits, units=[nn.Sequential],
                   parts=("gen", "disc"))


def structured_outputs() -> Subject:
    """``StructuredNet``: one unit returns a plain dataclass, one a namedtuple of a dict of lists."""
    return Subject(StructuredNet(), regression_batch, F.mse_loss, units=[Encoder, Scorer])


def view_outputs() -> Subject:
    """``ViewNet``: a unit returns a view; the root adds to a view of it in place."""
    return Subject(ViewNet(), regression_batch, F.mse_loss)


class BranchyLM(nn.Module):
    """Tied embedding/head, two blocks, and an adapter that only runs in training mode."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(DIM) for _ in range(2))
        self.adapter = nn.Linear(DIM, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.blocks[0](self.embed(tokens))
        if self.training:
            x = x + self.adapter(x)
        return self.head(self.norm(self.blocks[1](x)))


def branchy_lm() -> Subject:
    """The fault catalogue's subject (see the module docstring). A unit per module unless a program draws
    another unit choice: the catalogue's canonical programs are about lifetimes between units, and under the
    default the whole model (a few KB) would be one."""
    return Subject(BranchyLM(), token_batch, lm_loss, min_unit_bytes=0)


#: ``SizedLM``'s vocabulary: its embedding (1291 x 13 float32, 67 KB) is just over the default min_unit_bytes.
SIZED_VOCAB = 1291


class SizedLM(nn.Module):
    """An embedding big enough to be a unit of its own under the default units, two small residual MLPs that
    the default merges into the root, and an output layer tied through ``F.linear`` in the root's forward (a
    read of another unit's parameter)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(SIZED_VOCAB, DIM)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM))
                                    for _ in range(2))
        self.norm = nn.LayerNorm(DIM)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = x + block(x)
        return F.linear(self.norm(x), self.embed.weight)


def sized_batch(generator: torch.Generator, n: int):
    tokens = torch.randint(0, SIZED_VOCAB, (n, SEQ), generator=generator)
    return tokens, torch.randint(0, SIZED_VOCAB, (n, SEQ), generator=generator)


def sized_lm() -> Subject:
    """The default units' subject: they keep the embedding a unit and merge the rest into the root, which reads
    the embedding's weight (see :class:`SizedLM`). Every ``shard()`` default is the user's."""
    import warnings

    from paramfsm.engine.schedule.on_demand import ReadOutsideUnit

    warnings.filterwarnings("ignore", category=ReadOutsideUnit)  # the read is this subject's point
    return Subject(SizedLM(), sized_batch, lm_loss)


class _OnceDifferentiableTanh(torch.autograd.Function):
    """tanh whose backward cannot be differentiated again (like SDPA's fused CPU kernel in torch 2.13)."""

    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * (1 - y * y)


class OnceDifferentiableMLP(nn.Module):
    """An MLP whose activation has no double backward: plain torch cannot take its gradient penalties."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(5, 7)
        self.outer = nn.Linear(7, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.outer(_OnceDifferentiableTanh.apply(self.inner(x)))


def once_differentiable_mlp() -> Subject:
    """A model-limit subject: verify must reject its gradient-penalty programs, not report them as bugs."""
    return Subject(OnceDifferentiableMLP(), regression_batch, F.mse_loss)


class TokenExperts(nn.Module):
    """A mixture of experts routed by token id (data-dependent: an expert may get no token on a rank)."""

    def __init__(self, experts: int = 8):
        super().__init__()
        self.router = nn.Linear(DIM, experts)
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(experts))

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        flat, ids = x.reshape(-1, DIM), tokens.reshape(-1) % len(self.experts)
        gate = F.softmax(self.router(flat), dim=-1)
        out = flat
        for i, expert in enumerate(self.experts):
            rows = (ids == i).nonzero().squeeze(-1)
            if rows.numel():
                out = out.index_add(0, rows, expert(flat[rows]) * gate[rows, i:i + 1])
        return out.reshape(x.shape)


class ExpertsLM(nn.Module):
    """An embedding, a mixture of experts made one unit, and an output layer tied through F.linear in the
    root's forward (a read outside the embedding's unit, gathered on demand)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.moe = TokenExperts()
        self.norm = nn.LayerNorm(DIM)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(self.moe(self.embed(tokens), tokens)), self.embed.weight)


def experts_lm() -> Subject:
    """The subject of the catalogue's faults about missing gradients and reads outside a unit."""
    import warnings

    from paramfsm.engine.schedule.on_demand import ReadOutsideUnit

    warnings.filterwarnings("ignore", category=ReadOutsideUnit)  # the read is this subject's point
    return Subject(ExpertsLM(), token_batch, lm_loss, units=[TokenExperts, nn.Embedding, nn.LayerNorm])
