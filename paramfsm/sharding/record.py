"""The runtime record: everything a sharded model's runtime holds, declared once.

:func:`paramfsm.sharding.assembly.assemble` builds every part in one pass and
constructs the runtime with all of them; :class:`paramfsm.runtime.Runtime` is
this record plus the public methods, and adds no state of its own.

[Note: a runtime's state is declared]
A runtime used to be built by setting attributes on it from several modules
(the assembly, the meta-device guard, the reshard policy, the memory plan), so
what a runtime held was written nowhere, and a module could add a field
nobody else knew of. Now every field is declared here, with what it is for,
and the engine's parts receive their wiring as constructor arguments (the
step context, the flight recorder's failure hook, the units kept after
forward, the offload plan, the collective names). The record is slotted, and
the runtime refuses to be given an attribute that is not a field here or a
method of its class (a test may still stand a spy in for a method). Two fields
change after construction, both in :mod:`paramfsm.sharding.teardown` as the
model is handed back: ``offload`` (paged back in and dropped) and
``_handles`` (removed).
"""

from __future__ import annotations

import attrs


@attrs.define(slots=True, kw_only=True, eq=False, repr=False)
class RuntimeRecord:
    """The fields of a runtime. Each is documented once, here."""

    #: The model whose parameters are partitioned (``rt.close()`` hands it back).
    model: object
    #: The process group parameters are sharded over, this rank's place in it, and its size.
    group: object
    rank: int
    world: int
    #: Hybrid sharding: the 2-D ``DeviceMesh`` (None: 1-D), the group parameters are replicated over, and its
    #: size (1 without a mesh).
    mesh: object
    replicate_group: object
    replicas: int
    #: The compiled lifetime spec (``paramfsm.core.fsm.Table``) every transition is looked up in.
    table: object
    #: The units, in model order (``paramfsm.engine.storage.units.Unit``).
    units: list
    #: Who is stepping (rank, training step, graph task, trace), shared by the scheduler, the executor and the
    #: offload residency; ``rt.set_step`` pins its step.
    ctx: object
    #: The trace (always one: ``rt.trace`` works with ``trace=0``) and the flight recorder that dumps it when
    #: something fails.
    trace: object
    flight: object
    #: The executor: collectives, packing, freeing, and the gradients kept under ``no_sync``.
    executor: object
    #: The scheduler: the one place events become transitions and effects. The runtime's bodies call its
    #: facade methods (``shard_scope``, ``shards_written``, ``hold``, ``recover`` and the like), nothing inside it.
    scheduler: object
    #: The scheduler's gradient routing (``paramfsm.engine.schedule.grad_order.GradRouting``): whether a
    #: backward reduce-scatters (``sync``), and the reduce-scatter of gradients kept under ``no_sync``.
    grads: object
    #: The executor's gradients kept on this rank under ``no_sync`` (``paramfsm.engine.effects.grad_sync``).
    unsynced: object
    #: The offload plan (``paramfsm.sharding.offload.OffloadPlan``), or None when nothing is offloaded.
    offload: object
    #: Each parameter's record by ``id(param)``, by every qualified name it has (tied names too), and its
    #: position (which numbers the full-tensor collectives' tags).
    _by_id: dict
    _by_name: dict
    _index: dict
    #: Every hook handle the runtime installed, removed by ``close``/``detach``.
    _handles: list
    #: The watch on the model's structure (``paramfsm.sharding.model_changes``).
    _watch: object
    #: What of a meta-built model's values is not set yet, and the forward guard while so
    #: (``paramfsm.sharding.meta.Values``).
    _values: object
    #: The options ``rt.plan()`` rehearses (``shard()``'s, as given).
    _planned: dict

    def __setattr__(self, name, value):
        if name not in _FIELDS and not hasattr(type(self), name):
            raise AttributeError(f"a runtime has no field {name!r}: every field is declared in "
                                 "paramfsm.sharding.record.RuntimeRecord ([Note: a runtime's state is declared])")
        object.__setattr__(self, name, value)


_FIELDS = frozenset(field.name for field in attrs.fields(RuntimeRecord))
