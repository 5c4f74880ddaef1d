"""Module and autograd hooks. They only emit events; the scheduler decides everything.

Per unit module:
- forward pre-hook: ``PRE_FORWARD``; when grad is enabled it also arranges
  for ``POST_BACKWARD`` once the gradients of the unit's inputs are complete
  (see ``_route_inputs``);
- forward hook: ``POST_FORWARD``; when the outputs are part of an autograd
  graph it registers a pre-hook on their nodes that emits ``PRE_BACKWARD``
  (in every graph task that reaches them: retained-graph backward passes and
  checkpoint recomputation included) and ties a :class:`ForwardCall` to the
  graph, whose collection emits ``GRAPH_FREED``. Outputs of any structure are
  walked by :mod:`paramfsm.engine.events.outputs` (a plain tensor stays on a fast
  path); an output view's base is hooked too (see [Note: an output view is
  hooked at its base too]).

Per parameter that requires grad (:func:`watch_grads`; the scheduler adds
and removes them when ``requires_grad`` changes): a post-accumulate-grad hook emits
``GRAD_READY`` once autograd has accumulated the parameter's gradient for the
graph task (after all of its uses, tied weights included). A tensor hook
routes the gradient when it is recorded (``create_graph=True``) so that a
later backward through it fetches the unit first (see
:mod:`paramfsm.engine.events.higher_order`); the post-backward hooks do the same for the
gradients of the unit's inputs. That tensor hook is registered the first time
a backward that records its graph reaches the unit (see [Note: higher-order
hooks come when they are needed]).

On the root module: ``FORWARD_BEGIN`` / ``FORWARD_END`` around the forward, or
``FORWARD_FAILED`` when the forward raised (the flight recorder dumps then).

[Note: why post-backward rides on the inputs]
The gradient of a unit's inputs is complete only after every backward node
of the unit that leads to them ran, so the unit's own hold can be released
there. Parameters that still wait for their ``AccumulateGrad`` keep a
gradient hold (see the scheduler), so this release never frees a parameter
autograd still needs. A unit none of whose inputs require grad (the first
layer) is released by the scheduler at the end of the graph task.

[Note: a unit is released before the unit below it is fetched]
In a chain of units, unit k's output is unit k+1's input, so the node that
produced it carries both unit k's ``PRE_BACKWARD`` and, when its gradient is
complete, unit k+1's ``POST_BACKWARD``. The latter is a hook on the tensor,
not on the node: autograd runs a node's tensor hooks before its node
pre-hooks, so unit k+1 is released before unit k is fetched, and the two
units' full parameters are never live at once for that moment (as with
FSDP2's post-backward node). The gradient of the tensor is complete either
way, so the order is the only difference.

[Note: a chain of units shares one hook]
When unit k+1's one input is unit k's output itself (a ``Sequential``, a
stack of blocks), the node that produced it already carries unit k's
pre-backward hook. Unit k+1's post-backward then rides on that hook
(``ForwardCall.after``) instead of a tensor hook of its own: the hook emits
unit k+1's ``POST_BACKWARD`` first, then unit k's ``PRE_BACKWARD``, the same
order as above, at the same moment (a node runs once every gradient of its
outputs is complete, which is when the tensor hook would fire). This saves a
``Tensor.register_hook`` per unit per forward, the most expensive hook to
register. The chain (:class:`_Chain`) remembers only the last unit's output
node, from its post-forward to the next pre-forward or the end of the root
forward, so it keeps no graph alive. It links units only inside a root
forward: a unit called on its own (a GAN's ``model.disc(fake)``) has no end
that would forget its node, which would then keep its graph, and with it the
unit's forward hold or deferred copy, alive for as long as no other unit ran.

[Note: an output view is hooked at its base too]
A unit that returns a view (``h.view(...)``, ``h.transpose(...)``,
``h.squeeze(0)``) hands back a tensor whose node the caller's in-place op
replaces: ``h = unit(x); h += y`` puts ``CopySlices`` over the base's node
and replays the view on top, so the view's original node, which carries
the unit's hook, never runs and the unit's backward would find its
parameters released. The node of the view's base does run, after
``CopySlices`` and before every node of the unit that the view depends on,
so it carries a hook as well (:func:`_on_base_grad`; which bases, in
[Note: the base of an output view] in :mod:`paramfsm.engine.events.outputs`).
Without an in-place op both nodes run, the view's first, so the unit's
``PRE_BACKWARD`` comes twice in one graph task; the scheduler takes one per
``ForwardCall`` and task (``TaskState.seen``), as it already does for a unit
whose several outputs have several nodes, and the higher-order hooks are
registered once. The base's hook emits only ``PRE_BACKWARD``, never the
post-backward of the units chained on the view's node (``ForwardCall.after``,
[Note: a chain of units shares one hook]), which must come once: a chained
unit consumed the view's original node, and its own backward runs that node
whatever the caller did to the view afterwards; a unit that consumes the view
after the in-place op finds a new node, not the chain's, and hooks its input
tensor instead.

[Note: higher-order hooks come when they are needed]
A parameter's gradient needs routing only in a backward that records its
graph (``create_graph=True``: grad mode is on inside it). The unit's
pre-backward hook runs before any node of the unit, and so before its
parameters' ``AccumulateGrad``; when it finds grad mode on it registers the
parameters' routing hooks, which autograd then honours in that same backward
(a leaf's tensor hooks are read when its ``AccumulateGrad`` runs). Plain
first-order training never pays for them.
"""

from __future__ import annotations

import sys
from functools import partial

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from paramfsm.engine.events import graph_task as gt
from paramfsm.engine.events import higher_order, members, outputs, reached
from paramfsm.engine.events.compile_guard import eager
from paramfsm.engine.events.events import (
    FORWARD_BEGIN, FORWARD_END, FORWARD_FAILED, GRAD_READY, POST_BACKWARD, POST_FORWARD, PRE_BACKWARD,
    PRE_FORWARD, Event, ForwardCall,
)
from paramfsm.errors import UnsupportedOutput


class _PostBackward(torch.autograd.Function):
    """Identity on the unit's inputs; its backward marks the end of the unit's backward."""

    @staticmethod
    def forward(ctx, emit, unit, *tensors):
        ctx.emit, ctx.unit = emit, unit
        return tensors

    @staticmethod
    def backward(ctx, *grads):
        ctx.emit(Event(POST_BACKWARD, ctx.unit, gt.backward_task(), gt.keeps_graph()))
        if torch.is_grad_enabled():
            grads = higher_order.enter(ctx.emit, (ctx.unit,), grads) or grads
        return (None, None, *grads)


class _Chain:
    """The last unit output seen in forward (see [Note: a chain of units shares one hook])."""

    __slots__ = ("node", "call", "open", "task", "nested", "reached", "handles", "running")

    def __init__(self):
        self.node = self.call = None
        self.open = False  # a root forward is running: only then are units chained
        self.task = gt.NO_TASK  # the graph task it runs in
        self.nested = 0  # calls of the root inside it: [Note: the root called inside its own forward]
        # Parent units whose parameters' AccumulateGrad is not hooked yet, and where the handles go:
        # see [Note: a backward that enters a unit from inside] in paramfsm.engine.events.reached.
        self.reached: dict = {}
        self.handles: list = []
        self.running = members.Running()  # calls of units with members in progress (paramfsm.engine.events.members)


def _on_output_grad(call: ForwardCall, grad_outputs):
    emit, task, keep = call.emit, gt.backward_task(), gt.keeps_graph()
    recording = torch.is_grad_enabled()  # create_graph: see paramfsm.engine.events.higher_order
    routed = None
    after = call.after
    if after is not None:  # units whose one input this node produced: [Note: a chain of units shares one hook]
        for unit in after:
            emit(Event(POST_BACKWARD, unit, task, keep))
        if recording:
            routed = higher_order.enter(emit, tuple(after), grad_outputs)
    if recording:
        _watch_higher_order(emit, call.unit)
    emit(Event(PRE_BACKWARD, call.unit, task, keep, call=call))
    return routed


def _on_base_grad(call: ForwardCall, grad_outputs):
    """The hook on the base of an output view: the unit's ``PRE_BACKWARD`` alone (see [Note: an output view is
    hooked at its base too])."""
    emit = call.emit
    if torch.is_grad_enabled():
        _watch_higher_order(emit, call.unit)
    emit(Event(PRE_BACKWARD, call.unit, gt.backward_task(), gt.keeps_graph(), call=call))


def _watch_higher_order(emit, unit) -> None:
    """Register the routing hooks of a unit's parameters (see [Note: higher-order hooks come when they are
    needed]); parameters that have them already are skipped."""
    for rec in unit.records:
        hooks = rec.grad_hooks
        if len(hooks) == 1:
            hooks.append(rec.param.register_hook(partial(higher_order.on_param_grad, emit, rec.units)))


def _on_input_grad(emit, unit, grad):
    emit(Event(POST_BACKWARD, unit, gt.backward_task(), gt.keeps_graph()))
    if torch.is_grad_enabled():
        routed = higher_order.enter(emit, (unit,), (grad,))
        return routed[0] if routed else None
    return None


def _route_inputs(emit, unit, tensors: list, link: tuple | None = None, in_root: bool = True):
    """Arrange one POST_BACKWARD per call; return replacement tensors (or None to keep the inputs).

    One non-leaf input inside the root forward: the pre-backward hook of the
    unit that produced it (see [Note: a chain of units shares one hook]),
    else a hook on that tensor; either fires once its gradient is complete,
    i.e. after this unit's backward (cheap, no extra node); see [Note: a unit
    is released before the unit below it is fetched]. Several inputs, leaf
    inputs, or a call outside the root forward: route them through
    :class:`_PostBackward`, whose single node fires after all of them.

    [Note: a call on its own ends only its own backward]
    A hook on the input tensor belongs to the tensor, not to the call: it
    fires whenever a backward completes that tensor's gradient. A unit (or a
    merged member) called on its own outside the root forward, on an
    activation that the root forward's graph also uses (a head run again on
    saved hidden states, a sub-module probed and its output dropped), would
    then end the unit's backward while the root forward's backward still runs
    through it: its hold was released early and a frozen parameter, which no
    gradient holds, was read empty ("weight of shape [0]"). The node of
    :class:`_PostBackward` is part of the call's own graph and dies with it.
    """
    if len(tensors) == 1 and in_root:
        node = tensors[0].grad_fn
        if node is not None:
            if link is not None and node is link[0]:
                call = link[1]
                if call.after is None:
                    call.after = [unit]
                else:
                    call.after.append(unit)
                return None
            tensors[0].register_hook(partial(_on_input_grad, emit, unit))
            return None
    return _PostBackward.apply(emit, unit, *tensors)


def _pre_forward(emit, unit, chain, module, args, kwargs):
    task = gt.current_task()
    emit(Event(PRE_FORWARD, unit, task))
    link = None
    if chain.node is not None:  # taken by this call or by nobody: [Note: a chain of units shares one hook]
        if task == gt.NO_TASK:
            link = chain.node, chain.call
        chain.node = chain.call = None
    if not torch.is_grad_enabled():
        return None
    if not kwargs and all(isinstance(a, torch.Tensor) for a in args):
        # Fast path for the common positional-tensors call: no pytree round trip.
        positions = [i for i, a in enumerate(args) if a.requires_grad]
        if not positions:
            return None
        routed = _route_inputs(emit, unit, [args[i] for i in positions], link, chain.open)
        if routed is None:
            return None
        new_args = list(args)
        for i, tensor in zip(positions, routed):
            new_args[i] = tensor
        return tuple(new_args), kwargs
    flat, spec = tree_flatten((args, kwargs))
    positions = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not positions:
        return None
    routed = _route_inputs(emit, unit, [flat[i] for i in positions], None, chain.open)
    if routed is None:
        return None
    for i, tensor in zip(positions, routed):
        flat[i] = tensor
    return tree_unflatten(flat, spec)


def _post_forward(emit, unit, chain, module, args, output):
    """``POST_FORWARD``, after hooking the output's nodes; an output the hooks cannot look into is refused
    once the unit is released (``UnsupportedOutput``)."""
    if chain.reached and unit in chain.reached and torch.is_grad_enabled():
        reached.watch(emit, unit, chain)
    call = refused = None
    task = gt.current_task()
    if torch.is_grad_enabled():
        if isinstance(output, torch.Tensor):  # the common case: no walk
            node = output.grad_fn
            nodes = [node] if node is not None else []
            bases = outputs.view_bases((output,), nodes, args) if nodes and output._is_view() else ()
        else:
            try:
                nodes, bases = outputs.graph_nodes(unit, output, args)
            except UnsupportedOutput as exc:
                nodes, bases, refused = (), (), exc
        if nodes:
            call = ForwardCall(unit, emit)
            hook = partial(_on_output_grad, call)
            for node in nodes:
                node.register_prehook(hook)
            if bases:
                hook = partial(_on_base_grad, call)
                for node in bases:
                    node.register_prehook(hook)
            if chain.node is nodes[0]:  # a unit nested in this one produced it: its hook runs first
                chain.node = chain.call = None
            elif chain.open and task == gt.NO_TASK and len(nodes) == 1 and isinstance(output, torch.Tensor):
                chain.node, chain.call = nodes[0], call
    emit(Event(POST_FORWARD, unit, task, call=call))
    if refused is not None:
        raise refused
    return None


def _on_grad_accumulated(emit, record, param):
    emit(Event(GRAD_READY, None, gt.backward_task(), gt.keeps_graph(), record))


def _root_forward_begin(emit, chain, module, args) -> None:
    """``FORWARD_BEGIN``, unless the root is called inside its own forward.

    [Note: the root called inside its own forward]
    A forward that calls its own module again (Lightning runs ``training_step``
    as the root's forward, and the step calls ``self(x)``; a recursive model)
    is still the one root forward: a second ``FORWARD_BEGIN`` would read as a
    forward that never ended and reset every gathered parameter. The nested
    call emits neither ``FORWARD_BEGIN`` nor its end; the root *unit*'s own
    pre- and post-forward hooks still run for it, like any unit called twice.
    """
    task = gt.current_task()
    if chain.open and chain.task == task:
        chain.nested += 1
        return
    chain.open, chain.task, chain.nested = True, task, 0
    chain.running.reset()
    emit(Event(FORWARD_BEGIN, None, task))


def _root_forward_end(emit, chain, module, args, output) -> None:
    """``FORWARD_END``, or ``FORWARD_FAILED`` when the forward raised.

    Registered with ``always_call=True``: torch calls it from the ``except``
    block of a forward that raised (with no output), so the exception being
    handled is how the failure is told apart.
    """
    if chain.nested:  # [Note: the root called inside its own forward]
        chain.nested -= 1
        return
    chain.node = chain.call = None
    chain.open = False
    failed = output is None and sys.exc_info()[1] is not None
    emit(Event(FORWARD_FAILED if failed else FORWARD_END, None, gt.current_task()))


def install(root: torch.nn.Module, units, records, emit) -> list:
    """Register every hook; returns the handles so ``rt.close()`` can remove them."""
    chain = _Chain()
    found = members.members(root, units)  # [Note: a merged module called on its own is its unit's call]
    with_members = {unit for _, unit in found}
    handles = [  # every hook opaque to torch.compile: [Note: hooks are opaque to Dynamo]
        root.register_forward_pre_hook(eager(partial(_root_forward_begin, emit, chain))),
    ]
    hooks_of = {}
    for unit in units:
        pre, post = partial(_pre_forward, emit, unit, chain), partial(_post_forward, emit, unit, chain)
        if unit in with_members:
            pre, post = hooks_of[unit] = members.counted(chain.running, unit, pre, post)
        handles.append(unit.module.register_forward_pre_hook(eager(pre), with_kwargs=True))
        handles.append(unit.module.register_forward_hook(eager(post)))
    handles += members.install(found, chain.running, hooks_of)
    handles.append(root.register_forward_hook(eager(partial(_root_forward_end, emit, chain)), always_call=True))
    for rec in records:
        if rec.requires_grad:
            watch_grads(rec, emit)
    chain.reached, chain.handles = reached.parents(units), handles
    return handles


def watch_grads(rec, emit) -> None:
    """Register the gradient hooks of a parameter that requires grad (at shard, or when unfrozen).

    The handles live on the record, so freezing it again removes them (:func:`unwatch_grads`).
    The higher-order routing hook joins them later, when needed (:func:`_watch_higher_order`).
    """
    if not rec.grad_hooks:
        rec.grad_hooks = [rec.param.register_post_accumulate_grad_hook(partial(_on_grad_accumulated, emit, rec))]


def unwatch_grads(rec) -> None:
    for handle in rec.grad_hooks:
        handle.remove()
    rec.grad_hooks = []
