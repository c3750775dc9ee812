"""Communication time and phases from a ``torch.profiler`` trace of bench's profiled steps:
total, hidden behind compute, exposed (left on the critical path), the tail, and the step's
forward / backward / optimizer split.

[Note: bench's figures are the trace verb's]
The bench worker profiles a few steps with ``prof.step()`` (``ProfilerStep#N``), as any
training loop would, and ``bench_figures`` reads them with ``fsdp-plan trace``'s own analysis
(trace_ranks.py ``analyze_rank``): the first step dropped, the median stable step's
``StepFigures`` (trace_figures.py [Note: the measured step split]) are bench's comm and phase
figures, unchanged, so ``fsdp-plan trace`` of the trace bench wrote reports the same numbers.
The few figures the trace document has no field for (compute time, exposed time per phase,
the backward's overlap slowdown, the count of collectives) are computed here from the same
step's activities with the same interval sweeps and medians.

``analyze_trace`` reads one step annotated with ``record_function`` regions
``fsdp_plan.step`` / ``forward`` / ``backward`` / ``optimizer`` (traces of older bench runs,
and hand-made ones): each activity gets the phase its (CPU-side launch) time falls in; what
is communication and compute, how GPU work is tied to its launch, the interval sweeps and the
overlap slowdown are those of ``fsdp-plan trace`` (trace_read.py, trace_steps.py [Note:
steps, phases and activities], intervals.py).

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

from fsdp_plan.measure.intervals import clip, length, minus, union
from fsdp_plan.measure.trace_figures import alone_medians, overlap_slowdown
from fsdp_plan.measure.trace_ranks import RankFigures, analyze_rank
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
    step: int | None = None
    """The ``ProfilerStep`` number these figures are of (None: a single annotated step)."""
    exposed_delaying_compute_s: float = 0.0
    backward_compute_s: float = 0.0
    """Wall time with at least one backward compute op running (``--baseline no-overlap``
    holds it against the same plan's backward with communication held: bench/overlap.py)."""
    backward_hidden_s: float = 0.0
    """Communication of the backward (and its tail) with backward compute beside it."""

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


PHASE_FIGURES = {"forward": "forward_s", "backward": "backward_s", "optimizer": "optimizer_s",
                 "tail": "comm_tail_s", "idle": "idle_s"}
"""Bench's phases and the ``StepFigures`` field each is: they sum to the step."""


def bench_figures(path: str) -> tuple[CommTiming, dict[str, float]]:
    """The communication timing and the phases (``PHASE_FIGURES``, seconds) of the median
    stable step of a bench trace ([Note: bench's figures are the trace verb's])."""
    rank = analyze_rank(path)
    return _timing(rank), phases_of(rank)


def phases_of(rank: RankFigures) -> dict[str, float]:
    """The median step's seconds per phase, rounded as the trace document rounds them."""
    figures = rank.median().to_dict()
    return {phase: figures[name] for phase, name in PHASE_FIGURES.items()}


def _timing(rank: RankFigures) -> CommTiming:
    m = rank.median()
    acts = rank.activities_by_step[m.step]
    lo, hi = next(s.window for s in rank.timeline.stable if s.number == m.step)
    comm = [a for a in acts if a.comm]
    compute_u = clip(_spans(acts, lambda a: a.compute), lo, hi)
    by_phase = {phase: length(minus(clip(_spans(comm, lambda a, p=phase: a.phase == p), lo, hi),
                                    compute_u)) * _US for phase in PHASES}
    medians = alone_medians(list(rank.activities_by_step.values()))
    slow_bw = overlap_slowdown([a for a in acts if a.comm or a.phase == "backward"],
                               medians) * _US
    bw_compute_u = clip(_spans(acts, lambda a: a.compute and a.phase == "backward"), lo, hi)
    bw_comm_u = clip(_spans(comm, lambda a: a.phase not in ("forward", "optimizer")), lo, hi)
    return CommTiming(comm_s=m.comm_s, hidden_s=m.hidden_comm_s, exposed_s=m.exposed_comm_s,
                      tail_exposed_s=m.comm_tail_s, compute_s=length(compute_u) * _US,
                      step_s=m.step_s, exposed_by_phase_s=by_phase,
                      overlap_slowdown_s=m.overlap_slowdown_s,
                      backward_overlap_slowdown_s=slow_bw,
                      num_comm_events=sum(rank.collectives_per_step.values()),
                      source=rank.source, step=m.step,
                      exposed_delaying_compute_s=m.exposed_delaying_compute_s,
                      backward_compute_s=length(bw_compute_u) * _US,
                      backward_hidden_s=(length(bw_comm_u) - length(minus(bw_comm_u,
                                                                          bw_compute_u))) * _US)


def stream_intervals(path: str) -> dict[str, list[tuple[float, float]]]:
    """The median stable step's compute, communication and exposed communication
    (communication with no compute beside it) of a bench trace as merged intervals in seconds
    from the start of the step's window, by the trace verb's rules: the measured rows of a
    page's timeline."""
    rank = analyze_rank(path)
    acts = rank.activities_by_step[rank.median_step]
    origin, end = next(s.window for s in rank.timeline.stable if s.number == rank.median_step)
    comm_u = clip(_spans(acts, lambda a: a.comm), origin, end)
    compute_u = clip(_spans(acts, lambda a: a.compute), origin, end)

    def rel(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
        return [((a - origin) * _US, (b - origin) * _US) for a, b in intervals]
    return {"compute": rel(compute_u), "comm": rel(comm_u),
            "exposed": rel(minus(comm_u, compute_u))}
