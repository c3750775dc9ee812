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
Without a plan, FLOP rates are kept: a trace says how long kernels ran, not how much work
they did. With ``--plan`` the plan's prediction says how much work there was
([Note: compute refit from a trace]).

[Note: compute refit from a trace]
The clock's step is ``compute_s + exposed + optimizer`` (cost/step_time.py [Note: two-stream
simulation]), its ``compute_s`` holding the host's time (per-op overheads, host waits). The
trace's analogue of each rank's median stable step (trace_figures.py [Note: the measured
step split]) is ``step_s - exposed_comm_s - optimizer_s``: what is not communication on the
critical path nor the optimizer, the host's idle time between ops included. The median over
ranks of it, over the plan's ``predicted.compute_s``, is the compute factor; the median
``optimizer_s`` over ``predicted.phases_s.optimizer`` the optimizer factor. The start's
compute rates are divided by the first and its per-op and per-unit overheads multiplied
(bench/refit.py ``scaled``, communication left alone), its optimizer seconds multiplied by
the second (a start with no seconds per parameter for the plan's optimizer, which times it by
bytes at the memory bandwidth, gets the measured ``optimizer_s`` over the rank's shard). The
clock's compute is not proportional to the rates alone (the launch overhead and FSDP's copies
stay, the host floor takes a maximum), so once the collectives are fitted the plan is
predicted on the file and its compute rescaled by measured over predicted, until they agree
within 1% (a few rounds; the measured launch gap of a GPU trace is kept): the step model's compute is sums and maxima of these, so the same plan predicted
on the file computes for as long as the trace measured. The collective fits and (GPU) the
launch gap then replace what they measure. A plan's prediction was made on the start (the
plan's hardware), so the factors are of the figures being scaled. Noisy collectives on a
loaded CPU (gloo's time includes the wait for a late peer) cannot move the compute side.
Factors are bounded to 1e-6..1e6 (a stored prediction is rounded to microseconds); a plan
without ``compute_s`` / ``phases_s`` keeps the start's rates.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
from typing import Any

from fsdp_plan.api import facts_for_plan, plan_hardware, predict
from fsdp_plan.bench.refit import check_refit_path, scaled
from fsdp_plan.common.errors import BadInput
from fsdp_plan.cost.hardware import GPUS, Hardware, hardware_for, hardware_yaml
from fsdp_plan.facts.cache import FactsCache
from fsdp_plan.measure.trace_figures import US
from fsdp_plan.measure.trace_ranks import TraceAnalysis, median_of
from fsdp_plan.plan.document import read_plan

_FITTED_KINDS = ("all_gather", "reduce_scatter", "all_reduce")
_BANDWIDTH = (1e6, 1e15)
_LATENCY = (1e-9, 10.0)
_FACTOR = (1e-6, 1e6)
_ROUNDS = 4


def _start(analysis: TraceAnalysis, plan_path: str | None) -> Hardware:
    if plan_path is not None:
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
        gaps += [b - a for a, b in itertools.pairwise(launches) if b > a]
    return statistics.median(gaps) * US if gaps else None


def measured_compute_s(analysis: TraceAnalysis) -> float:
    """The median over ranks of their median step's ``step_s - exposed_comm_s - optimizer_s``
    ([Note: compute refit from a trace])."""
    return statistics.median(max(0.0, m.step_s - m.exposed_comm_s - m.optimizer_s)
                     for m in (r.median() for r in analysis.ranks))


def compute_factors(analysis: TraceAnalysis, predicted: dict[str, Any]) -> dict[str, float]:
    """The compute and optimizer factors of [Note: compute refit from a trace] (those the
    plan's prediction gives no figure for are left out)."""
    def ratio(measured: float, planned: Any) -> float | None:
        if not isinstance(planned, (int, float)) or planned <= 0 or measured <= 0:
            return None
        return min(_FACTOR[1], max(_FACTOR[0], measured / planned))
    found = {"compute": ratio(measured_compute_s(analysis), predicted.get("compute_s")),
             "optimizer": ratio(median_of(analysis.ranks, "optimizer_s"),
                                (predicted.get("phases_s") or {}).get("optimizer"))}
    return {k: v for k, v in found.items() if v is not None}


def _optimizer_per_param(analysis: TraceAnalysis, plan: Any, hw: Hardware) -> float | None:
    """Seconds per parameter of the plan's optimizer, the measured ``optimizer_s`` over this
    rank's shard (the plan's units' ``shard_numel``), where ``hw`` has no figure for it to
    scale ([Note: compute refit from a trace]): without one the clock times the step by its
    bytes at the memory bandwidth, which a factor on the optimizer cannot reach."""
    known = hw.optimizer_s_per_param
    if plan.optimizer in ("none", None) or plan.optimizer in known or (
            plan.optimizer == "adam" and "adamw" in known):
        return None
    numel = sum(int(u.get("shard_numel") or 0) for u in (plan.predicted or {}).get("units") or [])
    seconds = median_of(analysis.ranks, "optimizer_s")
    return seconds / numel if numel > 0 and seconds > 0 else None


def _matched_compute(hw: Hardware, plan: Any, plan_path: str, target_s: float,
                     keep_op_overhead: bool, facts_cache: FactsCache | None = None
                     ) -> tuple[Hardware, int]:
    """``hw`` with its compute rescaled until the plan predicted on it computes for
    ``target_s`` (within 1%, at most ``_ROUNDS`` predictions; [Note: compute refit from a
    trace]); the rounds run, 0 when the plan's model cannot be loaded. The model's facts come
    from ``facts_cache`` where kept (``facts_for_plan``: no model built then)."""
    try:
        facts = facts_for_plan(plan, plan_path=plan_path, facts_cache=facts_cache)
    except BadInput:
        return hw, 0
    rounds = 0
    for rounds in range(1, _ROUNDS + 1):
        got = predict(plan, facts, hardware=hw).predicted["compute_s"]
        if got <= 0 or abs(got / target_s - 1) < 0.01:
            break
        factor = min(_FACTOR[1], max(_FACTOR[0], target_s / got))
        new = scaled(hw, {"compute": factor, "communication": 1.0, "optimizer": 1.0})
        hw = dataclasses.replace(new, op_overhead_s=hw.op_overhead_s) if keep_op_overhead \
            else new
    return hw, rounds


def refitted(analysis: TraceAnalysis, plan_path: str | None,
             facts_cache: FactsCache | None = None) -> tuple[Hardware, list[str]]:
    """The start's hardware with the figures the traces measure, and what was replaced
    (``facts_cache``: where the plan's model facts are kept, ``_matched_compute``)."""
    hw = _start(analysis, plan_path)
    changed = []
    factors: dict[str, float] = {}
    if plan_path is not None:
        plan = read_plan(plan_path)
        factors = compute_factors(analysis, plan.predicted or {})
        if factors:
            hw = scaled(hw, {"compute": factors.get("compute", 1.0), "communication": 1.0,
                             "optimizer": factors.get("optimizer", 1.0)})
            changed += [f"{k} x{v:.4g} (measured over the plan's predicted)"
                        for k, v in factors.items()]
        per_param = _optimizer_per_param(analysis, plan, hw)
        if per_param is not None:
            hw = dataclasses.replace(hw, optimizer_s_per_param={
                **hw.optimizer_s_per_param, plan.optimizer: per_param})
            changed.append(f"optimizer_s_per_param[{plan.optimizer}] {per_param:.3g} s "
                           "(the measured optimizer over this rank's shard)")
    collectives: dict[str, dict[str, dict[str, float]]] = {
        k: {g: dict(f) for g, f in groups.items()} for k, groups in hw.collectives.items()}
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
    if plan_path is not None and "compute" in factors:
        hw, rounds = _matched_compute(dataclasses.replace(hw, **updates), plan, plan_path,
                                      measured_compute_s(analysis), "op_overhead_s" in updates,
                                      facts_cache)
        updates = {}
        changed.append(f"compute rescaled in {rounds} round(s) of predicting the plan"
                       if rounds else "compute not rescaled (the plan's model did not load)")
    paths = ", ".join(r.path for r in analysis.ranks)
    source = (f"{hw.source or hw.name}; refit by fsdp-plan trace from {paths}: "
              + ("; ".join(changed) or "nothing measured"))
    return dataclasses.replace(hw, **updates, source=source[:2000]), changed


def refit_text(analysis: TraceAnalysis, plan_path: str | None, path: str,
               facts_cache: FactsCache | None = None) -> str:
    """The hardware file ``--refit path`` writes ([Note: refit from a trace])."""
    check_refit_path(path)
    hw, _ = refitted(analysis, plan_path, facts_cache)
    return hardware_yaml(hw, "Hardware file refitted from profiler traces by fsdp-plan trace "
                             "--refit (SPEC section 8).")
