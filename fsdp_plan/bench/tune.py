"""The tuning loop: measure the plan, change one knob at a time, keep what beats the noise.

[Note: the tuning loop]
Users tune by rerunning. ``fsdp-plan tune PLAN.yaml`` starts from the plan as the baseline
(refused, exit 3, when it does not fit its own budget) and benches it (warm-up excluded, several steady steps; the median over steps of the slowest
rank is the step time, and the baseline's own spread is the noise). Each round proposes the
plan's neighbours, each one knob away (forward and backward prefetch depth, the unit
layout, how many blocks are checkpointed, whether the last block reshards) and accepted by
the plan format, predicts them
with the planner's models (``api.predict``), drops those that do not fit the budget, and
benches the ``max_per_round`` predicted fastest with the same seed and data on one set of
workers. The best so far is benched again in the same launch, first and last, so the
proposals are compared with a reference taken on the same workers around them: a machine
that slows down or speeds up between launches (another job starting, a clock ramping) then
moves both sides of the comparison alike, and linear drift within the launch cancels in the
mean of the two reference runs. The fastest is kept only when it beats that reference by
more than the noise;
the loop stops when a round keeps nothing, after ``max_rounds``, or when the time budget
is spent. The best plan and the baseline (the rollback) are written with every measurement.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from fsdp_plan.api import predict as predict_plan
from fsdp_plan.common.errors import BadInput, NoFeasiblePlan
from fsdp_plan.common.sizes import format_bytes
from fsdp_plan.facts.types import ModelFacts
from fsdp_plan.plan.prefetch import prefetch_depths, prefetch_maps
from fsdp_plan.plan.document import Plan, Unit

NOISE_FLOOR = 0.02
"""Never trust a gain below 2% of step time, however quiet the baseline looked."""


def p50_of(step_times_s: list[list[float]]) -> float:
    """The slowest rank's median step: ranks wait for each other at every collective."""
    medians = [statistics.median(times) for times in step_times_s if times]
    return max(medians) if medians else float("inf")


@dataclass(kw_only=True)
class Trial:
    """One benched plan: which knob changed from the best so far, predicted and measured."""

    knob: str
    change: str
    plan: Plan
    predicted_step_s: float | None = None
    step_times_s: list[list[float]] = field(default_factory=list)
    """Per rank, the steady steps' seconds."""
    kept: bool = False
    reference_p50_s: float | None = None
    """The best so far, re-measured in the same launch (mean of the runs before and after)."""

    @property
    def rank_medians(self) -> list[float]:
        return [statistics.median(times) for times in self.step_times_s if times]

    @property
    def p50_s(self) -> float:
        return p50_of(self.step_times_s)

    @property
    def p99_s(self) -> float:
        every = sorted(t for times in self.step_times_s for t in times)
        return every[min(len(every) - 1, int(0.99 * len(every)))] if every else float("inf")

    @property
    def slowest_rank(self) -> int:
        medians = self.rank_medians
        return medians.index(max(medians)) if medians else -1

    def row(self) -> dict[str, Any]:
        return {"knob": self.knob, "change": self.change, "predicted_step_s": self.predicted_step_s,
                "p50_step_s": self.p50_s, "p99_step_s": self.p99_s,
                "slowest_rank": self.slowest_rank, "kept": self.kept,
                "reference_p50_s": self.reference_p50_s}


def noise_of(trial: Trial) -> float:
    """Relative spread of the baseline's steps (inter-quartile range over the median of the
    slowest rank), at least ``NOISE_FLOOR``."""
    return relative_spread(trial.step_times_s[trial.slowest_rank] if trial.step_times_s else [])


def relative_spread(times: list[float]) -> float:
    """The inter-quartile range of one rank's step times over their median, at least
    ``NOISE_FLOOR`` (10% when fewer than 4 steps give no quartiles): how much a median of
    such steps can move between runs of the same plan (``tune`` and ``bench --compare``)."""
    if len(times) < 4:
        return max(NOISE_FLOOR, 0.1)
    q = statistics.quantiles(times, n=4)
    median = statistics.median(times)
    if not median > 0:  # no time measured (a hand-made result): nothing says how far it moves
        return max(NOISE_FLOOR, 0.1)
    return max(NOISE_FLOOR, (q[2] - q[0]) / median)


def _layout(plan: Plan) -> tuple[list[list[str]], list[bool]]:
    units = [u for u in plan.units if u.modules != [""]]
    return [list(u.modules) for u in units], [u.reshard_after_forward for u in units]


def _with_units(plan: Plan, groups: list[list[str]], reshard: list[bool]) -> Plan:
    root = next(u for u in plan.units if u.modules == [""])
    units = [Unit(modules=g, reshard_after_forward=r) for g, r in zip(groups, reshard)]
    keys = [g[0] for g in groups]
    fwd, bwd = prefetch_depths(plan)
    forward, backward = prefetch_maps(keys, fwd, bwd)
    return dataclasses.replace(plan, units=[*units, root], forward_prefetch=forward,
                               backward_prefetch=backward, predicted={})


def _resharding(plan: Plan, count: int, last: bool = True) -> list[bool]:
    """``reshard_after_forward`` for ``count`` new units: grad-op keeps every unit gathered
    (the plan format refuses a resharding unit under it); otherwise every unit reshards,
    the last one only when ``last``."""
    if plan.strategy == "grad-op":
        return [False] * count
    return [True] * (count - 1) + [last] if count else []


def _is_valid(plan: Plan) -> bool:
    """Whether the plan file format accepts ``plan`` (``plan.check``): a neighbour the
    format forbids is never proposed (issue 21, S3-14)."""
    try:
        Plan.from_dict(plan.to_dict())
    except BadInput:
        return False
    return True


def _checkpointing_neighbours(plan: Plan, blocks: list[str]) -> list[tuple[str, str, Plan]]:
    """One block fewer, none, one block more. Each block keeps its mode (``full`` or
    ``selective``) and the label counts what the plan then checkpoints (issue 21, S3-14:
    "80 -> 79 blocks" used to turn every selective block into full)."""
    written = plan.activation_checkpointing
    modes = dict(written) if isinstance(written, dict) else {name: "full" for name in written}
    names = list(modes)

    def checkpointing(chosen: dict[str, str]) -> Plan:
        if isinstance(written, dict) and chosen:
            value: list[str] | dict[str, str] = chosen
        else:  # no selective block: the list form, which every plan version reads
            value = list(chosen)
        return dataclasses.replace(plan, activation_checkpointing=value, predicted={})
    out = []
    if names:
        out.append(("checkpointing", f"{len(names)} -> {len(names) - 1} blocks",
                    checkpointing(dict(list(modes.items())[:-1]))))
        if len(names) > 1:
            out.append(("checkpointing", f"{len(names)} -> 0 blocks", checkpointing({})))
    free = [b for b in blocks if b not in modes and not any(
        n.startswith(b + ".") or b.startswith(n + ".") for n in names)]
    if free:
        mode = modes[names[-1]] if names and isinstance(written, dict) else "full"
        label = f"{len(names)} -> {len(names) + 1} blocks"
        if isinstance(written, dict):
            label += f" ({free[0]} {mode})"
        out.append(("checkpointing", label, checkpointing({**modes, free[0]: mode})))
    return out


def neighbours(plan: Plan, facts: ModelFacts) -> list[tuple[str, str, Plan]]:
    """Plans one knob away from ``plan``: ``(knob, change, plan)``; only plans the plan format
    accepts, each labelled with what it changes."""
    out: list[tuple[str, str, Plan]] = []
    blocks = facts.graph.blocks
    groups, reshard = _layout(plan)
    keys = [g[0] for g in groups]
    # A DDP plan has one unit, the root, and no prefetch: only its checkpointing has
    # neighbours. Units with their own mixed precision cannot be regrouped without changing
    # what they compute in.
    regroup = plan.strategy != "ddp" and not any(u.mixed_precision for u in plan.units)
    fwd, bwd = prefetch_depths(plan)

    def prefetch(f: int, b: int) -> Plan:
        forward, backward = prefetch_maps(keys, f, b)
        return dataclasses.replace(plan, forward_prefetch=forward, backward_prefetch=backward,
                                   predicted={})
    if keys:
        out.append(("forward prefetch", f"depth {fwd} -> {1 - min(fwd, 1)}",
                    prefetch(1 - min(fwd, 1), bwd)))
        out.append(("backward prefetch", f"depth {bwd} -> {2 if bwd == 1 else 1}",
                    prefetch(fwd, 2 if bwd == 1 else 1)))
    if regroup and blocks and not groups:
        per_block = [[b] for b in blocks]
        out.append(("unit layout", "root only -> one unit per block",
                    _with_units(plan, per_block, _resharding(plan, len(blocks), last=False))))
    elif regroup and groups:
        out.append(("unit layout", f"{len(groups)} units -> root only",
                    _with_units(plan, [], [])))
        if all(len(g) == 1 for g in groups) and len(groups) >= 4 and groups[0][0] in blocks:
            pairs = [[m for g in groups[i:i + 2] for m in g] for i in range(0, len(groups), 2)]
            out.append(("unit layout", "one unit per block -> two blocks per unit",
                        _with_units(plan, pairs, _resharding(plan, len(pairs)))))
    if groups and reshard[-1] and plan.strategy != "grad-op":
        last = len(groups) - 1  # the last unit before the root; its other settings kept
        units = [dataclasses.replace(u, reshard_after_forward=False) if i == last else u
                 for i, u in enumerate(plan.units)]
        out.append(("reshard", f"keep {keys[-1]} unsharded after forward",
                    dataclasses.replace(plan, units=units, predicted={})))
    out += _checkpointing_neighbours(plan, blocks)
    return [(knob, change, p) for knob, change, p in out if _is_valid(p)]


@dataclass(kw_only=True)
class TuneResult:
    baseline: Trial
    best: Trial
    trials: list[Trial]
    noise: float
    rounds: int
    stopped: str

    @property
    def gain(self) -> float:
        """How much faster the best plan is than the baseline, chained from each kept
        change's same-launch comparison (free of drift between launches)."""
        ratio = 1.0
        for t in self.trials:
            if t.kept and t.reference_p50_s:
                ratio *= t.p50_s / t.reference_p50_s
        return 1 - ratio


def tune(plan: Plan, facts: ModelFacts, bench, *, budget_s: float, max_rounds: int = 4,
         max_per_round: int = 4, hardware=None, progress=None) -> TuneResult:
    """Run [Note: the tuning loop]. ``bench(plans) -> list of per-rank step-time lists`` runs
    plans on real workers (one launch per call); ``hardware`` (a calibrated file's figures)
    orders the proposals."""
    def predict(candidate: Plan):
        return predict_plan(candidate, facts, hardware=hardware)
    started = time.perf_counter()
    baseline = Trial(knob="baseline", change="the plan as given", plan=plan)
    prediction = predict(plan)
    if not prediction.fits:  # never measured, never reported as best (issue 21, S3-30)
        peak = prediction.predicted["peak_bytes"]
        raise NoFeasiblePlan(
            f"the plan to tune peaks at {format_bytes(peak)} per rank, above its limit "
            f"{format_bytes(prediction.limit_bytes)} (budget_bytes - headroom_bytes); tune "
            "starts from a plan that fits and keeps only plans that fit. Run fsdp-plan on the "
            "model for one that fits, or raise budget_bytes if the GPUs hold more; nothing was "
            "measured.", smallest_peak_bytes=peak)
    baseline.predicted_step_s = prediction.predicted["step_time_s"]
    baseline.step_times_s = bench([plan])[0]
    baseline.kept = True
    noise = noise_of(baseline)
    best, trials = baseline, [baseline]
    if progress:
        progress(f"baseline: {best.p50_s:.4g} s per step (noise {noise:.1%})")
    stopped = "no neighbour beat the best by more than the noise"
    rounds = 0
    for rounds in range(1, max_rounds + 1):
        if time.perf_counter() - started > budget_s:
            stopped = "the time budget is spent"
            break
        proposals = []
        for knob, change, candidate in neighbours(best.plan, facts):
            try:
                prediction = predict(candidate)
            except BadInput:
                continue
            if prediction.fits:
                proposals.append(Trial(knob=knob, change=change, plan=candidate,
                                       predicted_step_s=prediction.predicted["step_time_s"]))
        seen = {_fingerprint(t.plan) for t in trials}
        proposals = [p for p in proposals if _fingerprint(p.plan) not in seen]
        proposals.sort(key=lambda t: t.predicted_step_s)
        proposals = proposals[:max_per_round]
        if not proposals:
            stopped = "no untried neighbour fits the budget"
            break
        measured = bench([best.plan, *(p.plan for p in proposals), best.plan])
        reference = (p50_of(measured[0]) + p50_of(measured[-1])) / 2
        for trial, times in zip(proposals, measured[1:-1]):
            trial.step_times_s = times
            trial.reference_p50_s = reference
        trials += proposals
        winner = min(proposals, key=lambda t: t.p50_s)
        if progress:
            progress(f"round {rounds}: best neighbour {winner.knob} ({winner.change}) "
                     f"{winner.p50_s:.4g} s vs {reference:.4g} s for the best so far")
        if winner.p50_s < reference * (1 - noise):
            winner.kept = True
            best = winner
        else:
            stopped = "no neighbour beat the best by more than the noise"
            break
    return TuneResult(baseline=baseline, best=best, trials=trials, noise=noise, rounds=rounds,
                      stopped=stopped)


def _fingerprint(plan: Plan) -> str:
    d = plan.to_dict()
    d.pop("predicted", None)
    return repr(d)
