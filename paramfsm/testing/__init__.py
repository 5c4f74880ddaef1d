"""The project's own test kit: plain-torch references, scenarios, models, subjects, the mutation runs.

:mod:`.reference` is the single-process plain-torch reference every scenario
is compared with; :mod:`.scenarios` runs the seed loop as a rank job;
:mod:`.models` and :mod:`.subjects` are the shared small models and verify
subjects; :mod:`.mutants` and :mod:`.mutation_score` check that verify kills
the fault catalogue and report ``make mutate``; :mod:`.gpu_check` is
``make gpu-check``.

Verification itself lives in :mod:`paramfsm.verify`; ``Subject``,
``verify_model`` and ``VerificationFailed`` are re-exported here, as they were
documented here first.
"""

from paramfsm.testing.reference import (
    Reference, assert_close_dicts, global_batch, rank_slice, sharded_grads, sharded_params,
)
from paramfsm.verify import Subject

__all__ = ["Reference", "assert_close_dicts", "global_batch", "rank_slice", "sharded_grads", "sharded_params",
           "Subject", "verify_model", "VerificationFailed"]


def __getattr__(name):
    if name in ("verify_model", "VerificationFailed"):
        import paramfsm.verify

        return getattr(paramfsm.verify, name)
    raise AttributeError(f"module 'paramfsm.testing' has no attribute {name!r}")
