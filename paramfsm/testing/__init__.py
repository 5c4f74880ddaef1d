"""Testing support: a plain-torch reference to compare against, and (``paramfsm.testing.verify``)
property-based verification of training loops."""

from paramfsm.testing.reference import (
    Reference, assert_close_dicts, global_batch, rank_slice, sharded_grads, sharded_params,
)

__all__ = ["Reference", "assert_close_dicts", "global_batch", "rank_slice", "sharded_grads", "sharded_params"]
