"""paramfsm: explicit, spec-driven lifetimes for partitioned parameters in PyTorch.

Every partitioned parameter is a finite state machine (NOT_AVAILABLE,
INFLIGHT, AVAILABLE, DEFERRED_RELEASE) defined in ``specs/param_lifetime.toml``.
Module and autograd hooks emit events, one scheduler applies them through
:func:`paramfsm.core.fsm.step`, and an executor runs the effects (all-gather, free,
reduce-scatter). See the README for the public contract.
"""

from paramfsm.core.spec import State
from paramfsm.errors import (
    ArgumentError, ArgumentTypeError, CollectiveTimeout, IllegalTransition, ModelChanged, ModelMismatch, NotGathered,
    ParamFSMError, RankDesync, SpecError, UnsupportedOutput,
)

__all__ = ["shard", "by_size", "Runtime", "State", "ParamFSMError", "IllegalTransition", "SpecError", "RankDesync",
           "CollectiveTimeout", "NotGathered", "ModelMismatch", "ModelChanged", "ArgumentError", "ArgumentTypeError",
           "UnsupportedOutput", "Offload", "plan"]
__version__ = "0.1.0"


def __getattr__(name: str):
    """Import the torch-backed runtime on first use, so the CLI and the pure core start fast."""
    if name in ("shard", "Runtime"):
        from paramfsm import runtime

        return getattr(runtime, name)
    if name == "Offload":
        from paramfsm.sharding.offload import Offload

        return Offload
    if name == "plan":
        from paramfsm.planning import plan

        return plan
    if name == "by_size":
        from paramfsm.engine.storage.units import by_size

        return by_size
    if name == "checkpoint":  # DCP and DTensor: imported by the first use, not by shard()
        import importlib

        return importlib.import_module("paramfsm.checkpoint")
    raise AttributeError(f"module 'paramfsm' has no attribute {name!r}")
