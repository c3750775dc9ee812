"""``fsdp-plan trace --refit HW.yaml``: a hardware file fitted from a run's traces, which
``--hardware`` reads (the same file format and bounds as bench's ``--refit``, bench/refit.py).

[Note: refit from a trace]
Start from the plan's hardware (``--plan``), else the preset the trace's device names (h100,
a100, h200, b200; h100 otherwise), and replace what the trace measures:
- per collective kind and group size, ``latency_s`` and ``bus_bandwidth`` of
  ``latency + factor * (g - 1) / g * bytes / bus_bandwidth`` (cost/step_time.py
  ``collective_time``; factor 2 for all-reduce) by least squares over the stable steps'
  collective kernels of known size. Each size contributes its shortest duration over ranks
  and steps: a longer one includes the wait for a late peer ([Note: stragglers] in
  measure/trace_ranks.py), which is not the network's. One size alone fixes the bandwidth
  with the start's latency;
- ``op_overhead_s``, the host's cost per op: the median gap between consecutive launches of
  one host thread inside the stable steps (GPU traces).
FLOP rates are kept: a trace says how long kernels ran, not how much work they did.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from fsdp_plan.bench.refit import check_refit_path
from fsdp_plan.cost.hardware import GPUS, Hardware, hardware_for, hardware_yaml
from fsdp_plan.measure.trace_figures import US
from fsdp_plan.measure.trace_ranks import TraceAnalysis

_FITTED_KINDS = ("all_gather", "reduce_scatter", "all_reduce")
_BANDWIDTH = (1e6, 1e15)
_LATENCY = (1e-9, 10.0)


def _start(analysis: TraceAnalysis, plan_path: str | None) -> Hardware:
    if plan_path is not None:
        from fsdp_plan.api import plan_hardware
        from fsdp_plan.plan.document import read_plan
        return plan_hardware(read_plan(plan_path))
    device = analysis.ranks[0].device.lower()
    return hardware_for(next((name for name in GPUS if name in device), "h100"))


def _shortest_by_size(analysis: TraceAnalysis) -> dict[tuple[str, int], dict[int, float]]:
    """{(kind, group): {bytes: shortest seconds}} over every rank's stable steps."""
    out: dict[tuple[str, int], dict[int, float]] = {}
    for rank in analysis.ranks:
        stable = {s.index for s in rank.timeline.stable}
        for a in rank.timeline.activities:
            if a.comm and a.kind in _FITTED_KINDS and a.nbytes and a.step in stable:
                sizes = out.setdefault((a.kind, rank.world_size), {})
                sizes[a.nbytes] = min(sizes.get(a.nbytes, float("inf")), (a.end - a.start) * US)
    return out


def fit_collective(kind: str, group: int, shortest: dict[int, float], latency_s: float
                   ) -> dict[str, float] | None:
    """{latency_s, bus_bandwidth} fitted to {bytes: seconds} ([Note: refit from a trace])."""
    factor = (2.0 if kind == "all_reduce" else 1.0) * (group - 1) / group if group > 1 else 1.0
    points = [(factor * b, t) for b, t in shortest.items() if t > 0]
    if not points:
        return None
    if len(points) > 1:
        mx = statistics.fmean(x for x, _ in points)
        my = statistics.fmean(t for _, t in points)
        sxx = sum((x - mx) ** 2 for x, _ in points)
        slope = sum((x - mx) * (t - my) for x, t in points) / sxx if sxx > 0 else 0.0
        if slope > 0:
            latency = min(max(my - slope * mx, _LATENCY[0]), _LATENCY[1])
            bandwidth = min(max(1.0 / slope, _BANDWIDTH[0]), _BANDWIDTH[1])
            return {"latency_s": latency, "bus_bandwidth": bandwidth}
    x, t = max(points)
    if t <= latency_s:
        return None
    return {"latency_s": latency_s,
            "bus_bandwidth": min(max(x / (t - latency_s), _BANDWIDTH[0]), _BANDWIDTH[1])}


def launch_gap_s(analysis: TraceAnalysis) -> float | None:
    """The median gap between consecutive launches of one host thread in stable steps."""
    gaps: list[float] = []
    for rank in analysis.ranks:
        if rank.source != "gpu":
            continue
        stable = {s.index for s in rank.timeline.stable}
        launches = sorted(a.launch for a in rank.timeline.activities
                          if a.launch is not None and a.step in stable)
        gaps += [b - a for a, b in zip(launches, launches[1:]) if b > a]
    return statistics.median(gaps) * US if gaps else None


def refitted(analysis: TraceAnalysis, plan_path: str | None) -> tuple[Hardware, list[str]]:
    """The start's hardware with the figures the traces measure, and what was replaced."""
    hw = _start(analysis, plan_path)
    collectives: dict[str, dict[str, dict[str, float]]] = {
        k: {g: dict(f) for g, f in groups.items()} for k, groups in hw.collectives.items()}
    changed = []
    for (kind, group), shortest in sorted(_shortest_by_size(analysis).items()):
        fit = fit_collective(kind, group, shortest, hw.collective_latency_s)
        if fit is not None:
            collectives.setdefault(kind, {})[str(group)] = fit
            changed.append(f"{kind} over {group} ranks: {fit['latency_s'] * 1e6:.1f} us + bytes / "
                           f"{fit['bus_bandwidth'] / 1e9:.2f} GB/s ({len(shortest)} sizes)")
    gap = launch_gap_s(analysis)
    updates: dict[str, Any] = {"collectives": collectives}
    if gap is not None and 1e-9 <= gap <= 1.0:
        updates["op_overhead_s"] = gap
        changed.append(f"op_overhead_s {gap * 1e6:.2f} us (median launch gap)")
    paths = ", ".join(r.path for r in analysis.ranks)
    source = (f"{hw.source or hw.name}; refit by fsdp-plan trace from {paths}: "
              + ("; ".join(changed) or "nothing measured"))
    return dataclasses.replace(hw, **updates, source=source[:2000]), changed


def refit_text(analysis: TraceAnalysis, plan_path: str | None, path: str) -> str:
    """The hardware file ``--refit path`` writes ([Note: refit from a trace])."""
    check_refit_path(path)
    hw, _ = refitted(analysis, plan_path)
    return hardware_yaml(hw, "Hardware file refitted from profiler traces by fsdp-plan trace "
                             "--refit (SPEC section 8).")
