"""torch.compile on a sharded model (2 gloo ranks), compared with plain torch.

``torch.compile(model)`` compiles each unit's forward between paramfsm's hooks,
which Dynamo runs eagerly (see :mod:`paramfsm.engine.events.compile_guard`);
compiling each block instead, as torchtitan does, is the recipe the README
gives. Both train like plain torch, without a warning.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from patterns_common import Pair, batch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.lin = nn.Linear(dim, dim)

    def forward(self, x):
        return x + torch.tanh(self.lin(self.norm(x)))


def compile_job(rank, world, how, between=None):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block(), nn.Linear(8, 3))
    pair = Pair(model, rank, world, units=[Block, nn.Linear])
    if how == "model":
        run = torch.compile(pair.model, backend="aot_eager")
    else:  # per block, as torchtitan does
        for block in pair.model[:2]:
            block.forward = torch.compile(block.forward, backend="aot_eager")
        run = pair.model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            # A smaller last batch recompiles while the parameters hold gradients (between backward and step).
            (x,) = batch(step, world, 1 if between == "small_last" and step == 2 else 2, (8,))
            pair.zero_grad()
            run(pair.local(x)).pow(2).mean().backward()
            pair.ref.model(x).pow(2).mean().backward()
            if between == "eval":  # an eval forward between backward and step recompiles the blocks
                with torch.no_grad():
                    pair.model.eval()
                    evaluated = run(pair.local(x))
                    pair.model.train()
                    pair.ref.model.eval()
                    expected = pair.local(pair.ref.model(x))
                    pair.ref.model.train()
                torch.testing.assert_close(evaluated, expected, atol=1e-5, rtol=1e-5)
            pair.check_grads(f"step {step}", atol=1e-5)
            pair.step(f"step {step}")
    report = pair.finish()
    report["warnings"] = [str(w.message)[:200] for w in caught]
    return report


@pytest.mark.slow
@pytest.mark.parametrize("how", ["model", "per_block"])
def test_compiled_model_trains_like_plain_torch(ranks2, how):
    for report in ranks2.run(compile_job, how, timeout=300):
        assert report["checks"] == 6 and report["warnings"] == [], report


@pytest.mark.slow
@pytest.mark.parametrize("between", ["eval", "small_last"])
def test_recompiling_while_parameters_hold_gradients_trains_like_plain_torch(ranks2, between):
    """Dynamo describes each parameter it recompiles against, ``.grad`` included: the shard gradient there made
    it fail with InternalTorchDynamoError(NotGathered) (see [Note: a compiler sees no shard gradient])."""
    for report in ranks2.run(compile_job, "per_block", between, timeout=300):
        assert report["checks"] == 6, report
        assert not [w for w in report["warnings"] if "NotGathered" in w or "paramfsm" in w], report
