"""What a memory measurement found: one rank's steady-step peak and its parts (bytes).

A leaf on purpose: ``measure.memory`` (FSDP2, FSDPMemTracker on the fake process group) and
``measure.ddp`` (a real one-rank DDP run, MemTracker) both return it, and ``measure.peak``
chooses between them, so neither measurement needs to import the other.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(kw_only=True)
class MeasuredMemory:
    """One rank's steady-step memory, as the tracker accounts it (bytes)."""

    peak_bytes: int
    """Highest total during the steady step."""
    breakdown: dict[str, int]
    """Tracker categories at that peak (``Sharded Param``, ``Activation``, ``OptState``, ...)."""
    step_start_bytes: int
    """Memory alive when the steady step began (what the peak was restarted from)."""
    module_peaks: dict[str, int] = field(default_factory=dict)
    """Per module FQN (``""`` the root): the highest total while that module ran."""
    world_size: int = 1
    mesh: tuple[int, int] = (1, 1)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)
    dtype_mismatches: list[str] = field(default_factory=list)
    """Ops a real device would refuse (see ``dtypes.DtypeChecker``): the plan cannot run."""
    record: Any = None
    """The steady step's allocations and boundaries (``recording.MemoryRecord``) when asked
    for (``measure_peak(record=True)``); not part of ``to_dict``."""
    where: str | None = None
    """Where the peak was measured when not on the fake process group (a DDP plan's real
    run), for the report's headline. Not part of ``to_dict``, whose keys are fixed."""

    def to_dict(self) -> dict[str, Any]:
        return {"peak_bytes": self.peak_bytes, "breakdown": dict(self.breakdown),
                "step_start_bytes": self.step_start_bytes, "module_peaks": dict(self.module_peaks),
                "world_size": self.world_size, "mesh": list(self.mesh),
                "seconds": round(self.seconds, 3), "notes": list(self.notes),
                "dtype_mismatches": list(self.dtype_mismatches)}
