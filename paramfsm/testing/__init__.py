"""Testing support: a plain-torch reference to compare against, and (``paramfsm.testing.verify``)
property-based verification of training loops.

``verify_model`` and ``VerificationFailed`` (from ``paramfsm.testing.verify``) need hypothesis
(``pip install 'paramfsm[test]'``); they are imported on first use.
"""

from paramfsm.testing.reference import (
    Reference, assert_close_dicts, global_batch, rank_slice, sharded_grads, sharded_params,
)
from paramfsm.testing.subject import Subject

__all__ = ["Reference", "assert_close_dicts", "global_batch", "rank_slice", "sharded_grads", "sharded_params",
           "Subject", "verify_model", "VerificationFailed"]

_LAZY = {"verify_model", "VerificationFailed"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module("paramfsm.testing.verify"), name)
    raise AttributeError(f"module 'paramfsm.testing' has no attribute {name!r}")
