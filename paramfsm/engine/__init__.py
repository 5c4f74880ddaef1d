"""What drives parameter lifetimes inside torch.

Hooks emit events; the scheduler applies them to each parameter's FSM
(:mod:`paramfsm.core.fsm`) and hands the effects to the executor, which runs
the collectives and the packing kernels. The engine imports from
:mod:`paramfsm.core` and :mod:`paramfsm.errors`, never from
:mod:`paramfsm.testing` or the facade modules (``make lint`` enforces it).
"""
