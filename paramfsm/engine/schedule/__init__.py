"""The schedule: the one place that turns events into FSM steps, and the concerns that decide them.

The scheduler keeps the event queue, the dispatch and the stepping; each
concern (graph tasks, deferral, forward holds, prefetch plans, gradient
routing, on-demand reads, the leak audit) is a component that owns its state.
It may use the events' vocabulary, the effects, the storage and the core.
"""
