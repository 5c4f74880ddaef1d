"""What drives parameter lifetimes inside torch, in four rooms whose imports point one way.

* :mod:`~paramfsm.engine.events`: hooks that emit events;
* :mod:`~paramfsm.engine.schedule`: the scheduler that steps the FSM, and its components;
* :mod:`~paramfsm.engine.effects`: collectives, kernels, streams;
* :mod:`~paramfsm.engine.storage`: units, shards, placeholders.

The schedule uses the other three; effects use storage; storage uses the
core alone. The engine imports from :mod:`paramfsm.core` and
:mod:`paramfsm.errors`, never from :mod:`paramfsm.testing` or the facade
modules (``tests/test_layers.py``, run by ``make lint``, enforces all of it).

[Note: the road of a gradient]
From the hook autograd calls to the value an optimizer steps, file by file (each name is a definition
to go to):

1. ``events/hooks.py``: ``_on_grad_accumulated``, a post-accumulate-grad hook on the parameter, emits
   ``Event(GRAD_READY, record=...)`` to ``Scheduler.emit``. It decides nothing.
2. ``schedule/scheduler.py``: ``Scheduler.emit`` queues it, and its dispatch table hands it to
   ``GraphTasks.on_grad_ready`` (``schedule/backward.py``). That queues the parameter, and
   ``GraphTasks.drain_ready`` steps every queued one together: ``grad_ready`` (or ``grad_kept``
   under ``rt.no_sync()``, as ``GradRouting.grad_event`` says).
3. ``Scheduler._step_all`` calls ``step_many`` (``core/fsm.py``), which takes the spec's transition and
   returns its effects. For ``grad_ready`` that is ``reduce_grad`` (``specs/param_lifetime.toml``).
4. ``schedule/scheduler.py``: ``Scheduler._effect_runners`` maps ``reduce_grad`` to
   ``GradRouting.take_grads`` (``schedule/grad_order.py``), a schedule effect. It sends each unit's
   gradients in the unit's order, zeros for a parameter a rank did not reach.
5. ``effects/executor.py``: ``Executor.take_grad`` and ``Executor.take_ordered``, then ``_take``
   (which folds in what ``rt.no_sync()`` kept, ``effects/grad_sync.py``) and ``queue_grad``, fill a
   bucket. ``flush_grads`` and ``_reduce`` issue it (``_issue_reduce``: pack, then
   ``collectives.reduce_scatter_flat``, which uses a point-to-point exchange on gloo,
   ``effects/gloo/exchange.py``) on the reduce lane (``effects/streams.py``).
6. Back: ``GradRouting.sync_kept`` calls ``Executor.finish_reduces`` at the end of the backward,
   and ``_reduce`` completes the oldest reduce-scatter when too many are in flight. Both go through
   ``_complete``, which splits each output into the parameters' shards. ``_accumulate_all`` then
   adds each into ``shard.grad`` (``accumulate``, ``effects/shard_grads.py``).
7. Under gradient offload the executor hands those shards back instead
   (``Executor.hand_back_reduced``). ``GradRouting`` and the ``sync_grad`` effect call
   ``Scheduler.hand_back`` after every executor call that can complete one, and
   ``GradPaging.accumulate`` (``schedule/grad_paging.py``) adds them while stepping each shard
   gradient's residency (needed, then written and released). So no effect ever steps a machine.
"""
