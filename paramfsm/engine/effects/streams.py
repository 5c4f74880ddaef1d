"""Where the executor's side work runs, and the events that order it against compute.

The executor has two kinds of side work: gathering (pack the shards, all-gather,
unpack) and reducing (pack the gradients, reduce-scatter). It hands each piece
to :meth:`launch` as a function on a *lane* (``GATHER`` or ``REDUCE``) and gets a
:class:`Ticket` back; :meth:`join` makes compute wait for that piece and returns
its result. Three implementations share that interface:

* :class:`DeviceStreams` (CUDA): each lane is a dedicated ``torch.cuda.Stream``,
  so communication and packing overlap compute; ordering is by events.
* :class:`HostStreams` (CPU): the work runs at once on the calling thread;
  ``launch`` and ``join`` cost a call each. gloo's own thread gives the overlap.
* :class:`RecordingStreams` (tests): work is deferred until it is joined, like a
  lagging device stream, and every call is logged, so the CPU suite checks the
  executor's ordering: a missing ``join`` leaves a result unproduced, and a
  tensor dropped before its ticket is joined shows up as dead.

[Note: side work waits for compute]
``launch`` first makes the lane wait for everything compute has enqueued so
far. That orders the side work after (a) the producers of its inputs (the
optimizer writing shards; autograd writing gradients), and (b) every earlier
compute use of memory that the caching allocator may hand to this lane. The
allocator reuses a freed block at once for the next allocation on the stream
that allocated it, ordered only on that stream: a full parameter unpacked on
the gather lane and freed after its unit's compute would otherwise be reused by
the next gather while compute still reads it. With this wait, no
``record_stream`` is needed and reuse is deterministic.

[Note: compute waits at join, and arguments outlive the side work]
``join`` makes compute wait for the ticket's event before anything reads the
result. Whatever the side work reads that compute made (the gradients a
reduce-scatter packs) is passed to ``launch`` as an argument, and the ticket
keeps its arguments alive until ``join``: compute cannot reuse their memory
while the lane still reads it. The executor bounds the tickets in flight
(prefetch depth for gathers, ``MAX_REDUCES_IN_FLIGHT`` for reduces), so the
memory they keep is bounded too.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

GATHER = "gather"
REDUCE = "reduce"
PAGE = "page"  # copies between working memory and the host tier (Offload(copy_stream=True); paramfsm.engine.effects.paging)
LANES = (GATHER, REDUCE, PAGE)


class Ticket:
    """One piece of side work: its event (or None), its result, and the arguments it keeps alive."""

    __slots__ = ("lane", "event", "result", "fn", "args", "joined")

    def __init__(self, lane: str, event, result, fn=None, args: tuple = ()):
        self.lane, self.event, self.result, self.fn, self.args = lane, event, result, fn, args
        self.joined = False


class HostStreams:
    """CPU: no streams. Side work runs when launched; ``asynchronous`` is False, so the
    executor waits on gloo's work handles itself, where the result is needed."""

    asynchronous = False

    def launch(self, lane: str, fn: Callable[..., Any], *args) -> Ticket:
        return Ticket(lane, None, fn(*args))

    def join(self, ticket: Ticket) -> Any:
        ticket.joined = True
        return ticket.result


class DeviceStreams:
    """CUDA: one stream per lane for ``device``; see the module notes for the ordering."""

    asynchronous = True

    def __init__(self, device: torch.device, lanes=(GATHER, REDUCE)):
        self.device = torch.device(device)
        self.lanes = {lane: torch.cuda.Stream(self.device) for lane in lanes}

    def launch(self, lane: str, fn: Callable[..., Any], *args) -> Ticket:
        stream = self.lanes[lane]
        stream.wait_stream(torch.cuda.current_stream(self.device))  # [Note: side work waits for compute]
        with torch.cuda.stream(stream):
            result = fn(*args)
            event = stream.record_event()
        return Ticket(lane, event, result, args=args)

    def join(self, ticket: Ticket) -> Any:
        if not ticket.joined:
            torch.cuda.current_stream(self.device).wait_event(ticket.event)
            ticket.joined, ticket.args, ticket.event = True, (), None
        return ticket.result

    def finish(self, ticket: Ticket) -> Any:
        """:meth:`join`, and the host waits for the work too: its result is read on the host next."""
        if not ticket.joined:
            ticket.event.synchronize()
        return self.join(ticket)


class RecordingStreams:
    """A stand-in device for the CPU suite: deferred side work and a log of every call.

    ``launch`` queues the work on its lane and returns at once; the work runs,
    in lane order, only when a ticket at or after it is joined, like a device
    stream that lags the host. So a result read without a ``join`` is simply not
    there yet. ``log`` holds ``(call, lane, ticket number)`` tuples for
    ``launch``, ``run`` and ``join`` (and ``note`` marks of compute);
    ``max_in_flight`` is the most tickets a lane had queued at once.
    """

    asynchronous = True

    def __init__(self):
        self.log: list[tuple[str, str, int]] = []
        self.queues: dict[str, list[Ticket]] = {lane: [] for lane in LANES}
        self.count = 0
        self.max_in_flight = dict.fromkeys(LANES, 0)

    def launch(self, lane: str, fn: Callable[..., Any], *args) -> Ticket:
        ticket = Ticket(lane, self.count, None, fn, args)
        self.count += 1
        queue = self.queues[lane]
        queue.append(ticket)
        self.max_in_flight[lane] = max(self.max_in_flight[lane], len(queue))
        self.log.append(("launch", lane, ticket.event))
        return ticket

    def note(self, label: str) -> None:
        """Log a point of compute (a test's module hook), to see side work run ahead of it."""
        self.log.append(("note", label, -1))

    def join(self, ticket: Ticket) -> Any:
        if not ticket.joined:
            queue = self.queues[ticket.lane]
            while queue and queue[0].event <= ticket.event:
                queued = queue.pop(0)
                self.log.append(("run", queued.lane, queued.event))
                queued.result = queued.fn(*queued.args)
                queued.fn, queued.args = None, ()
            ticket.joined = True
            self.log.append(("join", ticket.lane, ticket.event))
        return ticket.result

    def finish(self, ticket: Ticket) -> Any:
        """:meth:`join`; the host has nothing more to wait for here."""
        return self.join(ticket)


def streams_for(device: torch.device):
    """The stream set for parameters on ``device``: streams on CUDA, none elsewhere."""
    device = torch.device(device)
    return DeviceStreams(device) if device.type == "cuda" else HostStreams()
