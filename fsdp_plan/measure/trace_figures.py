"""Per-step figures of a measured timeline, split as the product's clock splits a step.

Input: a ``Timeline`` (trace_steps.py). Output: ``StepFigures`` per stable step, in seconds.

[Note: the measured step split]
Within a step's device window W (trace_steps.py), with comm / compute / busy the unions of
communication, compute and all device activities clipped to W:
- ``comm_s`` = |comm|; ``hidden_comm_s`` = |comm ∩ compute|; ``exposed_comm_s`` = the rest
  (communication with no compute kernel beside it);
- ``exposed_delaying_compute_s`` = the part of exposed during which some compute kernel had
  been launched by the host and had not started: compute truly waited for communication.
  Exposed time with nothing launched is the host's, not the network's (on a CPU trace there is
  no launch queue and this is 0);
- backward runs from the first backward activity to the last backward compute end (bf); the
  tail is ``comm_tail_s = max(0, cf - bf)`` with cf the last end of forward or backward
  communication (SPEC 8); forward is before backward, optimizer after the tail;
- ``forward_s`` / ``backward_s`` / ``optimizer_s`` are the busy time in those spans; ``idle_s``
  is the time outside the tail with no device activity, and ``host_wait_s`` the part of it
  with nothing launched and not yet started (the device waited for the host). So
  step_s = forward_s + backward_s + optimizer_s + comm_tail_s + idle_s;
- ``overlap_slowdown_s``: per compute kernel name, (median duration beside communication in
  this step - median duration alone over all stable steps) x the count beside it, clipped
  at 0, summed over names.
"""

from __future__ import annotations

import bisect
import statistics
from dataclasses import asdict, dataclass
from typing import Any

from fsdp_plan.measure.intervals import Cover, clip, intersect, length, minus, union
from fsdp_plan.measure.trace_steps import Activity, Step, Timeline

US = 1e-6
STEP_FIELDS = ("step", "step_s", "forward_s", "backward_s", "optimizer_s", "idle_s",
               "host_wait_s", "comm_s", "hidden_comm_s", "exposed_comm_s",
               "exposed_delaying_compute_s", "comm_tail_s", "overlap_slowdown_s")


@dataclass(kw_only=True)
class StepFigures:
    """One stable step of one rank (SPEC 8's step fields), seconds."""

    step: int
    step_s: float
    forward_s: float
    backward_s: float
    optimizer_s: float
    idle_s: float
    host_wait_s: float
    comm_s: float
    hidden_comm_s: float
    exposed_comm_s: float
    exposed_delaying_compute_s: float
    comm_tail_s: float
    overlap_slowdown_s: float

    def to_dict(self) -> dict[str, Any]:
        return {k: (round(v, 9) if isinstance(v, float) else v) for k, v in asdict(self).items()}


def _sets(acts: list[Activity], window: tuple[float, float]):
    lo, hi = window
    comm = clip(union((a.start, a.end) for a in acts if a.comm), lo, hi)
    compute = clip(union((a.start, a.end) for a in acts if a.compute), lo, hi)
    busy = clip(union((a.start, a.end) for a in acts), lo, hi)
    return comm, compute, busy


def alone_medians(groups: list[list[Activity]]) -> dict[str, float]:
    """Median duration per compute kernel name when no communication of its group (a step's
    window) ran beside it."""
    alone: dict[str, list[float]] = {}
    for acts in groups:
        cover = Cover(union((a.start, a.end) for a in acts if a.comm))
        for a in acts:
            if a.compute and not cover.overlaps(a.start, a.end):
                alone.setdefault(a.name, []).append(a.end - a.start)
    return {name: statistics.median(d) for name, d in alone.items()}


def step_figures(step: Step, acts: list[Activity], medians: dict[str, float]) -> StepFigures:
    """SPEC 8's figures of one step from the activities in its window ([Note: the measured
    step split])."""
    lo, hi = step.window
    comm, compute, busy = _sets(acts, step.window)
    exposed = minus(comm, compute)
    pending = clip(union((a.launch, a.start) for a in acts
                         if a.compute and a.launch is not None), lo, hi)
    queued = clip(union((a.launch, a.start) for a in acts if a.launch is not None), lo, hi)
    own = [a for a in acts if a.step == step.index]
    backward = [a for a in own if a.phase == "backward"]
    bw_compute_end = max((a.end for a in backward if a.compute), default=None)
    if bw_compute_end is not None:
        b0 = max(lo, min(a.start for a in backward))
        bf = min(hi, bw_compute_end)
        cf = min(hi, max((a.end for a in own if a.comm and a.phase != "optimizer"), default=bf))
        tail = max(0.0, cf - bf)
    else:  # no backward (an evaluation loop): all before the optimizer is forward
        b0 = bf = min((a.start for a in own if a.phase == "optimizer"), default=hi)
        b0 = bf = max(lo, min(hi, b0))
        tail = 0.0
    after = min(hi, bf + tail)
    idle = minus(minus([(lo, hi)], busy), [(bf, after)])
    return StepFigures(
        step=step.number, step_s=(hi - lo) * US,
        forward_s=length(clip(busy, lo, b0)) * US,
        backward_s=length(clip(busy, b0, bf)) * US,
        optimizer_s=length(clip(busy, after, hi)) * US,
        idle_s=length(idle) * US, host_wait_s=length(minus(idle, queued)) * US,
        comm_s=length(comm) * US, hidden_comm_s=length(intersect(comm, compute)) * US,
        exposed_comm_s=length(exposed) * US,
        exposed_delaying_compute_s=length(intersect(exposed, pending)) * US,
        comm_tail_s=tail * US, overlap_slowdown_s=overlap_slowdown(acts, medians) * US)


def overlap_slowdown(acts: list[Activity], medians: dict[str, float]) -> float:
    """Microseconds compute kernels lost beside communication: per name, (median beside -
    ``medians[name]``) x the count beside, clipped at 0 ([Note: the measured step split])."""
    cover = Cover(union((a.start, a.end) for a in acts if a.comm))
    beside: dict[str, list[float]] = {}
    for a in acts:
        if a.compute and a.name in medians and cover.overlaps(a.start, a.end):
            beside.setdefault(a.name, []).append(a.end - a.start)
    return sum(max(0.0, (statistics.median(d) - medians[name]) * len(d))
               for name, d in beside.items())


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) by linear interpolation between closest ranks (numpy's
    default), 0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def rank_steps(timeline: Timeline) -> tuple[list[StepFigures], dict[int, list[Activity]]]:
    """The figures of every stable step and the activities of each step's window.

    Windows tile the device's time in order (trace_steps.py), so each activity is placed in
    the windows it overlaps by two bisections over their starts: linear in the activities
    plus their overlaps, however long one of them runs."""
    windows = [s.window for s in timeline.stable]
    starts = [w[0] for w in windows]
    groups: list[list[Activity]] = [[] for _ in windows]
    for a in sorted(timeline.activities, key=lambda a: a.start):
        i = max(0, bisect.bisect_right(starts, a.start) - 1)
        while i < len(windows) and windows[i][0] < a.end:
            if a.end > windows[i][0] and a.start < windows[i][1]:
                groups[i].append(a)
            i += 1
    by_step = {s.number: g for s, g in zip(timeline.stable, groups)}
    medians = alone_medians(list(by_step.values()))
    return [step_figures(s, by_step[s.number], medians) for s in timeline.stable], by_step
