"""What drives parameter lifetimes inside torch, in four rooms whose imports point one way.

* :mod:`~paramfsm.engine.events`: hooks that emit events;
* :mod:`~paramfsm.engine.schedule`: the scheduler that steps the FSM, and its components;
* :mod:`~paramfsm.engine.effects`: collectives, kernels, streams;
* :mod:`~paramfsm.engine.storage`: units, shards, placeholders.

The schedule uses the other three; effects use storage; storage uses the
core alone. The engine imports from :mod:`paramfsm.core` and
:mod:`paramfsm.errors`, never from :mod:`paramfsm.testing` or the facade
modules (``tests/test_layers.py``, run by ``make lint``, enforces all of it).
"""
