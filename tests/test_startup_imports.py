"""A plain ``paramfsm.shard()`` at world 1 imports none of the heavy torch machinery.

DCP, DTensor, the compile stack (``torch._dynamo``, ``torch._inductor``) and sympy
cost seconds and tens of MB per rank; ``shard()`` and a training step must not
import them unless ``import torch`` and a gloo group already did. A fresh
interpreter shows what a training script that never checkpoints or compiles
pays: the baseline imports torch and starts a group, the other also shards a
model and trains a step, and then asks for a sharded state dict, which must pull
DTensor in (so the check sees what it looks for).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

HEAVY = ("torch.distributed.checkpoint", "torch.distributed.tensor", "torch._dynamo", "torch._inductor", "sympy")

SCRIPT = textwrap.dedent("""
    import json, os, sys, tempfile
    import torch
    import torch.distributed as dist
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    heavy = lambda: sorted(m for m in sys.modules if m.split(".")[0] == "sympy" or m.startswith({heavy}))
    found = {{"baseline": heavy()}}
    if sys.argv[1] == "shard":
        import paramfsm
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        rt = paramfsm.shard(model)
        model(torch.randn(2, 4)).sum().backward()
        found["shard"] = heavy()
        rt.sharded_state_dict()
        found["checkpoint"] = heavy()
    print(json.dumps(found))
""").format(heavy=repr(tuple(HEAVY)))


def imported(mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], cwd=REPO, capture_output=True, text=True,
                         timeout=300, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow  # over 5 s on two cores: make test-slow
def test_shard_imports_no_heavy_module_beyond_torch_itself():
    baseline = set(imported("baseline")["baseline"])
    found = imported("shard")
    assert set(found["baseline"]) == baseline
    assert sorted(set(found["shard"]) - baseline) == []
    assert "torch.distributed.tensor" in found["checkpoint"], "a sharded state dict is where DTensor comes in"
