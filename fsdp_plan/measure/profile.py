"""Communication time from a ``torch.profiler`` trace of one bench step: total, hidden behind
compute, and exposed (left on the critical path).

The bench worker profiles one step with ``record_function`` regions ``fsdp_plan.step``,
``fsdp_plan.forward``, ``fsdp_plan.backward`` and ``fsdp_plan.optimizer``; each activity gets
the phase its (CPU-side launch) time falls in. What is communication and compute, how GPU
work is tied to its launch, the interval sweeps and the overlap slowdown are those of
``fsdp-plan trace`` (trace_read.py, trace_steps.py [Note: steps, phases and activities],
intervals.py, trace_figures.py [Note: the measured step split]): one definition of every
figure, here over the annotated step instead of ``ProfilerStep`` windows.

[Note: what counts as communication and compute]
- GPU: NCCL kernels are communication, every other kernel compute (copies and memsets are
  neither); CPU (gloo): ``gloo:*`` events are communication, the outermost ``aten::`` ops
  outside ``c10d::`` calls compute (trace_steps.py).
- exposed = length of (union of communication) minus (union of compute); hidden = the rest.
  ``tail_exposed_s`` = max(0, last communication end - last backward compute end): the
  reduce-scatter tail that nothing can hide, the simplest figure of exposed communication.
- overlap slowdown: per compute op name, its median beside communication over its median
  alone, times the count beside (trace_figures.py ``overlap_slowdown``): how much the
  overlap slowed compute down (contention for SMs, memory bandwidth or CPU cores).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from fsdp_plan.measure.intervals import length, minus, union
from fsdp_plan.measure.trace_figures import alone_medians, overlap_slowdown
from fsdp_plan.measure.trace_read import TraceEvent, raw_from_dict, read_trace
from fsdp_plan.measure.trace_steps import Activity, cpu_activities, gpu_activities

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


class _Regions:
    """The phase of a host timestamp: the ``fsdp_plan.<phase>`` region it falls in."""

    def __init__(self, events: list[TraceEvent]) -> None:
        self.regions = [(e.ts, e.end, e.name.removeprefix("fsdp_plan.")) for e in events
                        if e.name in {f"fsdp_plan.{p}" for p in PHASES}]

    def at(self, thread: Any, ts: float) -> str | None:
        return next((p for start, end, p in self.regions if start <= ts <= end), None)

    def unit(self, thread: Any, ts: float) -> str | None:
        return None


def _activities(trace: dict[str, Any] | str) -> tuple[list[Activity], list[TraceEvent], str]:
    raw = read_trace(trace) if isinstance(trace, str) else raw_from_dict(trace)
    phases = _Regions(raw.events)
    device = [e for e in raw.events if e.is_device]
    if device:
        acts, _ = gpu_activities(raw.events, device, phases, lambda ts: 0)
        return acts, raw.events, "gpu"
    return cpu_activities(raw.events, phases, lambda ts: 0), raw.events, "cpu"


def _spans(acts: list[Activity], which) -> list[tuple[float, float]]:
    return union((a.start, a.end) for a in acts if which(a))


def analyze_trace(trace: dict[str, Any] | str) -> CommTiming:
    """Communication timing of the one step in ``trace`` (a Chrome trace dict or file path)."""
    acts, events, source = _activities(trace)
    comm = [a for a in acts if a.comm]
    compute = [a for a in acts if a.compute]
    comm_u, compute_u = _spans(acts, lambda a: a.comm), _spans(acts, lambda a: a.compute)
    exposed = minus(comm_u, compute_u)
    by_phase = {phase: length(minus(_spans(comm, lambda a, p=phase: a.phase == p), compute_u)) * _US
                for phase in PHASES}
    backward_compute_end = max((a.end for a in compute if a.phase == "backward"),
                               default=max((a.end for a in compute), default=0.0))
    comm_end = max((a.end for a in comm if a.phase != "optimizer"), default=0.0)
    medians = alone_medians([acts])
    slow_all = overlap_slowdown(acts, medians) * _US
    slow_bw = overlap_slowdown([a for a in acts if a.comm or a.phase == "backward"],
                               medians) * _US
    step = [e for e in events if e.name == "fsdp_plan.step"]
    step_s = step[0].dur * _US if step else 0.0
    return CommTiming(comm_s=length(comm_u) * _US, exposed_s=length(exposed) * _US,
                      hidden_s=(length(comm_u) - length(exposed)) * _US,
                      tail_exposed_s=(max(0.0, comm_end - backward_compute_end) * _US
                                      if comm else 0.0),
                      compute_s=length(compute_u) * _US, step_s=step_s,
                      exposed_by_phase_s=by_phase, overlap_slowdown_s=slow_all,
                      backward_overlap_slowdown_s=slow_bw, num_comm_events=len(comm), source=source)


def stream_intervals(trace: dict[str, Any] | str) -> dict[str, list[tuple[float, float]]]:
    """The profiled step's compute, communication and exposed communication (communication
    with no compute beside it) as merged intervals in seconds from the step's start, by the
    same rules as ``analyze_trace``: the measured rows of a page's timeline."""
    acts, events, _ = _activities(trace)
    step = [e for e in events if e.name == "fsdp_plan.step"]
    origin = step[0].ts if step else min((e.ts for e in events), default=0.0)
    comm_u, compute_u = _spans(acts, lambda a: a.comm), _spans(acts, lambda a: a.compute)

    def rel(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
        return [((a - origin) * _US, (b - origin) * _US) for a, b in intervals]
    return {"compute": rel(compute_u), "comm": rel(comm_u),
            "exposed": rel(minus(comm_u, compute_u))}
