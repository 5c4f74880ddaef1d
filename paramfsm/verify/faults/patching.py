"""Monkeypatching for the fault catalogue (:mod:`paramfsm.verify.faults`): one attribute, for one block."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator


@contextlib.contextmanager
def patched(owner, attr: str, make: Callable) -> Iterator[None]:
    """Replace ``owner.attr`` with ``make(original)`` for the duration of the block.

    An attribute ``owner`` only inherits (a method of torch's ``GradScaler``
    on paramfsm's subclass) is deleted again afterwards, not copied in.
    """
    own = attr in vars(owner)
    original = getattr(owner, attr)
    setattr(owner, attr, make(original))
    try:
        yield
    finally:
        if own:
            setattr(owner, attr, original)
        else:
            delattr(owner, attr)
