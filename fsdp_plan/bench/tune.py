"""The tuning loop: measure the plan, then the stages of the tuning order, one knob family
at a time, keeping what beats the noise.

[Note: the tuning loop]
Users tune by rerunning. ``fsdp-plan tune PLAN.yaml`` starts from the plan as the baseline
(refused, exit 3, when it does not fit its own budget) and benches it (warm-up excluded,
several steady steps; the median over steps of the slowest rank is the step time, and the
baseline's own spread is the noise), with its no-overlap twin profiled in the same launch
(bench/timing.py [Note: the baseline and its held twin in one launch]) for the overlap
verdict. Then it runs the stages of bench/tune_stages.py [Note: the tuning order] once each,
in order. A stage proposes plans one knob of its family away from the best so far, accepted
by the plan format; each is predicted with the planner's models (``api.predict``), dropped
when it does not fit the budget or is a plan already measured (a DDP cap that builds the same
buckets is the same plan), and the ``max_per_round`` predicted fastest are benched with the
same seed and data on one set of workers. The best so far is benched again in the same
launch, first and last, so the proposals are compared with a reference taken on the same
workers around them: a machine that slows down or speeds up between launches (another job
starting, a clock ramping) then moves both sides of the comparison alike, and linear drift
within the launch cancels in the mean of the two reference runs. The fastest is kept only
when it beats that reference by more than the noise. A stage with nothing to propose is
recorded with its reason, as is one the time budget or ``max_rounds`` (benched stages) left
out. The best plan and the baseline (the rollback) are written with every measurement, and
every stage with its reason, its trials and its outcome.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fsdp_plan.api import predict as predict_plan
from fsdp_plan.bench.overlap import OverlapFigures, held_refusal, verdict
from fsdp_plan.bench.tune_stages import STAGES, Context, Permissions
from fsdp_plan.common.errors import BadInput, NoFeasiblePlan
from fsdp_plan.common.sizes import format_bytes
from fsdp_plan.facts.types import ModelFacts
from fsdp_plan.plan.document import Plan

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
    stage: str = "baseline"
    """The stage of [Note: the tuning order] that proposed it."""
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
        return {"stage": self.stage, "knob": self.knob, "change": self.change,
                "predicted_step_s": self.predicted_step_s,
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


@dataclass(kw_only=True)
class StageResult:
    """One stage of the tuning order as it ran: why, what it benched, what came of it."""

    name: str
    reason: str
    outcome: str
    trials: list[Trial] = field(default_factory=list)
    dropped: list[tuple[str, str, str]] = field(default_factory=list)
    """``(knob, change, why)`` of each proposal not benched (over the budget, measured
    already, beyond ``max_per_round``)."""
    reference_p50_s: float | None = None
    """The best so far, re-measured in the stage's launch."""

    def to_dict(self) -> dict[str, Any]:
        return {"stage": self.name, "reason": self.reason, "outcome": self.outcome,
                "reference_p50_s": self.reference_p50_s,
                "trials": [{k: v for k, v in t.row().items() if k != "stage"}
                           for t in self.trials],
                "dropped": [{"knob": k, "change": c, "why": w} for k, c, w in self.dropped]}


@dataclass(frozen=True, kw_only=True)
class HeldBaseline:
    """What the baseline's launch measured: the plan's steps and its overlap figures."""

    step_times_s: list[list[float]]
    figures: OverlapFigures
    how: str
    """How communication was held (measure/no_overlap.py ``hold_communication``)."""


@dataclass(kw_only=True)
class TuneResult:
    baseline: Trial
    best: Trial
    trials: list[Trial]
    noise: float
    rounds: int
    """Launches after the baseline's: one per benched stage."""
    stopped: str
    stages: list[StageResult] = field(default_factory=list)
    """The baseline, then every stage of the tuning order, in order."""
    overlap: OverlapFigures | None = None
    """The baseline's overlap figures (None: the no-overlap twin was not measured)."""
    overlap_note: str = ""
    """How communication was held, or why the twin was not measured."""

    @property
    def gain(self) -> float:
        """How much faster the best plan is than the baseline, chained from each kept
        change's same-launch comparison (free of drift between launches)."""
        ratio = 1.0
        for t in self.trials:
            if t.kept and t.reference_p50_s:
                ratio *= t.p50_s / t.reference_p50_s
        return 1 - ratio


def _same_plan_key(plan: Plan, predicted: dict[str, Any]) -> str:
    """Plans that run alike: the document without ``predicted``, a DDP plan's caps as the
    buckets they build (a cap above the model's gradients builds the same one bucket)."""
    d = plan.to_dict()
    d.pop("predicted", None)
    d.pop("fsdp_plan_version", None)
    if plan.strategy == "ddp" and predicted.get("buckets"):
        d["ddp"] = {k: v for k, v in d["ddp"].items()
                    if k not in ("bucket_cap_mb", "first_bucket_mb")}
        d["ddp"]["buckets"] = list(predicted["buckets"])
    return repr(d)


def _percent(trial: Trial, reference: float) -> str:
    return f"{trial.p50_s / reference - 1:+.1%}"


_Candidate = tuple[Trial, str, dict[str, Any]]
"""A proposal to bench: its trial, its plan's ``_same_plan_key`` and its predicted block."""


def _measure_baseline(plan: Plan, prediction: Any, bench, bench_held
                      ) -> tuple[Trial, OverlapFigures | None, str]:
    """Round 0: the plan as given (the rollback), with its held twin where it has one."""
    baseline = Trial(knob="baseline", change="the plan as given", plan=plan,
                     predicted_step_s=prediction.predicted["step_time_s"], kept=True)
    refused = held_refusal(plan)
    if bench_held is None:
        note = "the no-overlap twin was not asked for (tune --baseline none)"
    elif refused:
        note = f"no held twin: the plan {refused[0]}"
    else:
        held = bench_held(plan)
        baseline.step_times_s = held.step_times_s
        figures = dataclasses.replace(
            held.figures, predicted_contention_s=prediction.candidate.time.backward_contention_s)
        return baseline, figures, held.how
    baseline.step_times_s = bench([plan])[0]
    return baseline, None, note


def _candidates(result: StageResult, proposals: list[tuple[str, str, Plan]], predict,
                tried: dict[str, str], max_per_round: int) -> list[_Candidate]:
    """The stage's proposals to bench, predicted fastest first; what is dropped and why goes
    to ``result.dropped``."""
    out: list[_Candidate] = []
    mine: dict[str, str] = {}
    for knob, change, candidate in proposals:
        try:
            guess = predict(candidate)
        except BadInput as e:
            result.dropped.append((knob, change, f"cannot be predicted: {e}"))
            continue
        if not guess.fits:
            peak, limit = guess.predicted["peak_bytes"], guess.limit_bytes
            why = f"does not fit: peaks at {format_bytes(peak)}, above {format_bytes(limit)}"
            result.dropped.append((knob, change, why))
            continue
        key = _same_plan_key(candidate, guess.predicted)
        if key in tried or key in mine:
            where = tried.get(key) or f"this stage ({mine[key]})"
            result.dropped.append((knob, change, f"runs as a plan measured already: {where}"))
            continue
        mine[key] = f"{knob}, {change}"
        out.append((Trial(knob=knob, change=change, plan=candidate, stage=result.name,
                          predicted_step_s=guess.predicted["step_time_s"]), key,
                    guess.predicted))
    out.sort(key=lambda c: c[0].predicted_step_s)
    for trial, _, _ in out[max_per_round:]:
        why = f"predicted slower than the {max_per_round} benched (max_per_round)"
        result.dropped.append((trial.knob, trial.change, why))
    return out[:max_per_round]


def _judge(result: StageResult, benched: list[_Candidate], measured: list[list[list[float]]],
           noise: float) -> _Candidate | None:
    """Record the launch ``[best, *benched, best]`` and return the winner when it beats the
    same-launch reference by more than the noise."""
    reference = (p50_of(measured[0]) + p50_of(measured[-1])) / 2
    result.reference_p50_s = reference
    for (trial, _, _), times in zip(benched, measured[1:-1]):
        trial.step_times_s = times
        trial.reference_p50_s = reference
        result.trials.append(trial)
    winner = min(benched, key=lambda c: c[0].p50_s)
    trial = winner[0]
    what = f"{trial.knob}: {trial.change}, {_percent(trial, reference)} against the best so far"
    if trial.p50_s < reference * (1 - noise):
        trial.kept = True
        result.outcome = f"kept {what} in the same launch, beyond the noise {noise:.1%}"
        return winner
    result.outcome = f"nothing kept: the fastest, {what}, is not beyond the noise {noise:.1%}"
    return None


def tune(plan: Plan, facts: ModelFacts, bench: Callable[[list[Plan]], list[list[list[float]]]],
         *, budget_s: float, bench_held: Callable[[Plan], HeldBaseline] | None = None,
         max_rounds: int | None = None, max_per_round: int = 4, hardware=None,
         allow: Permissions | None = None, run_mesh: tuple[int, int] | None = None,
         warmup_steps: int = 0, progress=None) -> TuneResult:
    """Run [Note: the tuning loop]. ``bench(plans) -> per plan, per rank, step seconds`` runs
    plans on real workers (one launch per call); ``bench_held(plan)`` times the baseline and
    its no-overlap twin in one launch (None: the baseline alone, no verdict). ``hardware`` (a
    calibrated file's figures) orders the proposals; ``allow`` is what the user permitted
    (lossy hooks, optimizer overlap, the workers' device); ``run_mesh`` the local run's mesh;
    ``max_rounds`` caps the benched stages (None: every stage)."""
    def predict(candidate: Plan):
        return predict_plan(candidate, facts, hardware=hardware)
    started = time.perf_counter()
    prediction = predict(plan)
    if not prediction.fits:  # never measured, never reported as best (issue 21, S3-30)
        peak = prediction.predicted["peak_bytes"]
        raise NoFeasiblePlan(
            f"the plan to tune peaks at {format_bytes(peak)} per rank, above its limit "
            f"{format_bytes(prediction.limit_bytes)} (budget_bytes - headroom_bytes); tune "
            "starts from a plan that fits and keeps only plans that fit. Run fsdp-plan on the "
            "model for one that fits, or raise budget_bytes if the GPUs hold more; nothing was "
            "measured.", smallest_peak_bytes=peak)
    baseline, figures, note = _measure_baseline(plan, prediction, bench, bench_held)
    noise = noise_of(baseline)
    best, best_predicted, trials = baseline, prediction.predicted, [baseline]
    tried = {_same_plan_key(plan, prediction.predicted): "baseline"}
    twin = (f", and its no-overlap twin in the same launch ({note}): {verdict(figures)}"
            if figures else f"; {note}")
    stages = [StageResult(name="baseline", trials=[baseline],
                          reason=f"the plan as given, the rollback{twin}",
                          outcome=f"rollback kept; noise {noise:.1%} (the spread of its steps)")]
    if progress:
        progress(f"baseline: {best.p50_s:.4g} s per step (noise {noise:.1%})"
                 + (f"; {verdict(figures)}" if figures else ""))
    limit = sum(stage.benches for stage in STAGES) if max_rounds is None else max_rounds
    stopped, rounds = "every stage of the tuning order ran", 0
    for stage in STAGES:
        out_of = None
        if stage.benches and time.perf_counter() - started > budget_s:
            out_of = "the time budget is spent"
        elif stage.benches and rounds >= limit:
            out_of = f"max_rounds ({limit}) reached"
        if out_of:
            if stopped.startswith("every"):
                stopped = f"{out_of} (before stage {stage.name})"
            stages.append(StageResult(name=stage.name, reason="not run",
                                      outcome=f"skipped: {out_of}"))
            continue
        proposed = stage.propose(Context(
            plan=best.plan, facts=facts, allow=allow or Permissions(), overlap=figures,
            overlap_note=note, run_mesh=run_mesh, warmup_steps=warmup_steps, noise=noise,
            buckets=tuple(best_predicted.get("buckets") or ())))
        result = StageResult(name=stage.name, reason=proposed.reason,
                             outcome="checked, no run")
        stages.append(result)
        if not stage.benches:
            continue
        benched = _candidates(result, proposed.proposals, predict, tried, max_per_round)
        if not benched:
            result.outcome = ("skipped: every proposal was dropped" if proposed.proposals
                              else "skipped: nothing to propose")
            continue
        rounds += 1
        measured = bench([best.plan, *(t.plan for t, _, _ in benched), best.plan])
        winner = _judge(result, benched, measured, noise)
        for trial, key, _ in benched:
            tried[key] = f"{stage.name} ({trial.knob}, {trial.change})"
        trials += result.trials
        if winner is not None:
            best, _, best_predicted = winner
        if progress:
            progress(f"{stage.name}: {result.outcome}")
    return TuneResult(baseline=baseline, best=best, trials=trials, noise=noise, rounds=rounds,
                      stopped=stopped, stages=stages, overlap=figures, overlap_note=note)
