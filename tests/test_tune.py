"""``fsdp-plan tune``: the tuning order and the loop's decisions on synthetic timings (no
processes), and a real gloo run that improves on a deliberately bad baseline."""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from test_measure_helpers import tiny_llama_plan

from fsdp_plan.bench.overlap import OverlapFigures
from fsdp_plan.bench.tune import NOISE_FLOOR, HeldBaseline, tune
from fsdp_plan.bench.tune_stages import (
    STAGES,
    Context,
    Permissions,
    Proposed,
    checkpointing_changes,
)
from fsdp_plan.cli.main import main
from fsdp_plan.cli.tune import format_table
from fsdp_plan.facts.types import ModelFacts
from fsdp_plan.plan.document import Plan, read_plan
from fsdp_plan.plan.prefetch import prefetch_depths, prefetch_maps

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA = os.path.join(ROOT, "examples", "llama.py")
FACTS = Path(ROOT) / "tests" / "fixtures" / "tiny_llama_facts.json"
ORDER = ["baseline", "topology", "buckets", "contention", "hooks", "optimizer overlap",
         "prefetch", "checkpointing", "reshard"]


def bad_baseline(tmp_path) -> str:
    """Root only, no prefetch, every block fully checkpointed: recomputation for nothing."""
    path = tmp_path / "baseline.yaml"
    # enough tokens that recomputing every block costs far more than the timing noise
    assert main([LLAMA, "--model-arg", "size=tiny", "--mem", "1GB", "--world-size", "2",
                 "--seq-len", "256", "--batch-size", "4", "--strategy", "full", "--format",
                 "json", "--plan", str(path)]) == 0
    doc = yaml.safe_load(path.read_text())
    doc["units"] = [{"modules": [""], "reshard_after_forward": False}]
    doc["activation_checkpointing"] = [f"layers.{i}" for i in range(4)]
    doc["forward_prefetch"], doc["backward_prefetch"] = {}, {}
    doc.pop("predicted")
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(path)


def bad_plan() -> Plan:
    """``bad_baseline`` built in code (no planning run): the tiny Llama root only, every block
    checkpointed."""
    doc = tiny_llama_plan(world=2).to_dict()
    doc.update(units=[{"modules": [""], "reshard_after_forward": False}],
               activation_checkpointing=[f"layers.{i}" for i in range(4)])
    return Plan.from_dict(doc)


def ddp_plan(**ddp) -> Plan:
    """The tiny Llama under DDP on 2 ranks (about 1 MiB of gradients)."""
    doc = tiny_llama_plan(world=2).to_dict()
    doc.update(fsdp_plan_version=2, strategy="ddp", mesh={"replicate": 2, "shard": 1},
               units=[{"modules": [""], "reshard_after_forward": False}],
               ddp={"bucket_cap_mb": 0.25, "first_bucket_mb": 0.25, **ddp})
    return Plan.from_dict(doc)


def with_prefetch(plan: Plan, forward: int, backward: int) -> Plan:
    maps = prefetch_maps([u.key for u in plan.units], forward, backward)
    return Plan.from_dict({**plan.to_dict(), "forward_prefetch": maps[0],
                           "backward_prefetch": maps[1]})


@pytest.fixture(scope="module")
def facts() -> ModelFacts:
    return ModelFacts.from_json(FACTS.read_text())


def test_checkpointing_changes_one_block_at_a_time(facts):
    plan = bad_plan()
    plan.model = replace(plan.model, batch_size=2)
    found = {(knob, change) for knob, change, _ in checkpointing_changes(plan, facts.graph.blocks)}
    assert found == {("checkpointing", "4 -> 3 blocks"), ("checkpointing", "4 -> 0 blocks")}
    [(_, change, _)] = [p for p in STAGES[1].propose(Context(plan=plan, facts=facts)).proposals]
    assert change == "root only -> one unit per block"
    for stage in STAGES:
        for _, _, other in stage.propose(Context(plan=plan, facts=facts)).proposals:
            assert other.to_dict() != plan.to_dict()
            Plan.from_dict(other.to_dict())  # the plan format accepts it


def synthetic_bench(seconds_of, drift: float = 1.0):
    """A bench whose step time is ``seconds_of(plan)`` on both ranks, with 1% jitter; each
    launch runs ``drift`` times slower than the one before (a machine getting busier).
    ``bench.launches`` records the plans of every launch."""
    launches: list[list[Plan]] = []

    def bench(plans: list[Plan]):
        launches.append(list(plans))
        out = []
        for plan in plans:
            s = seconds_of(plan) * drift ** (len(launches) - 1)
            out.append([[s * (1 + 0.01 * (i % 3 - 1)) for i in range(8)]] * 2)
        return out
    bench.launches = launches
    return bench


def overlap_of(*, hidden_ms: float, contention_ms: float) -> OverlapFigures:
    """A 100 ms backward without overlap that hid ``hidden_ms`` of communication while its
    compute slowed ``contention_ms`` (bench/overlap.py figures)."""
    return OverlapFigures(backward_overlapped_s=0.1 - (hidden_ms - contention_ms) / 1e3,
                          backward_held_s=0.1, compute_overlapped_s=0.05 + contention_ms / 1e3,
                          compute_held_s=0.05, hidden_s=hidden_ms / 1e3)


def held_bench(bench, *, hidden_ms: float, contention_ms: float):
    """The baseline's launch: ``bench``'s steps, and ``overlap_of`` those figures."""
    calls: list[Plan] = []

    def bench_held(plan: Plan) -> HeldBaseline:
        calls.append(plan)
        figures = overlap_of(hidden_ms=hidden_ms, contention_ms=contention_ms)
        return HeldBaseline(step_times_s=bench([plan])[0], figures=figures, how="held (fake)")
    bench_held.calls = calls
    return bench_held


def stage(result, name: str):
    [found] = [s for s in result.stages if s.name == name]
    return found


def test_an_fsdp_plan_runs_the_stages_in_order(facts):
    """Every stage in the order, the FSDP ones benched, the DDP-only ones skipped with their
    reason; the baseline's twin gives the verdict the contention stage reads."""
    plan = tiny_llama_plan(world=2)  # one unit per block, root last, no explicit prefetch
    bench = synthetic_bench(lambda p: 1.0)
    held = held_bench(bench, hidden_ms=10, contention_ms=2)
    result = tune(plan, facts, bench, bench_held=held, budget_s=600, run_mesh=(1, 2))
    assert [s.name for s in result.stages] == ORDER
    assert held.calls == [plan] and len(bench.launches) == 1 + result.rounds
    assert result.overlap is not None and result.overlap.saved_s == pytest.approx(0.008)
    assert "overlap saves 8 ms of 100" in stage(result, "baseline").reason
    assert stage(result, "topology").outcome == "checked, no run"
    assert "inside a node" in stage(result, "topology").reason
    assert "FSDP2's unit is its communication bucket" in stage(result, "buckets").reason
    assert {t.knob for t in stage(result, "buckets").trials} == {"unit layout"}
    assert stage(result, "contention").reason.startswith("overlap paid")
    assert stage(result, "contention").outcome == "skipped: nothing to propose"
    assert "not a DDP plan" in stage(result, "hooks").reason
    opt = stage(result, "optimizer overlap")
    assert "--optimizer-overlap" in opt.reason and opt.outcome.startswith("skipped")
    assert {t.knob for t in stage(result, "prefetch").trials} == {"forward prefetch",
                                                                  "backward prefetch"}
    assert [t.knob for t in stage(result, "reshard").trials] == ["reshard"]
    # every launch is the best so far, the stage's proposals, the best so far again
    for launch in bench.launches[1:]:
        assert launch[0] is launch[-1] and len(launch) >= 3
    # nothing beat the noise: every stage's outcome says so and the baseline stays best
    assert result.best is result.baseline and result.stopped.startswith("every stage")
    for s in result.stages:
        if s.trials and s.name != "baseline":
            assert s.outcome.startswith("nothing kept") and s.reference_p50_s == \
                pytest.approx(1.0, rel=0.02)


def test_overlap_that_cost_time_proposes_shallower_prefetch(facts):
    plan = with_prefetch(tiny_llama_plan(world=2), 1, 2)

    def seconds(p: Plan) -> float:  # each level of prefetch costs 10%, other layouts 50%
        return 1.0 + 0.1 * sum(prefetch_depths(p)) + 0.5 * (len(p.units) != len(plan.units))
    bench = synthetic_bench(seconds)
    result = tune(plan, facts, bench, bench_held=held_bench(bench, hidden_ms=3, contention_ms=9),
                  budget_s=600)
    contention = stage(result, "contention")
    assert contention.reason.startswith("overlap cost the baseline's backward 6 ms of 100")
    assert {(t.knob, t.change) for t in contention.trials} == {
        ("forward prefetch", "depth 1 -> 0"), ("backward prefetch", "depth 2 -> 1")}
    assert contention.outcome.startswith("kept ")
    kept = [t for t in contention.trials if t.kept]
    assert len(kept) == 1 and kept[0].p50_s < kept[0].reference_p50_s * (1 - result.noise)
    # the prefetch stage starts from the kept plan, and does not bench the baseline again
    prefetch = stage(result, "prefetch")
    assert all(prefetch_depths(t.plan) != (1, 2) for t in prefetch.trials)
    assert any("measured already: baseline" in why for _, _, why in prefetch.dropped)
    assert sum(prefetch_depths(result.best.plan)) == 1  # forward 0, backward 1


def test_contention_reads_the_verdict_against_the_noise(facts):
    """Overlap is changed only when it cost measurably: beyond the baseline's noise, with
    communication really hidden (compute nothing overlapped was not slowed by it)."""
    plan = with_prefetch(tiny_llama_plan(world=2), 1, 2)

    def contention(noise: float = 0.02, **figures) -> Proposed:
        overlap = overlap_of(**figures) if figures else None
        return STAGES[2].propose(Context(plan=plan, facts=facts, overlap=overlap, noise=noise,
                                         overlap_note="--baseline none"))
    assert STAGES[2].name == "contention"
    assert contention().reason == "no overlap verdict: --baseline none"
    nothing_hidden = contention(hidden_ms=0, contention_ms=7)
    assert nothing_hidden.reason.startswith("no communication overlapped")
    assert "+7 ms" in nothing_hidden.reason
    faster = contention(hidden_ms=0, contention_ms=-3)  # saves 0: not "overlap paid" either
    assert faster.reason.startswith("no communication overlapped") and "-3 ms" in faster.reason
    within = contention(noise=0.05, hidden_ms=1, contention_ms=4)  # 3 ms of 100: inside 5%
    assert "within the noise (5.0%)" in within.reason
    assert nothing_hidden.proposals == within.proposals == []
    beyond = contention(noise=0.02, hidden_ms=1, contention_ms=4)
    assert beyond.reason.startswith("overlap cost the baseline's backward 3 ms of 100")
    assert [change for _, change, _ in beyond.proposals] == ["depth 1 -> 0", "depth 2 -> 1"]


def test_a_ddp_plan_sweeps_buckets_and_asks_before_lossy_hooks(facts):
    plan = ddp_plan()
    bench = synthetic_bench(lambda p: 1.0)
    result = tune(plan, facts, bench, bench_held=held_bench(bench, hidden_ms=1, contention_ms=5),
                  budget_s=600)
    assert [s.name for s in result.stages] == ORDER
    buckets = stage(result, "buckets")
    assert "0.25 MiB cap is the medium one" in buckets.reason
    assert sorted(t.change for t in buckets.trials) == ["0.25 MiB -> 0.0625 MiB (small)",
                                                         "0.25 MiB -> 1 MiB (large)"]
    # overlap cost time: one bucket of every gradient, which the large cap already built
    contention = stage(result, "contention")
    assert "one bucket of every gradient" in contention.reason
    assert contention.trials == [] and contention.outcome == "skipped: every proposal was dropped"
    [(_, change, why)] = contention.dropped
    assert change.endswith("-> one (2 MiB)") and "measured already: buckets" in why
    hooks = stage(result, "hooks")
    assert "--allow-lossy-hooks" in hooks.reason and hooks.trials == []
    assert "DDP plan: no prefetch" in stage(result, "prefetch").reason
    assert "nothing is sharded" in stage(result, "reshard").reason
    assert "--optimizer-overlap" in stage(result, "optimizer overlap").reason
    benched = [p for launch in bench.launches for p in launch]
    assert all(p.ddp.comm_hook is None and not p.optimizer_overlap for p in benched)

    # with the user's permissions: the cast hook gloo runs, and optimizer overlap
    bench = synthetic_bench(lambda p: 1.0)
    result = tune(plan, facts, bench, budget_s=600,
                  allow=Permissions(lossy_hooks=True, optimizer_overlap=True))
    hooks = stage(result, "hooks")
    assert [t.plan.ddp.comm_hook for t in hooks.trials] == ["fp16_compress"]
    assert "bf16_compress not proposed: gloo cannot run it" in hooks.reason
    assert "powersgd not proposed: gloo cannot run it" in hooks.reason
    [trial] = stage(result, "optimizer overlap").trials
    assert trial.plan.optimizer_overlap and trial.change == "after backward -> in backward"
    assert "no overlap verdict" in stage(result, "contention").reason


def test_refused_optimizer_overlap_and_a_hooked_plan_have_no_twin(facts):
    """A DDP plan with its own hook: the held twin would be another plan (not run), optimizer
    overlap is refused by the plan's rule, and dropping the hook (lossless) is proposed
    without any permission; PowerSGD is never proposed to run fewer steps than it warms up."""
    plan = ddp_plan(comm_hook="fp16_compress")
    bench = synthetic_bench(lambda p: 0.9 if p.ddp.comm_hook is None else 1.0)
    held = held_bench(bench, hidden_ms=1, contention_ms=0)
    result = tune(plan, facts, bench, bench_held=held, budget_s=600, warmup_steps=2,
                  allow=Permissions(optimizer_overlap=True, lossy_hooks=True,
                                    accelerator=True))
    assert held.calls == [] and result.overlap is None
    assert "no held twin: the plan already has ddp.comm_hook: fp16_compress" in \
        stage(result, "baseline").reason
    assert "no overlap verdict" in stage(result, "contention").reason
    hooks = stage(result, "hooks")
    changes = {t.change.split(" (")[0] for t in hooks.trials}
    assert "fp16_compress -> DDP's all-reduce" in changes
    assert "fp16_compress -> bf16_compress" in changes
    assert not any("PowerSGD" in c for c in changes)
    assert "powersgd not proposed: PowerSGD compresses only from step 1000" in hooks.reason
    assert result.best.plan.ddp.comm_hook is None  # 10% faster: beyond the noise
    # the hook is gone from the best plan, so optimizer overlap is allowed now: proposed
    assert [t.plan.optimizer_overlap for t in stage(result, "optimizer overlap").trials] == [True]

    accumulating = Plan.from_dict({**ddp_plan().to_dict(), "grad_accum_steps": 2})
    result = tune(accumulating, facts, synthetic_bench(lambda p: 1.0), budget_s=600,
                  allow=Permissions(optimizer_overlap=True))
    opt = stage(result, "optimizer overlap")
    assert opt.reason.startswith("optimizer overlap refused: the plan accumulates 2")
    assert opt.trials == [] and opt.outcome == "skipped: nothing to propose"


def test_the_loop_keeps_what_beats_the_noise(facts):
    plan = bad_plan()

    def seconds(p: Plan) -> float:  # each checkpointed block costs 10%, units are free
        return 1.0 + 0.1 * len(p.activation_checkpointing)
    result = tune(plan, facts, synthetic_bench(seconds), budget_s=600)
    assert result.baseline.p50_s == pytest.approx(1.4)
    assert result.best.p50_s == pytest.approx(1.0)
    assert result.best.plan.activation_checkpointing == []
    assert result.noise >= NOISE_FLOOR
    assert [t.kept for t in result.trials].count(True) == 2  # the baseline and 4 -> 0 blocks
    assert stage(result, "checkpointing").outcome.startswith("kept checkpointing: 4 -> 0")
    assert "not asked for" in stage(result, "baseline").reason  # no bench_held given


def test_a_change_inside_the_noise_is_not_kept(facts):
    plan = bad_plan()

    def seconds(p: Plan) -> float:  # 1% better without checkpointing: below the 2% floor
        return 1.0 - 0.0025 * (4 - len(p.activation_checkpointing))
    result = tune(plan, facts, synthetic_bench(seconds), budget_s=600)
    assert result.best is result.baseline
    assert [t.kept for t in result.trials].count(True) == 1
    assert stage(result, "checkpointing").outcome.startswith("nothing kept: the fastest, "
                                                             "checkpointing: 4 -> 0 blocks, -1.0%")


def test_max_rounds_and_the_time_budget_skip_the_later_stages(facts):
    plan = tiny_llama_plan(world=2)
    bench = synthetic_bench(lambda p: 1.0)
    result = tune(plan, facts, bench, budget_s=600, max_rounds=1)
    assert result.rounds == 1 and len(bench.launches) == 2
    assert stage(result, "buckets").trials
    assert stage(result, "reshard").outcome == "skipped: max_rounds (1) reached"
    assert result.stopped == "max_rounds (1) reached (before stage contention)"
    result = tune(plan, facts, synthetic_bench(lambda p: 1.0), budget_s=0)
    assert [s.outcome for s in result.stages[2:]] == ["skipped: the time budget is spent"] * 7
    assert result.stages[1].outcome == "checked, no run"  # a check costs no launch
    assert result.rounds == 0 and result.best is result.baseline


def test_a_machine_slowing_between_launches_does_not_hide_a_gain(facts):
    """Each launch runs 30% slower than the last: the 5% gain of dropping a checkpointed block
    would look like a 25% loss against the baseline's earlier launch, but the best so far is
    re-measured in every launch, so each change is judged on the same workers."""
    plan = bad_plan()

    def seconds(p: Plan) -> float:
        return 1.0 + 0.05 * len(p.activation_checkpointing)
    result = tune(plan, facts, synthetic_bench(seconds, drift=1.3), budget_s=600)
    assert result.best.plan.activation_checkpointing == []
    assert result.best.p50_s > result.baseline.p50_s  # across launches it looks slower...
    assert result.gain == pytest.approx(1 - 1.0 / 1.2, rel=0.02)  # ...but it is 1.2x faster
    assert all(t.reference_p50_s for t in result.trials[1:])


@pytest.mark.slow
def test_tune_improves_a_bad_baseline_on_gloo(tmp_path, capsys):
    baseline = bad_baseline(tmp_path)
    out = tmp_path / "results"
    capsys.readouterr()
    assert main(["tune", baseline, "--nproc", "2", "--steps", "4", "--warmup", "1",
                 "--budget-minutes", "10", "--out", str(out), "--format", "json"]) == 0
    record = json.loads(capsys.readouterr().out)
    # the tuning order, every stage with its reason and outcome, in the order it ran
    assert record["order"] == ORDER == [s["stage"] for s in record["stages"]]
    assert all(s["reason"] and s["outcome"] for s in record["stages"])
    assert [t for s in record["stages"] for t in s["trials"]] == [
        {k: v for k, v in t.items() if k not in ("stage", "plan_hash", "step_times_s")}
        for t in record["trials"]]
    # the baseline's no-overlap twin, measured in its launch: FSDP2 prefetch off and each
    # reduce-scatter waited (measure/no_overlap.py), and the verdict the contention stage read
    overlap = record["overlap"]
    assert "FSDP2 prefetch off" in overlap["how"]
    assert overlap["backward_overlapped_s"] > 0 and overlap["backward_held_s"] > 0
    assert overlap["verdict"] in record["stages"][0]["reason"]
    contention = record["stages"][ORDER.index("contention")]
    assert contention["reason"].startswith(
        "no communication overlapped" if overlap["hidden_s"] <= 0 else  # the root-only plan
        "overlap paid" if overlap["saved_s"] >= 0 else "overlap cost the baseline's backward")
    assert "not a DDP plan" in record["stages"][ORDER.index("hooks")]["reason"]
    table = format_table(record)
    assert [line.split(":")[0] for line in table.splitlines() if line[:1].isdigit()] == [
        f"{n}. {name}" for n, name in enumerate(ORDER)]
    assert f"verdict: {overlap['verdict']}" in table
    trials = {(t["knob"], t["change"]): t for t in record["trials"]}
    # dropping the recomputation is measured faster than the bad baseline re-measured around
    # it in the same launch, on a machine quiet enough to tell (on a shared 2-core host the
    # same plan's steps spread over 25% and a third of a step is not told apart)...
    dropped = trials[("checkpointing", "4 -> 0 blocks")]
    if record["noise"] < 0.1:
        assert dropped["p50_step_s"] < dropped["reference_p50_s"]
    # ...and a change is kept exactly when it beat that reference by more than the noise
    for t in record["trials"][1:]:
        winner = t["p50_step_s"] == min(o["p50_step_s"] for o in record["trials"][1:]
                                        if o["reference_p50_s"] == t["reference_p50_s"])
        assert t["kept"] == (winner and t["p50_step_s"]
                             < t["reference_p50_s"] * (1 - record["noise"]))
    kept = [t for t in record["trials"] if t["kept"] and t["knob"] != "baseline"]
    assert record["best_p50_s"] == (kept[-1] if kept else record["trials"][0])["p50_step_s"]
    assert record["gain"] == pytest.approx(
        1 - math.prod(t["p50_step_s"] / t["reference_p50_s"] for t in kept))
    assert read_plan(record["rollback_plan"]).to_dict() == read_plan(baseline).to_dict()
    changed = read_plan(record["best_plan"]).to_dict() != read_plan(baseline).to_dict()
    assert changed == bool(kept)
    assert record["torch"] and record["plan_hash"]
    assert len(list(out.glob("tune-*.json"))) == 1


def test_interleaved_timing_runs_every_plan_side_by_side(tmp_path):
    """[Note: interleaved timing]: one launch builds both plans and times their steps in turn;
    each plan gets its own steady steps per rank, warm-up excluded."""
    from fsdp_plan.bench.timing import time_plans
    from fsdp_plan.model.source import ModelSource
    checkpointed = read_plan(bad_baseline(tmp_path))
    plain = Plan.from_dict({**checkpointed.to_dict(), "activation_checkpointing": []})
    source = ModelSource(source=LLAMA, args={"size": "tiny"}, batch_size=2, seq_len=32)
    runs = time_plans(source, [checkpointed, plain], nproc=2, mesh=(1, 2), steps=3, warmup=1,
                      interleave=True)
    assert len(runs) == 2
    for per_rank in runs:
        assert len(per_rank) == 2 and all(len(steps) == 3 for steps in per_rank)
        assert all(0 < t < 60 for steps in per_rank for t in steps)
