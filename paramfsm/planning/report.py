"""What a memory plan says: each phase's peak bytes per rank, by kind, and where it peaks; the activations apart.

A phase's ``total`` is working memory (the device's, or the host's on a CPU run); what offload tiers hold
(``tier_cpu``, ``tier_disk``) is shown beside it and not added in.

:class:`Plan` is what ``paramfsm.plan`` returns and ``paramfsm plan`` prints. Every figure is bytes per
rank that paramfsm holds (the kinds of :data:`paramfsm.planning.rehearsal.KINDS`). Activations are the
model's, not the runtime's: they are their own line, never inside another figure, and they count in the
forward and backward peaks only when known (given, or measured on the example input).
"""

from __future__ import annotations

import re

import attrs

from paramfsm.errors import ArgumentError

#: Phases whose peak holds the activations of the forward (saved for its backward).
WITH_ACTIVATIONS = ("forward", "backward")
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 10**3, "KIB": 1 << 10, "M": 1 << 20, "MB": 10**6, "MIB": 1 << 20,
          "G": 1 << 30, "GB": 10**9, "GIB": 1 << 30, "T": 1 << 40, "TB": 10**12, "TIB": 1 << 40}


def parse_bytes(value) -> int:
    """``20 << 30``, ``"20GiB"``, ``"1.5 GB"``, ``"512MiB"`` -> bytes."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    found = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(value))
    if found is None or found.group(2).upper() not in _UNITS:
        raise ArgumentError(f"a size must be a number of bytes or a string such as '20GiB' or '512MB', got {value!r}")
    return int(float(found.group(1)) * _UNITS[found.group(2).upper()])


def size(n: int | None) -> str:
    """``1536`` -> ``1.5 KiB``."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


@attrs.frozen
class PhasePeak:
    """The largest total one phase reached: ``total`` bytes, split by kind, after ``event`` of ``unit``."""

    phase: str
    total: int
    kinds: dict
    unit: str
    event: str


@attrs.frozen
class Plan:
    """Peak bytes per rank for each phase of a training step (see the module docstring)."""

    world_size: int
    phases: tuple
    activations: int | None
    activations_source: str
    gathered_bytes: int
    reduced_bytes: int
    tier_bytes: int
    units: int
    optimizer: str
    options: dict
    budget: int | None = None
    notes: tuple = ()
    #: Over budget: the least costly placement that fits, or the closest (see paramfsm.planning.budget).
    placement: dict | None = None

    def phase(self, name: str) -> PhasePeak:
        """The peak of phase ``name`` (``init``, ``forward``, ``backward``, ``step``, ``checkpoint``)."""
        for peak in self.phases:
            if peak.phase == name:
                return peak
        raise KeyError(f"no phase {name!r} in this plan (it has {[p.phase for p in self.phases]})")

    def with_activations(self, peak: PhasePeak) -> int:
        """A phase's total with the activations it holds (forward and backward), when they are known."""
        return peak.total + (self.activations or 0) * (peak.phase in WITH_ACTIVATIONS)

    @property
    def peak(self) -> int:
        """The largest of the phases' totals, activations included where known: what a rank needs."""
        return max(self.with_activations(p) for p in self.phases)

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.with_activations).phase

    def fits(self, budget) -> bool:
        """Whether :attr:`peak` is at most ``budget`` (bytes, or a string such as ``"20GiB"``)."""
        return self.peak <= parse_bytes(budget)

    def to_dict(self) -> dict:
        """Everything, JSON-ready: bytes as integers."""
        return {
            "world_size": self.world_size, "units": self.units, "optimizer": self.optimizer,
            "options": {k: repr(v) if not isinstance(v, (int, float, str, bool, type(None))) else v
                        for k, v in self.options.items()},
            "phases": {p.phase: {"total": p.total, "with_activations": self.with_activations(p), "kinds": dict(p.kinds),
                                 "unit": p.unit, "event": p.event} for p in self.phases},
            "activations": self.activations, "activations_source": self.activations_source,
            "peak": self.peak, "peak_phase": self.peak_phase,
            "traffic_per_step": {"all_gather": self.gathered_bytes, "reduce_scatter": self.reduced_bytes,
                                 "offload_tiers": self.tier_bytes},
            "budget": self.budget, "fits": None if self.budget is None else self.peak <= self.budget,
            "notes": list(self.notes), "placement": self.placement,
        }

    def __str__(self) -> str:
        kinds = [k for k in self.phases[0].kinds if any(p.kinds.get(k) for p in self.phases)]
        head = ["phase", "total", *kinds, "peaks at"]  # tier_cpu, tier_disk: apart from the total
        rows = [[p.phase, size(p.total), *(size(p.kinds.get(k, 0)) for k in kinds),
                 (f"unit '{p.unit}', " if p.unit else "") + p.event] for p in self.phases]
        widths = [max(len(str(row[i])) for row in [head, *rows]) for i in range(len(head))]
        line = lambda row: "  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip()  # noqa: E731
        out = [f"paramfsm memory plan: per rank, world size {self.world_size}, {self.units} units, "
               f"optimizer {self.optimizer}", line(head), *(line(row) for row in rows)]
        out.append(f"activations: {size(self.activations)} ({self.activations_source})")
        out.append(f"peak: {size(self.peak)} in {self.peak_phase}"
                   + (" (activations included)" if self.activations and self.peak_phase in WITH_ACTIVATIONS else ""))
        out.append(f"traffic per step and rank: all-gathers receive {size(self.gathered_bytes)}, "
                   f"reduce-scatters send {size(self.reduced_bytes)}"
                   + (f", offload tiers read and write {size(self.tier_bytes)}" if self.tier_bytes else ""))
        if self.budget is not None:
            over = self.peak - self.budget
            out.append(f"budget {size(self.budget)}: " + ("fits" if over <= 0 else f"does not fit, {size(over)} over"))
        out.extend(self.notes)
        return "\n".join(out)
