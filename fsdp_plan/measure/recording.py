"""A measured step's memory over time: ``FSDPMemTracker`` that also records every allocation it
accounts and the memory at every module boundary (for ``--memory-snapshot`` and ``--html``).

[Note: recording the measured step]
``FSDPMemTracker`` keeps one running total per reference type (``_update_snap``: a storage
added, deleted, resized or re-labelled) and updates its peak after every op
(``_update_peak_stats``). Recording those same calls gives the measured step as an allocation
trace with nothing estimated: each tracked storage is one allocation (a resize, as FSDP2 frees
and re-allocates unsharded parameters, is a free and a new allocation), labelled with the
tracker's reference type; what was tracked before the step began (sharded parameters,
optimizer states, buffers, inputs) was allocated before the trace, as in a CUDA snapshot taken
mid-training. The ``ModTracker`` the tracker already runs reports module boundaries; at each
one the current total and the highest total since the previous boundary are kept, the same
two figures the analysis keeps per boundary (``Event.level`` and ``Event.peak``), so the
measured curve lines up with the predicted one by (kind, module, occurrence).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fsdp_plan.measure.tracker import GroupAwareMemTracker

_TOTAL = "Total"
_ALIGN = 512
"""Allocation granularity of the recorded addresses (the CUDA caching allocator's)."""


@dataclass(kw_only=True)
class Boundary:
    """Memory at one module boundary of the measured step."""

    kind: str
    """``pre_fw``, ``post_fw``, ``pre_bw``, ``post_bw``, ``optimizer`` (its start) or ``end``."""
    module: str
    level: int
    """Bytes tracked at the boundary."""
    peak: int
    """Highest tracked total since the previous boundary (at least ``level``)."""


@dataclass(kw_only=True)
class MemoryRecord:
    """One measured step: allocations before it, every allocation and free during it, and the
    memory at its module boundaries. Plain data (a JSON form for bench's result file)."""

    initial: list[dict[str, Any]] = field(default_factory=list)
    """``{addr, size, category}`` alive when the step began."""
    trace: list[dict[str, Any]] = field(default_factory=list)
    """``{action: alloc | free, addr, size, category}`` in order."""
    boundaries: list[Boundary] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"initial": self.initial, "trace": self.trace,
                "boundaries": [vars(b) for b in self.boundaries]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MemoryRecord:
        return cls(initial=list(data.get("initial", [])), trace=list(data.get("trace", [])),
                   boundaries=[Boundary(**b) for b in data.get("boundaries", [])])


def _category(reftype: Any) -> str:
    return str(getattr(reftype, "value", reftype))


class RecordingMemTracker(GroupAwareMemTracker):
    """``GroupAwareMemTracker`` recording the step it tracks ([Note: recording the measured
    step]); ``record`` holds the result after the ``with`` block."""

    def __init__(self, mod: Any, optm: Any = None) -> None:
        super().__init__(mod, optm)
        self.record = MemoryRecord()
        self._recording = False
        self._done = False
        self._live: dict[int, dict[str, Any]] = {}
        """id(_WeakRefInfo) -> its current allocation (addr, size, category)."""
        self._next_addr = 1 << 32
        self._since = 0
        self._names = {id(m): fqn.replace("._checkpoint_wrapped_module", "")
                       for fqn, m in mod.named_modules()}
        self._optimizer_handle: Any = None

    # --- allocations ---------------------------------------------------------------------
    def _alloc(self, winfo: Any, size: int) -> None:
        if self._done:  # after the step: not part of the record
            return
        entry = {"addr": self._next_addr, "size": int(size),
                 "category": _category(winfo.reftype)}
        self._next_addr += max(_ALIGN, -(-int(size) // _ALIGN) * _ALIGN)
        self._live[id(winfo)] = entry
        if self._recording:
            self.record.trace.append({"action": "alloc", **entry})
        else:
            self.record.initial.append(entry)

    def _free(self, winfo: Any) -> None:
        entry = self._live.pop(id(winfo), None)
        if entry is None or self._done:
            return
        if self._recording:
            self.record.trace.append({"action": "free", **entry})
        else:
            self.record.initial.remove(entry)

    def _update_snap(self, u_type: Any, winfo: Any, old_mem_consumed: int | None = None,
                     old_reftype: Any = None) -> None:
        super()._update_snap(u_type, winfo, old_mem_consumed, old_reftype)
        kind = getattr(u_type, "name", str(u_type))
        if kind == "ADD":
            self._alloc(winfo, winfo.mem_consumed)
        elif kind == "DEL":
            self._free(winfo)
        elif kind == "SIZE":
            self._free(winfo)
            if winfo.mem_consumed > 0:
                self._alloc(winfo, winfo.mem_consumed)
        elif kind == "REF" and id(winfo) in self._live:  # re-labelled: the newest label wins
            self._live[id(winfo)]["category"] = _category(winfo.reftype)
        self._since = max(self._since, self._current())

    # --- boundaries ----------------------------------------------------------------------
    def _current(self) -> int:
        return int(sum(snap.get(_TOTAL, 0) for snap in self._curr_mem_snap.values()))

    def _boundary(self, kind: str, module: Any) -> None:
        if not self._recording:
            return
        level = self._current()
        fqn = self._names.get(id(module), "") if module is not None else ""
        self.record.boundaries.append(Boundary(kind=kind, module=fqn, level=level,
                                               peak=max(self._since, level)))
        self._since = level

    def __enter__(self) -> RecordingMemTracker:  # noqa: PYI034 (typing.Self needs 3.11)
        super().__enter__()
        if self._depth == 1:
            self._mod_tracker.register_user_hooks(
                lambda m, _i: self._boundary("pre_fw", m),
                lambda m, _i, _o: self._boundary("post_fw", m),
                lambda m, _g: self._boundary("pre_bw", m),
                lambda m, _g: self._boundary("post_bw", m))
            if self._optm is not None:
                self._optimizer_handle = self._optm.register_step_pre_hook(
                    lambda *_: self._boundary("optimizer", None))
            self._since = self._current()
            self._recording = True
        return self

    def __exit__(self, *args: object) -> None:
        if self._depth == 1:
            self._boundary("end", None)
            self._recording = False
            self._done = True
            self._mod_tracker.clear_user_hooks()
            if self._optimizer_handle is not None:
                self._optimizer_handle.remove()
                self._optimizer_handle = None
        super().__exit__(*args)
