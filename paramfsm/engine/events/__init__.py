"""Events: what torch's module and autograd hooks saw, and nothing else.

The hooks here register on modules, tensors and autograd nodes and only emit
:class:`~paramfsm.engine.events.events.Event` objects to the scheduler; they
decide nothing. This room imports the core and its own modules only: never
the scheduler, the effects or the storage (``tests/test_layers.py``).
"""
