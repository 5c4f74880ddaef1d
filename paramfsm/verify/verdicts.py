"""What a program's op can end in besides passing, on one rank, and how the ranks agree on it.

:class:`Failed` (a check failed, or the op raised) and :class:`Rejected`
(plain torch cannot run the op: the program is invalid for the model) are
raised by the :class:`~paramfsm.verify.checker.Checker` around an op;
:func:`agree` is the one tiny all-reduce every rank calls at the same point
so that all ranks stop at the same op. :mod:`paramfsm.verify.rank_loss` adds
the third ending, a ``RankDesync`` raised on every rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class Failed(Exception):
    """A check failed (or the op raised) at op ``op`` (None: setting up or at the end); carries the check kind."""

    def __init__(self, kind: str, problems, detail: str = "", op: int | None = None):
        self.kind, self.problems, self.detail, self.op = kind, list(problems), detail, op
        super().__init__("; ".join(self.problems))

    def report(self) -> str:
        """One line naming the check and the op, then the problems' detail (a traceback tail), if any."""
        where = f"op {self.op}" if self.op is not None else "setup or teardown"
        return f"{self.kind} check failed at {where}: {self}" + (f"\n{self.detail}" if self.detail else "")


class Rejected(Exception):
    """Plain torch cannot run op ``op`` on this model: the program is invalid for it, not a paramfsm bug."""

    def __init__(self, reason: str, op: int, detail: str = ""):
        self.reason, self.op, self.detail = reason, op, detail
        super().__init__(f"plain torch cannot run op {op} on this model: {reason}")


def agree(group, code: int) -> int:
    """The largest code any rank reports (every rank calls this at the same point)."""
    flag = torch.tensor([code])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return int(flag.item())
