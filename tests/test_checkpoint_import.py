"""``import paramfsm`` and a first ``paramfsm.shard()`` leave ``torch.distributed.checkpoint`` unimported.

DCP is imported only by a save or a load (it pulls in hundreds of modules); a
fresh interpreter shows what a training script that never checkpoints pays.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent("""
    import json, os, sys, tempfile
    import torch
    import torch.distributed as dist
    import paramfsm
    import paramfsm.checkpoint
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    rt = paramfsm.shard(model)
    model(torch.randn(2, 4)).sum().backward()
    before = sorted(m for m in sys.modules if m.startswith("torch.distributed.checkpoint"))
    paramfsm.checkpoint.save(rt, os.path.join(tempfile.mkdtemp(), "ck"))
    after = "torch.distributed.checkpoint" in sys.modules
    dist.destroy_process_group()
    print(json.dumps({"before": before, "after": after}))
""")


@pytest.mark.slow  # over 5 s on two cores: make test-slow
def test_import_and_shard_do_not_import_dcp():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["before"] == [], f"imported before any save: {found['before'][:5]}"
    assert found["after"], "a save imports DCP (the check sees the module when it is there)"
