"""Run inside a fresh environment that has the built wheel installed: does paramfsm work as a user gets it?

``.ci/check_wheel.py`` copies this file into a temporary folder and runs it there with the new
environment's Python, so nothing of the checkout is importable. It checks that paramfsm and its data
files (the shipped spec, the CUDA kernel source) come from that environment, that the version the code
reports is the one pip installed, that the integration extras import, and that a small model sharded on
one gloo rank trains the two-loss retained-graph loop as plain torch does.

Usage: python wheel_smoke.py CHECKOUT. Exit 0 when all of it holds; an AssertionError says what did not.
"""

from __future__ import annotations

import copy
import importlib.metadata
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

import paramfsm
from paramfsm import State
from paramfsm.core.spec import DEFAULT_SPEC, load_spec
from paramfsm.engine.effects.kernels.cupy_impl import kernel_source


def check_installation(checkout: Path) -> None:
    """paramfsm, its spec and its kernel source come from this environment; the versions agree."""
    package = Path(paramfsm.__file__).resolve().parent
    environment = Path(sys.prefix).resolve()
    assert package.is_relative_to(environment), f"paramfsm imported from {package}, not from {environment}"
    assert not package.is_relative_to(checkout), f"paramfsm imported from the checkout: {package}"
    assert DEFAULT_SPEC.resolve() == package / "specs" / "param_lifetime.toml", f"the spec is read from {DEFAULT_SPEC}"
    spec = load_spec()
    assert spec.initial == "NOT_AVAILABLE" and len(spec.states) == 4, spec
    assert 'extern "C"' in kernel_source(), "pack.cu is empty or not the kernel source"
    installed = importlib.metadata.version("paramfsm")
    assert installed == paramfsm.__version__, f"metadata says {installed}, paramfsm.__version__ {paramfsm.__version__}"


def check_extras() -> None:
    """The extras bring what the integrations and ``paramfsm verify`` import (hf, verify, accelerate, peft,
    lightning).

    ``paramfsm verify`` itself runs as a command afterwards (see check_wheel.py).
    """
    import accelerate  # noqa: F401  (ShardedTrainer's Accelerator)
    import hypothesis  # noqa: F401
    import safetensors.torch  # noqa: F401

    from paramfsm.integrations import accelerate as with_accelerate
    from paramfsm.integrations import hf, lightning, peft

    assert callable(hf.load_pretrained) and callable(peft.save_adapter)
    assert issubclass(with_accelerate.Accelerator, accelerate.Accelerator)
    assert lightning.ParamFSMStrategy.strategy_name == "paramfsm"


def check_training(store: Path) -> None:
    """One rank, gloo: two losses on one forward with a retained graph, three steps, against plain torch."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        plain = copy.deepcopy(model)
        rt = paramfsm.shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
        for step in range(3):
            x, y = torch.randn(6, 8), torch.randn(6, 4)
            for net, optimizer in ((model, opt), (plain, plain_opt)):
                out = net(x)
                l1, l2 = torch.nn.functional.mse_loss(out, y), out.square().mean()
                optimizer.zero_grad()
                l1.backward(retain_graph=True)
                if net is model:
                    assert rt.state("0.weight") is State.DEFERRED_RELEASE, rt.state("0.weight")
                optimizer.zero_grad()
                l2.backward()
                optimizer.step()
            assert all(state is State.NOT_AVAILABLE for state in rt.states().values()), rt.states()
        for name, expected in plain.named_parameters():
            torch.testing.assert_close(rt.full_param(name), expected.detach(), msg=lambda m: f"{name}: {m}")
        rt.close()
    finally:
        dist.destroy_process_group()


def main() -> int:
    checkout = Path(sys.argv[1]).resolve()
    check_installation(checkout)
    check_extras()
    with tempfile.TemporaryDirectory() as tmp:
        check_training(Path(tmp) / "store")
    print(f"paramfsm {paramfsm.__version__} from {Path(paramfsm.__file__).parent}: installed files, extras and "
          "a one-rank training loop match plain torch")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
