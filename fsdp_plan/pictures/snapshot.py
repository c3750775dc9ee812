"""A step as an allocation timeline in the format of ``torch.cuda.memory._snapshot()``
(``--memory-snapshot SNAP.pickle``), so PyTorch's memory viewer (``torch.cuda._memory_viz``,
pytorch.org/memory_viz) opens a predicted or measured step beside a real one.

[Note: a predicted snapshot]
The memory model's timeline (memory.py ``memory_timeline``) says what holds memory at every
point of the step. Each kind of memory becomes allocations: the resident state (sharded
parameters, optimizer states, module buffers, inputs) was allocated before the trace began and
is still allocated at its end, as in a snapshot taken mid-training; every buffer the sweep
holds over a range of points (gathered parameters, communication buffers, gradients) is one
allocation from its first point to its last; activations are a stack of allocations that grows
and shrinks with the activation bytes. Going from one point to the next, frees come before
allocations, so the total between two points never exceeds the higher of them: the viewer's
"Active Memory Timeline" peaks at exactly the predicted peak (``active_peak`` replays a
snapshot as the viewer does, and the tests hold it to ``predicted.peak_bytes``). Addresses come
from a first-fit allocator over one segment, in 512-byte blocks like the CUDA caching
allocator's; each allocation's frame names what it holds and where in the step it began.

A measured snapshot replays a recorded step (recording.py) the same way: what was alive when
the step began, then every allocation and free the tracker accounted. On a GPU, bench records
the CUDA allocator itself (``torch.cuda.memory._record_memory_history``) instead.

Known limitation: the viewer's JavaScript (MemoryViz.js) is loaded from the internet, so
``torch.cuda._memory_viz.trace_plot``'s page stays blank offline; this project's own
``--html`` page draws memory over the step without it.
"""

from __future__ import annotations

import bisect
import pickle
from collections.abc import Iterable
from typing import Any

from fsdp_plan.cost.memory import MemoryTimeline
from fsdp_plan.pictures.series import CATEGORIES

BLOCK = 512
"""Allocation granularity (the CUDA caching allocator rounds every block to 512 bytes)."""
BASE_ADDRESS = 0x7F0000000000
"""Where the one segment starts (any address works; this one looks like a device pointer)."""


def _frames(text: str, where: str) -> list[dict[str, Any]]:
    return [{"filename": where, "line": 0, "name": text}]


class _Allocator:
    """First-fit addresses over one growing segment, and the trace of what it did."""

    def __init__(self, device: int, where: str) -> None:
        self.device = device
        self.where = where
        self.free: list[tuple[int, int]] = []  # (offset, size), sorted, merged
        self.top = 0
        self.live: dict[Any, tuple[int, int, int, list[dict[str, Any]]]] = {}
        """key -> (offset, block size, bytes, frames)."""
        self.trace: list[dict[str, Any]] = []

    def _place(self, block: int) -> int:
        for i, (offset, size) in enumerate(self.free):
            if size >= block:
                if size == block:
                    del self.free[i]
                else:
                    self.free[i] = (offset + block, size - block)
                return offset
        offset = self.top
        self.top += block
        return offset

    def _release(self, offset: int, block: int) -> None:
        i = bisect.bisect_left(self.free, (offset, 0))
        self.free.insert(i, (offset, block))
        if i + 1 < len(self.free) and offset + block == self.free[i + 1][0]:
            self.free[i] = (offset, block + self.free[i + 1][1])
            del self.free[i + 1]
        if i > 0 and self.free[i - 1][0] + self.free[i - 1][1] == offset:
            self.free[i - 1] = (self.free[i - 1][0], self.free[i - 1][1] + self.free[i][1])
            del self.free[i]

    def alloc(self, key: Any, nbytes: int, text: str, time_us: float | None,
              record: bool = True) -> None:
        """Allocate ``nbytes`` for ``key`` (before the trace when ``record`` is False)."""
        if nbytes <= 0:
            return
        block = -(-nbytes // BLOCK) * BLOCK
        offset = self._place(block)
        frames = _frames(text, self.where)
        self.live[key] = (offset, block, nbytes, frames)
        if record:
            self.trace.append(self._entry("alloc", offset, nbytes, frames, time_us))

    def release(self, key: Any, time_us: float | None) -> None:
        """Free ``key``'s allocation (nothing when it has none)."""
        found = self.live.pop(key, None)
        if found is None:
            return
        offset, block, nbytes, frames = found
        for action in ("free_requested", "free_completed"):
            self.trace.append(self._entry(action, offset, nbytes, frames, time_us))
        self._release(offset, block)

    def _entry(self, action: str, offset: int, nbytes: int, frames: list[dict[str, Any]],
               time_us: float | None) -> dict[str, Any]:
        entry = {"action": action, "addr": BASE_ADDRESS + offset, "size": nbytes,
                 "stream": 0, "frames": frames}
        if time_us is not None:
            entry["time_us"] = int(time_us)
        return entry

    def snapshot(self) -> dict[str, Any]:
        """The ``torch.cuda.memory._snapshot()`` dictionary: one segment holding what is
        allocated now (inactive between), and the trace."""
        blocks: list[dict[str, Any]] = []
        cursor = 0
        for offset, block, nbytes, frames in sorted(self.live.values(), key=lambda v: v[0]):
            if offset > cursor:
                blocks.append({"address": BASE_ADDRESS + cursor, "size": offset - cursor,
                               "requested_size": 0, "state": "inactive", "frames": []})
            blocks.append({"address": BASE_ADDRESS + offset, "size": block,
                           "requested_size": nbytes, "state": "active_allocated",
                           "frames": frames})
            cursor = offset + block
        total = max(self.top, cursor)
        if total > cursor:
            blocks.append({"address": BASE_ADDRESS + cursor, "size": total - cursor,
                           "requested_size": 0, "state": "inactive", "frames": []})
        allocated = sum(b["requested_size"] for b in blocks if b["state"] != "inactive")
        segment = {"device": self.device, "address": BASE_ADDRESS, "total_size": total,
                   "allocated_size": allocated, "active_size": allocated,
                   "requested_size": allocated, "stream": 0, "segment_type": "large",
                   "segment_pool_id": (0, 0), "is_expandable": False, "frames": [],
                   "blocks": blocks}
        traces: list[list[dict[str, Any]]] = [[] for _ in range(self.device + 1)]
        traces[self.device] = self.trace
        return {"segments": [segment] if total else [], "device_traces": traces}


def _label(key: str) -> str:
    return CATEGORIES.get(key, key.replace("_", " "))


def predicted_snapshot(timeline: MemoryTimeline, times_s: Iterable[float] | None = None, *,
                       device: int = 0) -> dict[str, Any]:
    """The predicted step ([Note: a predicted snapshot]); ``times_s`` (seconds into the step
    of every event, ``series.event_times``) stamps the trace entries."""
    at = list(times_s) if times_s is not None else None
    a = _Allocator(device, "fsdp-plan (predicted)")
    for key, nbytes in timeline.static.items():
        a.alloc(("static", key), nbytes, f"{_label(key)} (resident)", None, record=False)
    activation_stack: list[tuple[Any, int]] = []
    counter = [0]

    def set_activations(target: int, where: str, t: float | None) -> None:
        held = sum(n for _, n in activation_stack)
        label = f"{_label('activations')} ({where})"
        while activation_stack and held > target:  # frees first ...
            key, n = activation_stack.pop()
            a.release(key, t)
            held -= n
        if target > held:  # ... then the new allocation
            counter[0] += 1
            key = ("activations", counter[0])
            a.alloc(key, target - held, label, t)
            activation_stack.append((key, target - held))

    for i, point in enumerate(timeline.points):
        event = point >> 2
        ev = timeline.events[event]
        where = f"{'forward' if event <= timeline.forward_end else 'backward'}: " \
                f"{ev.kind} {ev.module or '<root>'}"
        t = at[event] * 1e6 if at else None
        wanted: dict[Any, tuple[int, str]] = {}
        for key, nbytes in timeline.held.items():
            wanted[("held", key)] = (nbytes, f"{_label(key)} (held across micro-batches)")
        for j, (start, end, nbytes, cat) in enumerate(timeline.live):
            if start <= point < end:
                wanted[("live", j)] = (nbytes, _label(cat))
        for j, (when, nbytes) in enumerate(timeline.grads_at):
            if when <= point:
                wanted[("grads", j)] = (nbytes, _label("sharded_grads"))
        if point & 3:
            for j, (when, nbytes, cat) in enumerate(timeline.instants):
                if when == point:
                    wanted[("instant", j)] = (nbytes, _label(cat))
        for key in [k for k in a.live if k[0] in ("held", "live", "grads", "instant")]:
            if key not in wanted:
                a.release(key, t)
        set_activations(min(timeline.activations[i], sum(n for _, n in activation_stack)),
                        where, t)
        for key, (nbytes, label) in wanted.items():
            if key not in a.live:
                a.alloc(key, nbytes, f"{label} (from {where})", t)
        set_activations(timeline.activations[i], where, t)
    end_t = (max(at) * 1e6 if at else None)
    for key in [k for k in a.live if k[0] != "static"]:
        a.release(key, end_t)
    if timeline.optimizer_step is not None:
        for key, nbytes in timeline.optimizer_step.items():
            if key not in timeline.static:
                a.alloc(("optimizer", key), nbytes, f"{_label(key)} (optimizer step)", end_t)
        for key in [k for k in a.live if k[0] == "optimizer"]:
            a.release(key, end_t)
    return a.snapshot()


def measured_snapshot(record: Any, *, device: int = 0, where: str = "FSDPMemTracker"
                      ) -> dict[str, Any]:
    """A recorded step (recording.py ``MemoryRecord``) as a snapshot: what was alive when the
    step began, then every allocation and free in order."""
    a = _Allocator(device, f"fsdp-plan (measured: {where})")
    for entry in record.initial:
        a.alloc(entry["addr"], entry["size"], f"{entry['category']} (before the step)", None,
                record=False)
    for entry in record.trace:
        if entry["action"] == "alloc":
            a.alloc(entry["addr"], entry["size"], entry["category"], None)
        else:
            a.release(entry["addr"], None)
    return a.snapshot()


def active_peak(snapshot: dict[str, Any], device: int = 0) -> int:
    """The highest allocated total over the snapshot's trace, replayed as the viewer's
    "Active Memory Timeline" replays it (MemoryViz.js ``process_alloc_data``): blocks alive
    at the end and never allocated in the trace, and blocks freed without an allocation in it,
    were allocated before it began."""
    trace = snapshot["device_traces"][device] if device < len(snapshot["device_traces"]) else []
    allocated: dict[int, int] = {}
    initially = 0
    actions: list[int] = []
    for e in trace:
        if e["action"] == "alloc":
            allocated[e["addr"]] = e["size"]
            actions.append(e["size"])
        elif e["action"] == "free_completed":
            if e["addr"] in allocated:
                actions.append(-allocated.pop(e["addr"]))
            else:
                initially += e["size"]
                actions.append(-e["size"])
    for seg in snapshot["segments"]:
        if seg["device"] != device:
            continue
        for b in seg["blocks"]:
            if b["state"] == "active_allocated" and b["address"] not in allocated:
                initially += b["requested_size"]
    total = peak = initially
    for change in actions:
        total += change
        peak = max(peak, total)
    return peak


def snapshot_bytes(snapshot: dict[str, Any]) -> bytes:
    """The pickle ``torch.cuda.memory._dump_snapshot`` would write."""
    return pickle.dumps(snapshot)
