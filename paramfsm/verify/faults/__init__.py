"""The fault catalogue: real parameter-lifetime and training-loop bugs, each injectable for one block.

``paramfsm verify --fault NAME`` injects one on the ranks, so users can watch
verify catch a known bug on their own model; ``make mutants`` checks that
verify kills every entry. The entries live in :mod:`.catalogue` (lifetime
bugs in the scheduler, executor, hooks and graph tasks), :mod:`.training`
(loss scaling, clipping and sharded checkpoints) and :mod:`.user_paths`
(higher-order retain, tied state dicts, and what ``trace check`` reads);
:mod:`.patching` swaps one attribute for the duration of a block.
"""

from paramfsm.verify.faults.catalogue import CATALOGUE, FAULTS, Fault, activate, inject

__all__ = ["CATALOGUE", "FAULTS", "Fault", "activate", "inject"]
