"""Memory over one step of a plan, by what holds it, on the step-time model's clock; and a
measured step's curve lined up with it.

[Note: the time axis of memory]
The memory model walks module boundaries (the analysed step's events, memory.py
``memory_timeline``); the clock simulates units on two streams (cost.py). An event is placed in
time by the FLOPs the analysed step had run by then: forward events spread over the simulated
forward (from 0 to the end of the last forward compute), backward events over the simulated
backward (to the end of the last backward compute), so a rise in memory lines up with the
compute that causes it in the timeline below it; the optimizer step runs after the
communication tail, and the step ends with what stays resident. Facts without FLOPs fall back
to the events' order. The picture's highest point is the model's predicted peak exactly:
``memory_timeline`` visits the same points as ``estimate_peak``.

A measured step (recording.py) reports memory at module boundaries; each boundary is placed
at the time of the predicted event of the same kind, module and occurrence, so the two curves
share an axis (boundaries the analysis does not have, such as recomputation's forward hooks,
are left out).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fsdp_plan.cost.ddp_buckets import ddp_memory_timeline
from fsdp_plan.cost.memory import MemoryTimeline, memory_timeline
from fsdp_plan.cost.memory_categories import MEMORY_CATEGORIES
from fsdp_plan.cost.step_time import StepTime

if TYPE_CHECKING:
    from fsdp_plan.api import Prediction
    from fsdp_plan.facts.types import ModelFacts
    from fsdp_plan.measure.recording import MemoryRecord
    from fsdp_plan.plan.document import Plan

CATEGORIES: dict[str, str] = {c.key: c.label for c in MEMORY_CATEGORIES}
"""The memory model's breakdown keys, in stacking order (resident state at the bottom), and
how a picture names them (cost/memory_categories.py)."""


@dataclass(kw_only=True)
class StepSeries:
    """Memory per rank at every point of one step: ``parts[key][i]`` bytes held by ``key``
    (``CATEGORIES``) at ``times_s[i]``."""

    times_s: list[float]
    parts: dict[str, list[int]]
    labels: list[str]
    """Where each point is (``forward: pre_fw layers.3``)."""
    keys: list[tuple[str, str, int] | None]
    """(kind, module, occurrence) of each point's event, for lining up a measured step."""
    forward_end_s: float
    backward_end_s: float
    step_s: float
    totals: list[int] = field(default_factory=list)
    event_times: dict[tuple[str, str, int], float] = field(default_factory=dict)
    """Seconds into the step of every analysed boundary, by (kind, module, occurrence)."""

    def __post_init__(self) -> None:
        if not self.totals:
            self.totals = [sum(p[i] for p in self.parts.values())
                           for i in range(len(self.times_s))]

    @property
    def peak_bytes(self) -> int:
        return max(self.totals, default=0)

    @property
    def peak_index(self) -> int:
        return max(range(len(self.totals)), key=self.totals.__getitem__) if self.totals else 0


def plan_timeline(plan: Plan, facts: ModelFacts, prediction: Prediction) -> MemoryTimeline:
    """The memory model's timeline of ``plan`` as predicted (``api.predict``): FSDP2 units,
    with CPU offload when the plan offloads, or DDP's model for a DDP plan."""
    candidate = prediction.candidate
    if plan.strategy == "ddp":
        config = candidate.layout.ddp
        assert config is not None, "a DDP plan's layout carries its bucket configuration"
        # below float32 a DDP plan computes under autocast: the pass the search evaluated it on
        return ddp_memory_timeline(facts.graph, facts.analysis.for_ddp(),
                                   plan.mixed_precision.precision, plan.optimizer,
                                   config, sync_last=plan.grad_accum_steps > 1
                                   and plan.gradient_sync == "last",
                                   optimizer_overlap=plan.optimizer_overlap)
    evaluator = prediction.evaluator
    if evaluator is None:
        raise ValueError("a prediction without its evaluator has no memory timeline")
    ctx = evaluator.step_context(candidate.shard, offload=candidate.layout.offload,
                                 optimizer_overlap=candidate.layout.optimizer_overlap)
    return memory_timeline(evaluator.profile_of(candidate), candidate.units, ctx,
                           forward_prefetch=candidate.forward_prefetch,
                           backward_prefetch=candidate.backward_prefetch)


def _clock_marks(time: StepTime) -> tuple[float, float, float, float]:
    """(end of forward compute, end of backward compute, start of the optimizer, step end)."""
    compute = [(label, e) for lane, label, _, e in time.spans if lane == "compute"]
    forward = max((e for label, e in compute if label.startswith("FW")), default=0.0)
    backward = max((e for label, e in compute if label.startswith("BW")), default=forward)
    optimizer = [(s, e) for lane, label, s, e in time.spans
                 if lane == "compute" and label.startswith("optimizer")]
    start = optimizer[0][0] if optimizer else backward + time.comm_tail_s
    end = max([e for *_, e in time.spans] + [start + time.optimizer_s])
    return forward, backward, start, end


def event_times(timeline: MemoryTimeline, time: StepTime) -> list[float]:
    """Seconds into the step of every event ([Note: the time axis of memory])."""
    events = timeline.events
    n = len(events)
    forward_s, backward_s, _, _ = _clock_marks(time)
    if not n:
        return []
    split = min(timeline.forward_end + 1, n)
    fw_flops = events[split - 1].flops if split else 0.0
    total = events[-1].flops
    out = []
    for i, e in enumerate(events):
        if i < split:
            share = e.flops / fw_flops if fw_flops > 0 else i / max(1, split - 1)
            out.append(forward_s * min(1.0, max(0.0, share)))
        else:
            span = total - fw_flops
            share = ((e.flops - fw_flops) / span if span > 0
                     else (i - split + 1) / max(1, n - split))
            out.append(forward_s + (backward_s - forward_s) * min(1.0, max(0.0, share)))
    return out


def step_series(timeline: MemoryTimeline, time: StepTime) -> StepSeries:
    """Every point of the timeline with what holds memory there, in seconds into the step;
    then the optimizer step and the resident state at the step's end."""
    at = event_times(timeline, time)
    _, backward_s, optimizer_s, end_s = _clock_marks(time)
    occurrence: dict[tuple[str, str], int] = {}
    event_keys = []
    for e in timeline.events:
        k = (e.kind, e.module)
        occurrence[k] = occurrence.get(k, 0) + 1
        event_keys.append((e.kind, e.module, occurrence[k]))
    rows: list[dict[str, int]] = []
    times, labels, keys = [], [], []
    for i, point in enumerate(timeline.points):
        event = point >> 2
        rows.append(timeline.parts(i))
        times.append(at[event])
        ev = timeline.events[event]
        phase = "forward" if event <= timeline.forward_end else "backward"
        labels.append(f"{phase}: {ev.kind} {ev.module or '<root>'}")
        keys.append(event_keys[event])
    for point, held in timeline.steps_in_backward:  # [Note: optimizer overlap in memory]
        ev = timeline.events[point >> 2]
        rows.append(dict(held))
        times.append(at[point >> 2])
        labels.append(f"optimizer step in backward: {ev.kind} {ev.module or '<root>'}")
        keys.append(None)
    resident = dict(timeline.static)
    if timeline.optimizer_step is not None:
        for t in (optimizer_s, end_s):
            rows.append(dict(timeline.optimizer_step))
            times.append(max(t, backward_s))
            labels.append("optimizer step")
            keys.append(None)
    rows.append(resident)
    times.append(end_s)
    labels.append("step end (resident)")
    keys.append(None)
    names = [k for k in CATEGORIES if any(k in r for r in rows)]
    names += sorted({k for r in rows for k in r} - set(names))
    parts = {k: [int(r.get(k, 0)) for r in rows] for k in names}
    return StepSeries(times_s=times, parts=parts, labels=labels, keys=keys,
                      forward_end_s=at[timeline.forward_end] if at else 0.0,
                      backward_end_s=backward_s, step_s=end_s,
                      event_times=dict(zip(event_keys, at)))


def measured_curve(record: MemoryRecord, series: StepSeries) -> tuple[list[float], list[int]]:
    """The measured step's highest memory between boundaries, at the predicted times of the
    same boundaries ([Note: the time axis of memory]); the optimizer and the step's end at
    the predicted optimizer step and end."""
    where: dict[tuple[str, str, int], float] = {}
    for key, t in zip(series.keys, series.times_s):
        if key is not None:
            where.setdefault(key, t)
    where.update({k: t for k, t in series.event_times.items() if k not in where})
    optimizer_at = next((t for t, label in zip(series.times_s, series.labels)
                         if label == "optimizer step"), series.backward_end_s)
    seen: dict[tuple[str, str], int] = {}
    xs, ys = [], []
    for b in record.boundaries:
        if b.kind == "optimizer":
            t = optimizer_at
        elif b.kind == "end":
            t = series.step_s
        else:
            seen[(b.kind, b.module)] = seen.get((b.kind, b.module), 0) + 1
            t = where.get((b.kind, b.module, seen[(b.kind, b.module)]))
            if t is None:
                continue
        xs.append(t)
        ys.append(int(b.peak))
    return xs, ys

