"""Property-based verification of training loops: ``paramfsm verify`` and :func:`verify_model`.

Hypothesis draws training-loop programs (:mod:`.programs`, :mod:`.ops`); each
runs on local gloo ranks (:mod:`.runner`) beside an unsharded plain-torch
copy (:mod:`.mirror`), checked after every op (:mod:`.checker`,
:mod:`.checks`); a failure is shrunk and printed as a runnable reproduction
(:mod:`.reproduction`). :mod:`.subject` describes the model under test,
:mod:`.search` drives hypothesis, :mod:`.command` is the command line, and
:mod:`.faults` is the catalogue of real bugs verify must catch.

``verify_model`` and ``VerificationFailed`` need hypothesis (``pip install
'paramfsm[test]'``); they are imported on first use, so ``Subject`` does not.
"""

from paramfsm.verify.subject import Subject

__all__ = ["Subject", "verify_model", "VerificationFailed"]

_LAZY = {"verify_model", "VerificationFailed"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module("paramfsm.verify.search"), name)
    raise AttributeError(f"module 'paramfsm.verify' has no attribute {name!r}")
