"""The pure lifetime model: the spec, the compiled FSM, the reference Machine and traces.

Nothing here imports ``torch.distributed``, ``cupy`` or any other layer of
paramfsm (``make lint`` enforces it), so the whole model can be loaded,
checked and property-tested in milliseconds, without a process group.
"""
