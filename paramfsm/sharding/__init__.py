"""What :func:`paramfsm.shard` does to a model, and the bodies of the ``rt.*`` methods.

:mod:`.assembly` checks ``shard()``'s arguments and builds the runtime; :mod:`.teardown` undoes it
(``rt.close()``, detaching). Around the engine sit what a sharded model needs from outside it:
:mod:`.meta` (a model built on the meta device and its values guard), :mod:`.rank_agreement` and
:mod:`.rank_errors` (what every rank must agree on, and one rank's error raised on all),
:mod:`.model_changes` (modules attached after ``shard()``), :mod:`.conversions` (``model.to(...)``
refused) and the offload policy (:mod:`.offload`, :mod:`.offload_command`). The ``rt.*`` methods'
bodies: :mod:`.full_state` (full tensors and state dicts), :mod:`.gathered`, :mod:`.accumulation`,
:mod:`.materialize` (``rt.init_weights``) and :mod:`.memory`.

Nothing here imports :mod:`paramfsm.checkpoint`, :mod:`paramfsm.integrations`, :mod:`paramfsm.verify` or
:mod:`paramfsm.testing`: those are built on what is here (``tests/test_layers.py``).
"""
