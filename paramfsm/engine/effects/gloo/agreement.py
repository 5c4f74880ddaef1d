"""The size agreement of the gloo transport: no batch of exchanges moves before the ranks agreed on it.

[Note: an exchange agrees its sizes first]
gloo pairs a receive with whatever the peer sends on its tag, and a longer
message aborts the process. So on a group that agrees sizes
(:func:`paramfsm.engine.effects.gloo.exchange.agree_sizes`: every group unless turned
off) a batch of exchanges (one submission, or one ``coalesced`` block) can
go after a fixed-size int64 :data:`HEADER`: what it moves (kind, exchanges,
a digest of every message's direction and bytes, bytes per peer, the run it
announces) and, when the caller names the batch, what it is (the tag). The
thread sends it to every peer and receives theirs, so every rank holds the
same rows and reaches the same verdict; it posts the batch only if they
agree, else nothing moves and the handles raise :class:`Refused` (RankDesync
in the executor's waits). A row that names nothing (a full-tensor gather) is
compared on its sizes; its payload's tag checks the rest. The caller never
waits for a header, but each costs two small messages per peer, and gloo
charges a message far more than its bytes (about 0.2 ms of CPU per header on
a loaded 2-core machine): a header on every batch cost 6-11% of a step of 8
GPT blocks at world 2. Hence runs.

[Note: a repeating sequence needs no header]
Training repeats one step's collectives, so each group keeps the sequence of
its batches (:class:`Agreement`, the same on every rank while they agree).
When a batch's descriptor (kind, unit, elements, the sizes of its messages)
ends a cycle that repeated the one before it, its header announces a *run*:
the cycle's batches again, digested into the header. Once the ranks agreed
on it, each batch of the run moves with no header, shaped as announced: a
rank whose batch is the announced one posts it (it *follows*); a rank whose
batch is another (it *deviates*) sends a stand-in of the announced shape
instead, its messages ending with :data:`MAGIC` and its real header, and
receives the peer's into scratch. Sizes therefore always match. At the wait,
a follower reads the end of one message from each peer: a marker means that
peer deviated (RankDesync on both). A deviator reads its scratch: a peer
that followed, or deviated to another batch, is a desync; peers that all
deviated to the same batch ran the same program, and each rank moves the
real batch again on its own tags (a program that leaves its cycle pays that
until the run ends). A run ends before a batch whose messages are too short
for a marker, and its batches are posted only after its header agreed. A
repeating step of 8 GPT blocks at world 2 sends one header and costs about
2% over the tag alone (``benchmarks/rank_check_cost.py``).

[Note: after a refusal the ranks restart in step]
The refused batch has the same first tag on every rank. The thread refuses,
silently, every later batch of the group's epoch that needs a header, and
each epoch has its own wire tags, so what one rank posted in the old epoch
(a run's batches) never meets another epoch's. The first wait that raises
:class:`Refused` on a rank starts a new epoch: tags restart after the refused
tag and the history is empty, alike on every rank, so what runs next
(``rt.reset()``, the next step, a new runtime) pairs again; a wait on an old
epoch's batch raises :class:`Dropped` at once, which recovery drops.
"""

from __future__ import annotations

import ctypes
import weakref
from collections import deque
from concurrent.futures import Future

import torch
import torch.distributed as dist

from paramfsm.engine.effects.rankcheck import GATHER, REDUCE
from paramfsm.errors import ParamFSMError

#: A batch's header, one int64 each: whether the caller named it, the sizes and the run it announces
#: (always compared), and the caller's fields (compared when every rank named its batch).
HEADER = ("named", "kind", "exchanges", "digest", "bytes", "run", "prediction", "number", "step", "unit", "elements")
_SIZES, _NAMED = slice(1, 7), slice(7, 11)
GATHER, REDUCE = 1, 2  # header kinds
#: A stand-in message ends with MAGIC and the deviating rank's header: MARK bytes.
MAGIC = 0x7061_7261_6D66_736D
MARK = 8 * (1 + len(HEADER))
_HISTORY = 1 << 13  # batches a group remembers before it starts its history afresh


class Refused(RuntimeError):
    """The ranks' headers of a batch differ, so nothing of it moved; ``rows``: every rank's header."""

    def __init__(self, rows: torch.Tensor, epoch: int, restart: int):
        self.rows, self.epoch, self.restart = rows, epoch, restart
        super().__init__(f"paramfsm: the ranks' exchanges differ (headers {HEADER}: {rows.tolist()})")


class Dropped(ParamFSMError):
    """An exchange after a refused one: it never moved; this rank raised the desync before."""

    def __init__(self):
        super().__init__("paramfsm: this collective never ran: the ranks desynced at an earlier one, whose "
                         "RankDesync this rank raised first. What to do: fix that desync; rt.reset() (or the "
                         "next forward) drops what was left in flight.")


class Entry:
    """One batch as a group remembers it: ``key`` (what must repeat), ``shape`` (per exchange, its
    messages as (is a send, bytes, peer's offset from this rank)), ``header``, and ``marks`` once it is
    announced."""

    __slots__ = ("key", "shape", "header", "marks")

    def __init__(self, key: tuple, shape: tuple, header: list):
        self.key, self.shape, self.header, self.marks = key, shape, header, None


def marks(shape) -> dict:
    """The message each peer's marker is read from: peer offset -> (exchange, message) of its first
    receive of at least :data:`MARK` bytes (the same on every rank for one shape)."""
    found: dict = {}
    for j, messages in enumerate(shape):
        for m, (send, nbytes, peer) in enumerate(messages):
            if not send and nbytes >= MARK and peer not in found:
                found[peer] = (j, m)
    return found


def agree(rows: list, rank: int) -> bool:
    """Whether every rank's header (``rows``) agrees with this rank's."""
    own = rows[rank]
    return all(row[_SIZES] == own[_SIZES] for row in rows) and (
        not all(row[0] for row in rows) or all(row[_NAMED] == own[_NAMED] for row in rows))


def read_marker(received: torch.Tensor) -> list | None:
    """The header a stand-in marked ``received`` (a contiguous CPU tensor) with, or None when it holds no
    marker. Its last bytes are read in place: no tensor op, no copy of the rest."""
    tail = ctypes.string_at(received.data_ptr() + received.numel() * received.element_size() - MARK, MARK)
    if int.from_bytes(tail[:8], "little") != MAGIC:
        return None
    return [int.from_bytes(tail[i:i + 8], "little", signed=True) for i in range(8, MARK, 8)]


class Job:
    """One exchange: ops ((isend | irecv, tensor, global peer, group, tag), ...), its handle's future and
    who takes part, (group, rank, kind, peers as (rank, global rank), shape), or None."""

    __slots__ = ("ops", "posted", "group", "rank", "kind", "peers", "shape", "batch", "checks")

    def __init__(self, ops, who):
        self.ops, self.posted, self.batch, self.checks = ops, Future(), None, ()
        self.group, self.rank, self.kind, self.peers, self.shape = (
            who if who is not None else (None, 0, 0, None, None))


def post_header(batch, tag: int) -> None:
    """On the posting thread: send ``batch``'s header to every peer, post the receives of theirs."""
    batch.rows = torch.empty(len(batch.peers) + 1, len(HEADER), dtype=torch.int64)
    batch.rows[batch.rank] = header = torch.tensor(batch.header, dtype=torch.int64)
    try:
        batch.works = [work for peer, address in batch.peers.items()
                       for work in (dist.isend(header, address, batch.group, tag),
                                    dist.irecv(batch.rows[peer], address, batch.group, tag))]
    except BaseException as exc:  # noqa: BLE001 - handed to the waiting callers by the batch's agree()
        batch.works = exc


def rows_of(seen: dict, own: list, otherwise: list, rank: int, world: int) -> torch.Tensor:
    """Every rank's header: ``own``, a peer's from its marker (``seen``: by peer offset), else ``otherwise``."""
    rows = [seen.get((r - rank) % world) or otherwise for r in range(world)]
    rows[rank] = own
    return torch.tensor(rows, dtype=torch.int64)


def post_stand_in(batch, tag_of) -> None:
    """Post a stand-in for ``batch`` (an exchange batch that deviates from its run): the announced
    shape, zeros whose sends of at least :data:`MARK` bytes end with :data:`MAGIC` and the batch's
    header, received into scratch; exchange ``j`` on tag ``tag_of(j)``."""
    mark = torch.tensor([MAGIC, *batch.header], dtype=torch.int64).view(torch.uint8)
    batch.scratch, batch.works, world = [], [], len(batch.peers) + 1
    for j, messages in enumerate(batch.expected.shape):
        batch.scratch.append([])
        for send, nbytes, peer in messages:
            buf = torch.zeros(nbytes, dtype=torch.uint8)
            if send and nbytes >= MARK:
                buf[-MARK:] = mark
            batch.scratch[-1].append(buf)
            post = dist.isend if send else dist.irecv
            batch.works.append(post(buf, batch.peers[(batch.rank + peer) % world], batch.group, tag_of(j)))


def verify(batch, job, timeout, again) -> None:
    """At the wait of ``job`` of a run's ``batch``: raise Refused if a peer deviated while this rank
    followed, or the ranks deviated differently; when every rank deviated to this same batch, move the
    job's own messages again, on tags ``again(tag)``, and wait for them."""
    world = len(batch.peers) + 1
    if batch.mode == "follow":
        seen = {job.shape[m][2]: read_marker(job.ops[m][1]) for m in job.checks}
        if any(header is not None for header in seen.values()):
            raise batch.refuse(rows_of(seen, batch.header, batch.header, batch.rank, world))
        return
    if batch.verdict is None:
        for work in batch.works:
            work.wait() if timeout is None else work.wait(timeout=timeout)
        seen = {peer: read_marker(batch.scratch[j][m]) for peer, (j, m) in batch.expected.marks.items()}
        followed = batch.expected.header[:7] + batch.header[7:9] + batch.expected.header[9:]
        batch.verdict = all(header == batch.header for header in seen.values()) or batch.refuse(
            rows_of(seen, batch.header, followed, batch.rank, world))
    if isinstance(batch.verdict, Refused):
        raise batch.verdict
    for work in [post(tensor, peer, group, again(tag)) for post, tensor, peer, group, tag in job.ops]:
        work.wait() if timeout is None else work.wait(timeout=timeout)


class Agreement:
    """One group's batches as the ranks agreed them, and the run announced (see [Note: a repeating
    sequence needs no header]); also its epoch ([Note: after a refusal the ranks restart in step]).

    [Note: a group's agreement holds no batch alive]
    Agreements are kept per group, weakly keyed by the group (``exchange.PerGroup``). A batch holds its group
    (and its jobs' ops name it), so an agreement that held the batch announcing its run kept its own key alive:
    no destroyed group was ever freed, and each kept gloo's threads and sockets (three threads a group; a
    ``paramfsm verify`` of a few hundred programs ended with thousands). The agreement and the batches that
    follow the run therefore hold the announcing batch weakly. Until it is settled the exchange thread holds it;
    once it is gone it was settled, which is all its followers ask of it.
    """

    __slots__ = ("on", "epoch", "history", "seen", "run", "anchor")

    def __init__(self):
        self.on, self.epoch = True, 0
        self.forget()

    def observe(self, refused: Refused) -> bool:
        """A wait raised ``refused``: True the first time this rank sees it (a new epoch starts, with no
        history), False for a batch of an epoch refused before."""
        if refused.epoch != self.epoch:
            return False
        self.epoch += 1
        self.forget()
        return True

    def forget(self) -> None:
        self.history: list[Entry] = []
        self.seen: dict = {}  # key -> its last two places in history
        self.run: deque = deque()
        self.anchor = None  # a weak reference to the batch whose header announced the run

    def place(self, batch, kind: int, shape: tuple, fields) -> tuple[str, Entry | None, list]:
        """Where ``batch`` stands: ("header", None, header) or, inside a run, ("follow" | "deviate",
        the announced entry, header)."""
        digest = hash(shape)  # ints only (peers as offsets from this rank): alike on every rank and process
        sent = sum(nbytes for messages in shape for send, nbytes, _ in messages if send)
        named = fields is not None
        key = (kind, len(shape), digest, *(fields[2:] if named else (-1, -1)))
        header = [int(named), kind, len(shape), digest, sent, 0, 0, *(fields if named else (-1,) * 4)]
        if self.run:
            expected = self.run.popleft()
            mode = "follow" if expected.key == key else "deviate"
        else:
            expected, mode = None, "header"
            run = self._predict(key)
            if run:
                header[5:7] = [len(run), hash(tuple(entry.key for entry in run))]
                self.run, self.anchor = deque(run), weakref.ref(batch)
        places = self.seen.setdefault(key, [])
        places[:] = places[-1:] + [len(self.history)]
        self.history.append(Entry(key, shape, header))
        if len(self.history) >= _HISTORY:
            self.history, self.seen = [], {}
        return mode, expected, header

    def _predict(self, key) -> list:
        """The cycle that ends at ``key`` if it repeated the one before, cut before a batch too short to
        carry a marker; else nothing."""
        places = self.seen.get(key, ())
        if len(places) < 2:
            return []
        before, last = places
        cycle = self.history[last + 1:]
        if not cycle or [e.key for e in cycle] != [e.key for e in self.history[before + 1:last]]:
            return []
        for n, entry in enumerate(cycle):
            entry.marks = entry.marks or marks(entry.shape)
            if len(entry.marks) < len({peer for messages in entry.shape for _, _, peer in messages}):
                return cycle[:n]
        return cycle
