"""The CPU transport: all-gathers and reduce-scatters as point-to-point exchanges on gloo.

:mod:`.exchange` moves shards peer to peer on a thread of its own (about half the time of gloo's own
collectives), and :mod:`.agreement` makes every batch of exchanges agree its sizes across the ranks before
anything moves, since gloo aborts the process on a message of the wrong size. The NCCL path never enters
this room; :mod:`paramfsm.engine.effects.collectives` chooses it for CPU tensors on gloo.
"""
