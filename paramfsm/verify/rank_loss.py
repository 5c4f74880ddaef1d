"""How ``paramfsm verify`` judges a ``paramfsm.RankDesync`` once a program's loss reads another output per rank.

A :class:`~paramfsm.verify.ops.RankLoss` builds rank ``r``'s loss from output
``outs[r % len(outs)]``, so each rank's backward reaches the units of its own
output. What the runtime promises for such a loop (README, "RankDesync";
``tests/test_rank_desync_default.py``): it trains exactly like plain torch
(each rank slice's loss from its own output), or EVERY rank raises
``RankDesync`` at the same op, naming a unit and the fix. Gloo aborting the
process, one rank raising while another trains on, another exception, or a
hang are bugs.

So from the first RankLoss of a program on, a ``RankDesync`` raised inside an
op is not a finding by itself. The checker's per-op agreement reports it, and
then :func:`judge` makes the ranks agree whether every one of them raised a
``RankDesync`` whose message names a unit (``unit '<name>'``) and offers a fix
after "What to do:" (:data:`FIXES`). If so, the runtime is reset (the
collectives already issued were issued on every rank), the flight-recorder
dumps the error wrote are removed (an accepted outcome leaves nothing behind in
the working directory), and :class:`Desynced` stops the program: its outcome
kind is ``"desync"``, not failed. Otherwise every rank fails the ``desync``
check, saying what it saw. Values that differ from plain torch's are caught by
the usual checks after the op, and a hang by the group's collective timeout.
"""

from __future__ import annotations

import contextlib
import os
import re

import torch
import torch.distributed as dist

from paramfsm.errors import RankDesync
from paramfsm.verify.ops import RANK_WRITE, WRITE_MODE, Attach, GatheredWrite
from paramfsm.verify.user_loops import ATTACHED

#: What a RankDesync's "What to do:" must offer: a unit that encloses the branch (``units=[Net]``), or step
#: numbers that tell a skipped step from a taken one (``rt.set_step(step)``).
FIXES = ("units=[", "rt.set_step(")
#: How a flight-recorder note on an exception names its dump.
_DUMP = re.compile(r"last transitions are in (\S+\.jsonl)")


class Desynced(Exception):
    """Every rank raised ``RankDesync`` at op ``op``, after a RankLoss, naming a unit and the fix: the
    accepted outcome of a loss that reads another output per rank. Or every rank refused what it had to
    refuse (:func:`refusal`): the accepted outcome of a write inside forward, a write that differs by rank
    inside ``rt.gathered``, a module attached after ``shard()``. The program stops there."""

    def __init__(self, message: str, op: int, refused: str = ""):
        self.message, self.op = message, op
        why = refused or "RankDesync at op {op} (accepted: the ranks' backward passes reached different units)"
        super().__init__(f"every rank raised {why.format(op=op)}: {message}")


#: The refusals verify accepts: (exception class name, the op it answers, what the report says of it).
_REFUSALS = (
    ("WriteToGathered", lambda op: getattr(op, "mode", None) == WRITE_MODE,
     "WriteToGathered at op {op} (accepted: paramfsm refuses a write to a gathered parameter inside forward)"),
    ("ParamFSMError", lambda op: isinstance(op, GatheredWrite) and op.variant == RANK_WRITE,
     "ParamFSMError at op {op} (accepted: paramfsm refuses a write inside rt.gathered that differs by rank)"),
    ("ModelChanged", lambda op: isinstance(op, Attach),
     "ModelChanged at op {op} (accepted: paramfsm refuses a module attached after shard())"),
)


def refusal(exc: BaseException | None, op) -> str:
    """What the report says of ``exc`` when it is the accepted refusal of ``op`` (else ""). Known by class
    name: verify also runs against engines that predate a class."""
    for name, answers, why in _REFUSALS:
        if exc is not None and type(exc).__name__ == name and answers(op):
            return why
    return ""


def accepted(exc: BaseException | None, after_rank_loss: bool, op=None) -> bool:
    """Whether ``exc``, raised inside ``op``, is a ``RankDesync`` that a RankLoss earlier in the program allows,
    or the accepted refusal of ``op`` (:func:`refusal`: every rank raising it, naming the parameter and the
    fix, is judged alike)."""
    if refusal(exc, op):
        return True
    return after_rank_loss and isinstance(exc, RankDesync) and not _refused_write(exc)


def _refused_write(exc) -> bool:
    """A ``WriteToGathered`` (known by name: verify also runs against engines that predate it)."""
    return type(exc).__name__ == "WriteToGathered"


def problems(exc) -> list[str]:
    """What is missing from a ``RankDesync``'s message: the unit it names, the fix it offers (for a
    refusal: the parameter, and for a ``WriteToGathered`` ``rt.gathered(writeback=True)``, after "What to do:")."""
    message = str(exc)
    fix = message.partition("What to do:")[2]
    if _refused_write(exc):
        ok = f"'{exc.param}'" in message and "rt.gathered(" in fix
        return [] if ok else [f"WriteToGathered names no parameter or no fix: {message}"]
    if not isinstance(exc, RankDesync):  # a write that differs by rank, a module attached after shard()
        ok = ("parameter '" in message or f"'{ATTACHED}." in message or f".{ATTACHED}." in message) and bool(fix)
        return [] if ok else [f"{type(exc).__name__} names no parameter or no fix: {message}"]
    found = []
    if not exc.unit or f"unit '{exc.unit}'" not in message:
        found.append(f"RankDesync names no unit (unit={exc.unit!r}): {message}")
    if not any(fix_ in fix for fix_ in FIXES):
        found.append(f"RankDesync offers no fix (none of {', '.join(FIXES)} after 'What to do:'): {message}")
    return found


def judge(group, exc: BaseException | None, failed: bool) -> list[str] | None:
    """After some rank raised an accepted ``RankDesync`` at this op: None if every rank raised one naming a unit
    and the fix (one all-reduce, on every rank), else this rank's problems.

    ``exc``: this rank's accepted ``RankDesync``, or None; ``failed``: this rank has a failure of its own.
    """
    own = problems(exc) if exc is not None else []
    flag = torch.tensor([int(exc is None or failed or bool(own))])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if not int(flag.item()):
        return None
    if own or failed:
        return own
    if exc is not None:
        return [f"RankDesync was raised on this rank, but not on every rank with a unit and a fix: {exc}"]
    return ["another rank raised RankDesync at this op; this rank ran on without it (every rank must raise it)"]


def forget_dumps(exc: BaseException, rt) -> None:
    """Remove the flight-recorder dumps of an accepted outcome: those named in the notes of ``exc``, and every
    dump ``rt`` wrote (the accepted outcome ends the program, so no report names one: a forward refused for a
    module attached after ``shard()`` dumps without a note, and so does the reset after it)."""
    named = [path for note in getattr(exc, "__notes__", ()) for path in _DUMP.findall(note)]
    dumps = getattr(getattr(rt, "flight", None), "dumps", [])
    for path in named + [str(path) for path in dumps]:
        if os.path.basename(path).startswith("paramfsm-trace-"):
            with contextlib.suppress(OSError):
                os.remove(path)
    dumps.clear()
