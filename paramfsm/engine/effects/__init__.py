"""Effects: collectives, packing kernels, streams and the gradients they move.

An effect runs what a transition asked for and returns a handle; it never
reads FSM state to decide anything and never drives the schedule. This room
uses the storage and the core, never the schedule or the events.
"""
