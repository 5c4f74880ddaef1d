"""One trace record (:class:`TraceRecord`) and its JSON Lines form.

:mod:`paramfsm.core.trace` keeps raw entries and turns them into these records
when read; traces are written and read back one JSON object per line.

This module imports neither ``torch`` nor ``cupy``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import attrs

#: The event of a snapshot record: the parameter's state and holders where a trace window opens.
SNAPSHOT = "snapshot"
FIELDS = ("seq", "t_ns", "rank", "step", "graph_task", "param", "unit", "event", "src", "dst",
          "effects", "keep_graph", "retained", "holds", "nbytes", "spec", "coord", "machine", "kind")


@attrs.frozen(slots=True)
class TraceRecord:
    """One transition of one parameter (DESIGN §5), plus the guard inputs replay needs."""

    seq: int
    t_ns: int
    rank: int
    step: int
    graph_task: int
    param: str
    unit: str
    event: str
    src: str
    dst: str
    effects: tuple[str, ...]
    keep_graph: bool = False
    retained: bool = False
    holds: int = 0  # holders before the transition
    nbytes: int = 0  # bytes of the full parameter
    spec: str = ""  # digest of the spec the run stepped under (paramfsm.core.fsm.Table.digest)
    coord: tuple[int, ...] = ()  # hybrid sharding: (replica, shard rank) on the device mesh; () otherwise
    machine: str = ""  # "" for the lifetime machine, "residency" for an offloaded value's residency
    kind: str = ""  # a residency record's value: "shard", "grad" or "optim"

    def to_json(self) -> dict:
        """The record as a JSON object (``coord`` only under hybrid sharding, ``machine`` and ``kind`` only
        for residency records)."""
        out = {f: (list(v) if f in ("effects", "coord") else v) for f, v in zip(FIELDS, attrs.astuple(self))}
        for field in ("coord", "machine", "kind"):
            if not out[field]:
                del out[field]
        return out

    @property
    def subject(self) -> tuple:
        """What one sequence of records is about: (rank, machine, kind, parameter)."""
        return self.rank, self.machine, self.kind, self.param

    @classmethod
    def from_json(cls, obj: dict) -> "TraceRecord":
        """Build a record from its JSON object; raises ValueError naming a missing or mistyped field."""
        if not isinstance(obj, dict):
            raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
        missing = [f for f in FIELDS[:11] if f not in obj]
        if missing:
            raise ValueError(f"record lacks field(s) {missing}")
        kwargs = {f: obj[f] for f in FIELDS if f in obj}
        for field, value in kwargs.items():
            if not _FIELD_CHECKS[field](value):
                raise ValueError(f"field {field!r} has the wrong type: {value!r}")
        kwargs["effects"] = tuple(kwargs["effects"])
        if "coord" in kwargs:
            kwargs["coord"] = tuple(kwargs["coord"])
        return cls(**kwargs)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_FIELD_CHECKS = {
    **dict.fromkeys(("seq", "t_ns", "rank", "step", "graph_task", "holds", "nbytes"), _is_int),
    **dict.fromkeys(("param", "unit", "event", "src", "dst", "spec", "machine", "kind"), lambda v: isinstance(v, str)),
    **dict.fromkeys(("keep_graph", "retained"), lambda v: isinstance(v, bool)),
    "effects": lambda v: isinstance(v, list) and all(isinstance(e, str) for e in v),
    "coord": lambda v: isinstance(v, list) and all(_is_int(c) for c in v),
}


def iter_jsonl(path: str | Path) -> Iterator[TraceRecord]:
    """The records of a JSON Lines trace; ValueError names the line of a malformed one."""
    with Path(path).open(encoding="utf-8") as src:
        for lineno, line in enumerate(src, start=1):
            if not line.strip():
                continue
            try:
                yield TraceRecord.from_json(json.loads(line))
            except (ValueError, TypeError) as exc:
                raise ValueError(f"{path}:{lineno}: not a trace record: {exc}") from None
            except RecursionError:
                raise ValueError(f"{path}:{lineno}: not a trace record: nested too deeply") from None
