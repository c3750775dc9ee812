"""Communication time from a ``torch.profiler`` trace of one steady step: total, hidden behind
compute, and exposed (left on the critical path).

Pure functions over the Chrome trace JSON that ``export_chrome_trace`` writes, so they are
tested on hand-made traces. The step is annotated by the bench worker with
``record_function`` regions ``fsdp_plan.forward``, ``fsdp_plan.backward`` and
``fsdp_plan.optimizer``; each interval gets the phase its (CPU-side launch) time falls in.

[Note: what counts as communication and compute]
- GPU: kernels (``cat == "kernel"``); NCCL kernels are communication, every other kernel is
  compute. A kernel's phase is that of the CPU launch that shares its ``correlation`` id.
- CPU (gloo): gloo runs each collective on its own threads, recorded as ``gloo:*`` events;
  those are communication. Compute is the outermost ``aten::`` ops on the other threads,
  except ops inside a ``c10d::`` call (they are the collective's own bookkeeping).
- exposed = length of (union of communication) minus (union of compute); hidden = the rest.
  ``tail_exposed_s`` = max(0, last communication end - last backward compute end): the
  reduce-scatter tail that nothing can hide, the simplest figure of exposed communication.
- overlap slowdown: compute ops that ran while communication was in flight, compared with the
  median of the same op (by name) when it ran alone; the sum of the excess is how much the
  overlap slowed compute down (contention for SMs, memory bandwidth or CPU cores).
"""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any

PHASES = ("forward", "backward", "optimizer")
_US = 1e-6


@dataclass(kw_only=True)
class CommTiming:
    """Communication of one rank over one profiled step, in seconds."""

    comm_s: float
    """Wall time with at least one collective in flight."""
    hidden_s: float
    exposed_s: float
    tail_exposed_s: float
    compute_s: float
    """Wall time with at least one compute op running."""
    step_s: float
    exposed_by_phase_s: dict[str, float] = field(default_factory=dict)
    overlap_slowdown_s: float = 0.0
    backward_overlap_slowdown_s: float = 0.0
    num_comm_events: int = 0
    source: str = "cpu"
    """``gpu`` (kernels) or ``cpu`` (gloo threads and aten ops)."""

    def to_dict(self) -> dict[str, Any]:
        return {k: (round(v, 9) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(b - a for a, b in intervals)


def _minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Parts of the (merged) intervals ``a`` not covered by the (merged) intervals ``b``."""
    out = []
    for start, end in a:
        cursor = start
        for b_start, b_end in b:
            if b_end <= cursor or b_start >= end:
                continue
            if b_start > cursor:
                out.append((cursor, b_start))
            cursor = max(cursor, b_end)
        if cursor < end:
            out.append((cursor, end))
    return out


def _overlaps(interval: tuple[float, float], merged: list[tuple[float, float]]) -> bool:
    return any(s < interval[1] and e > interval[0] for s, e in merged)


@dataclass
class _Span:
    name: str
    start: float
    end: float
    tid: Any
    cat: str = ""
    corr: Any = None
    """The CUDA correlation id linking a kernel to its CPU launch."""
    phase: str | None = None


def _spans(trace: dict[str, Any]) -> list[_Span]:
    events = trace.get("traceEvents", trace if isinstance(trace, list) else [])
    spans = []
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        start = float(e["ts"])
        spans.append(_Span(e.get("name", ""), start, start + float(e["dur"]),
                           (e.get("pid"), e.get("tid")), e.get("cat", ""),
                           (e.get("args") or {}).get("correlation")))
    return spans


def _phase_of(ts: float, regions: list[_Span]) -> str | None:
    for region in regions:
        if region.start <= ts <= region.end:
            return region.name.removeprefix("fsdp_plan.")
    return None


def _outermost(spans: list[_Span]) -> list[_Span]:
    """Spans not nested in another span of the list on the same thread."""
    by_tid: dict[Any, list[_Span]] = {}
    for s in spans:
        by_tid.setdefault(s.tid, []).append(s)
    out = []
    for items in by_tid.values():
        items.sort(key=lambda s: (s.start, -s.end))
        end = float("-inf")
        for s in items:
            if s.start >= end:
                out.append(s)
                end = s.end
    return out


def _classify(spans: list[_Span]) -> tuple[list[_Span], list[_Span], str]:
    """(communication, compute, source) per [Note: what counts as communication and compute]."""
    kernels = [s for s in spans if s.cat == "kernel"]
    if kernels:
        comm = [s for s in kernels if "nccl" in s.name.lower()]
        return comm, [s for s in kernels if "nccl" not in s.name.lower()], "gpu"
    comm = [s for s in spans if s.name.startswith("gloo:")]
    comm_tids = {s.tid for s in comm}
    c10d = [s for s in spans if s.name.startswith("c10d::")]
    aten = [s for s in spans if s.name.startswith("aten::") and s.tid not in comm_tids
            and not any(c.tid == s.tid and c.start <= s.start and s.end <= c.end for c in c10d)]
    return comm, _outermost(aten), "cpu"


def analyze_trace(trace: dict[str, Any] | str) -> CommTiming:
    """Communication timing of the one step in ``trace`` (a Chrome trace dict or file path)."""
    if isinstance(trace, str):
        with open(trace) as f:
            trace = json.load(f)
    spans = _spans(trace)
    regions = [s for s in spans if s.name in {f"fsdp_plan.{p}" for p in PHASES}]
    launch_ts = {s.corr: s.start for s in spans
                 if s.cat != "kernel" and s.corr is not None}
    comm, compute, source = _classify(spans)
    for s in comm + compute:
        ts = launch_ts.get(s.corr, s.start) if source == "gpu" else s.start
        s.phase = _phase_of(ts, regions)
    comm_u, compute_u = _union([(s.start, s.end) for s in comm]), _union(
        [(s.start, s.end) for s in compute])
    exposed = _minus(comm_u, compute_u)
    by_phase = {}
    for phase in PHASES:
        phase_comm = _union([(s.start, s.end) for s in comm if s.phase == phase])
        by_phase[phase] = _length(_minus(phase_comm, compute_u)) * _US
    backward_compute_end = max((s.end for s in compute if s.phase == "backward"),
                               default=max((s.end for s in compute), default=0.0))
    comm_end = max((s.end for s in comm if s.phase != "optimizer"), default=0.0)
    slow_all, slow_bw = _overlap_slowdown(compute, comm_u)
    step = [s for s in spans if s.name == "fsdp_plan.step"]
    step_s = (step[0].end - step[0].start) * _US if step else 0.0
    return CommTiming(comm_s=_length(comm_u) * _US, exposed_s=_length(exposed) * _US,
                      hidden_s=(_length(comm_u) - _length(exposed)) * _US,
                      tail_exposed_s=max(0.0, comm_end - backward_compute_end) * _US if comm else 0.0,
                      compute_s=_length(compute_u) * _US, step_s=step_s,
                      exposed_by_phase_s=by_phase, overlap_slowdown_s=slow_all,
                      backward_overlap_slowdown_s=slow_bw, num_comm_events=len(comm), source=source)


def _overlap_slowdown(compute: list[_Span], comm_u: list[tuple[float, float]]) -> tuple[float, float]:
    """Excess time of compute ops that overlapped communication over their lone median."""
    alone: dict[str, list[float]] = {}
    overlapped: list[_Span] = []
    for s in compute:
        if _overlaps((s.start, s.end), comm_u):
            overlapped.append(s)
        else:
            alone.setdefault(s.name, []).append(s.end - s.start)
    medians = {name: statistics.median(d) for name, d in alone.items()}
    total = backward = 0.0
    for s in overlapped:
        if s.name in medians:
            excess = max(0.0, (s.end - s.start) - medians[s.name]) * _US
            total += excess
            if s.phase == "backward":
                backward += excess
    return total, backward


def stream_intervals(trace: dict[str, Any] | str) -> dict[str, list[tuple[float, float]]]:
    """The profiled step's compute, communication and exposed communication (communication
    with no compute beside it) as merged intervals in seconds from the step's start, by the
    same rules as ``analyze_trace`` ([Note: what counts as communication and compute]): the
    measured rows of a page's timeline."""
    if isinstance(trace, str):
        with open(trace) as f:
            trace = json.load(f)
    spans = _spans(trace)
    comm, compute, _ = _classify(spans)
    step = [s for s in spans if s.name == "fsdp_plan.step"]
    origin = step[0].start if step else min((s.start for s in spans), default=0.0)
    comm_u = _union([(s.start, s.end) for s in comm])
    compute_u = _union([(s.start, s.end) for s in compute])

    def rel(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
        return [((a - origin) * _US, (b - origin) * _US) for a, b in intervals]
    return {"compute": rel(compute_u), "comm": rel(comm_u),
            "exposed": rel(_minus(comm_u, compute_u))}
