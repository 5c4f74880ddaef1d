"""Catalogued crashes in how units compute: a batch norm under ``param_dtype``, a compiler reading gradients.

Each function returns a context manager that patches paramfsm for the duration of the block (see
:mod:`paramfsm.verify.faults.catalogue`). Both are raw torch errors ``paramfsm #53`` (item 6) found in loops
from FSDP's own tests: a batch norm gathered in the compute dtype against its full-precision running
statistics, and Dynamo describing a parameter's ``.grad`` while it recompiles a block between a backward and
the step. ``paramfsm verify`` kills them through canonical programs: the batch norm through the one under
``Config(param_dtype="bfloat16")`` on ``frozen_norm_mlp``, the compiler through ``Config(compiled=True)`` on the
catalogue's subject.
"""

from __future__ import annotations

from torch import nn

from paramfsm.sharding import assembly
from paramfsm.engine.storage import partitioned
from paramfsm.verify.faults.patching import patched

FROZEN_NORM = "paramfsm.testing.subjects:frozen_norm_mlp"


def batch_norm_in_param_dtype():
    """Every parameter computes in ``param_dtype``, batch norms included (no module is seen as one)."""
    return patched(assembly, "compute_dtypes",
                   lambda original: lambda model, records, param_dtype: original(nn.Module(), records, param_dtype))


class _NeverTracing:
    """A ``TracingContext`` stand-in that never reports a trace in progress."""

    @staticmethod
    def try_get():
        return None


def compiler_reads_shard_grad():
    """A parameter's ``.grad`` is the shard gradient's view under Dynamo too, which reads it as a full tensor."""
    return patched(partitioned, "TracingContext", lambda original: _NeverTracing)


#: The entries, as the fields of :class:`~paramfsm.verify.faults.catalogue.Fault` (name, bug, source, kind,
#: inject, trace_scenario, subject).
COMPUTE = (
    ("batch_norm_in_param_dtype",
     "a batch norm's parameters are gathered in param_dtype against its float32 running statistics",
     "paramfsm #53, item 6 (BatchNorm1d/2d under param_dtype=torch.bfloat16: 'expected scalar type BFloat16 "
     "but found Float'; FSDP1's mixed precision keeps batch norms in full precision by default)",
     "correctness", batch_norm_in_param_dtype, None, FROZEN_NORM),
    ("compiler_reads_shard_grad",
     "Dynamo recompiling a block while the parameters hold gradients reads the shard gradient's view",
     "paramfsm #53, item 6 (an eval forward between backward and step under the README's per-block "
     "torch.compile: InternalTorchDynamoError(NotGathered), blaming a gradient read the user never made)",
     "correctness", compiler_reads_shard_grad),
)
