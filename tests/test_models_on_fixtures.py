"""The memory model, step-time model, collective rule and search on JSON fixtures: no model is
built and no torch is imported by the code under test (facts.py: [Note: model facts]).

``tiny_llama_facts.json`` is ``analyze_model`` of ``examples/llama.py --model-arg size=tiny``
at batch 2 x sequence 64 (bf16); ``two_block_facts`` below is written by hand.
"""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest
from layouts import evaluate

from fsdp_plan.api import PlanRequest, plan_from_facts, predict
from fsdp_plan.common.errors import BadInput, NoFeasiblePlan
from fsdp_plan.cost.hardware import hardware_for
from fsdp_plan.cost.precision import OPTIMIZER_STATES, Precision
from fsdp_plan.facts.types import (
    Analysis,
    Event,
    ModelFacts,
    ModuleCompute,
    ModuleGraph,
    ModuleInfo,
    Timeline,
)
from fsdp_plan.model.source import ModelSource
from fsdp_plan.search.candidate import SearchSettings
from fsdp_plan.search.evaluator import Evaluator

FIXTURE = Path(__file__).parent / "fixtures" / "tiny_llama_facts.json"
SOURCE = ModelSource(source="examples/llama.py", args={"size": "tiny"}, batch_size=2, seq_len=64)


@pytest.fixture(scope="module")
def llama() -> ModelFacts:
    return ModelFacts.from_json(FIXTURE.read_text())


def two_block_facts() -> ModelFacts:
    """A root with two identical 1024x1024 blocks and a 1024x10 head, analysed by hand.

    Each block saves 4 MB in forward and takes 2 GFLOP forward, 4 GFLOP backward; the head
    saves 40 kB. Levels rise in forward and fall in backward."""
    def info(fqn, parent, children, shapes, cls="Linear"):
        numel = sum(math.prod(s) for s in shapes)
        return ModuleInfo(fqn=fqn, class_name=cls, parent=parent, children=children,
                          direct_numel=numel, subtree_numel=numel,
                          direct_bytes_by_dtype={"float32": 4 * numel}, param_shapes=shapes)
    modules = {
        "": info("", None, ["layers", "head"], [], "Net"),
        "layers": info("layers", "", ["layers.0", "layers.1"], [], "ModuleList"),
        "layers.0": info("layers.0", "layers", [], [[1024, 1024]], "Block"),
        "layers.1": info("layers.1", "layers", [], [[1024, 1024]], "Block"),
        "head": info("head", "", [], [[10, 1024]]),
    }
    modules["layers"].subtree_numel = 2 * 1024 * 1024
    modules[""].subtree_numel = 2 * 1024 * 1024 + 10240
    graph = ModuleGraph(modules=modules, tied_groups=[], blocks=["layers.0", "layers.1"],
                        total_numel=2 * 1024 * 1024 + 10240,
                        total_param_bytes=4 * (2 * 1024 * 1024 + 10240), total_buffer_bytes=0)
    mb = 1_000_000

    def ev(kind, module, level, flops):
        return Event(kind=kind, module=module, level=level, peak=level, flops=flops)
    g = 1e9
    events = [ev("pre_fw", "", 1000, 0), ev("pre_fw", "layers.0", 1000, 0),
              ev("post_fw", "layers.0", 4 * mb, 2 * g), ev("pre_fw", "layers.1", 4 * mb, 2 * g),
              ev("post_fw", "layers.1", 8 * mb, 4 * g), ev("pre_fw", "head", 8 * mb, 4 * g),
              ev("post_fw", "head", 8 * mb + 40_000, 4.02 * g),
              ev("post_fw", "", 8 * mb + 40_000, 4.02 * g),
              ev("pre_bw", "", 8 * mb + 40_000, 4.02 * g),
              ev("pre_bw", "head", 8 * mb + 40_000, 4.02 * g),
              ev("post_bw", "head", 8 * mb, 4.06 * g),
              ev("pre_bw", "layers.1", 8 * mb, 4.06 * g),
              ev("post_bw", "layers.1", 4 * mb, 8.06 * g),
              ev("pre_bw", "layers.0", 4 * mb, 8.06 * g),
              ev("post_bw", "layers.0", 1000, 12.06 * g),
              ev("post_bw", "", 1000, 12.06 * g), ev("end", "", 0, 12.06 * g)]
    comp = {"": ModuleCompute(fw_flops=4.02 * g, bw_flops=8.04 * g, calls=1),
            "layers.0": ModuleCompute(fw_flops=2 * g, bw_flops=4 * g, saved_bytes=4 * mb, calls=1),
            "layers.1": ModuleCompute(fw_flops=2 * g, bw_flops=4 * g, saved_bytes=4 * mb, calls=1),
            "head": ModuleCompute(fw_flops=0.02 * g, bw_flops=0.04 * g, saved_bytes=40_000,
                                  calls=1)}
    analysis = Analysis(timeline=Timeline(events=events), modules=comp, input_bytes=1000,
                        param_dtype="bfloat16", total_fw_flops=4.02 * g, total_bw_flops=8.04 * g)
    return ModelFacts(graph=graph, analysis=analysis)


def evaluator(facts: ModelFacts, world: int = 8, budget: int = 80 * 10**9,
              optimizer: str = "adamw") -> Evaluator:
    return Evaluator(facts.graph, facts.analysis, SearchSettings(
        budget_bytes=budget, headroom_bytes=0, world_size=world, gpus_per_node=8,
        precision=Precision(orig_bytes=4, param_bytes=2, reduce_bytes=4), optimizer=optimizer,
        hardware=hardware_for("h100")))


def per_block(ev: Evaluator, *, k: int = 0, fwp: int = 0, bwp: int = 1, world: int = 8):
    groups = [[b] for b in ev.graph.blocks]
    return evaluate(ev, name="t", strategy="full", replicate=1, shard=world, groups=groups,
                       reshard=[True] * len(groups), root_reshard=False, k=k,
                       forward_prefetch=fwp, backward_prefetch=bwp)


def test_the_models_and_search_import_no_torch():
    code = ("import sys; import fsdp_plan.api, fsdp_plan.search.fsdp, fsdp_plan.cost.memory, "
            "fsdp_plan.cost.step_time, fsdp_plan.cost.collectives, fsdp_plan.cost.units, fsdp_plan.cost.timeline, "
            "fsdp_plan.facts.types, fsdp_plan.plan.report, fsdp_plan.plan.document; "
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]; "
            "assert not bad, bad[:5]")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False)
    assert run.returncode == 0, run.stderr


def test_facts_survive_a_json_round_trip(llama):
    again = ModelFacts.from_json(llama.to_json())
    assert again == llama
    with pytest.raises(ValueError, match="facts version"):
        ModelFacts.from_dict({**llama.to_dict(), "facts_version": 99})


def test_sharded_states_are_exact_per_rank():
    facts = two_block_facts()
    for world in (1, 3, 8):
        est = per_block(evaluator(facts, world=world), world=world).memory
        # FSDP2 pads dim 0 of each parameter to a multiple of the shard size
        shard = 2 * math.ceil(1024 / world) * 1024 + math.ceil(10 / world) * 1024
        assert est.breakdown["sharded_params"] == shard * 4 or est.phase == "optimizer step"
    est = per_block(evaluator(facts, optimizer="sgd")).memory
    assert est.breakdown.get("optimizer_states", 0) == 0


def test_optimizer_states_scale_with_the_optimizer(llama):
    adam = per_block(evaluator(llama, optimizer="adamw"))
    sgd = per_block(evaluator(llama, optimizer="sgd"))
    total_shard = sum(u.shard_numel for u in adam.units)
    assert OPTIMIZER_STATES["adamw"] == 2
    assert adam.memory.peak_bytes - sgd.memory.peak_bytes >= 2 * 4 * total_shard


def test_per_block_units_peak_below_root_only(llama):
    ev = evaluator(llama)
    root_only = evaluate(ev, name="root", strategy="full", replicate=1, shard=8, groups=[],
                            reshard=[], root_reshard=False, forward_prefetch=0,
                            backward_prefetch=1)
    assert per_block(ev).memory.peak_bytes < root_only.memory.peak_bytes


def test_peak_is_monotone_in_prefetch_and_falls_with_checkpointing(llama):
    ev = evaluator(llama)
    base = per_block(ev).memory.peak_bytes
    assert per_block(ev, fwp=1).memory.peak_bytes >= base
    assert per_block(ev, bwp=2).memory.peak_bytes >= base
    peaks = [per_block(ev, k=k).memory.peak_bytes for k in range(5)]
    assert peaks == sorted(peaks, reverse=True) and peaks[-1] < peaks[0]


def test_any_set_of_checkpointed_blocks_composes(llama):
    """Checkpointing blocks {1, 3} is predicted between none and all four, and a set of the
    same size peaks the same for identical blocks only if it frees memory at the same time."""
    ev = evaluator(llama)
    none = per_block(ev).memory.peak_bytes
    every = per_block(ev, k=4).memory.peak_bytes
    groups = [[b] for b in ev.graph.blocks]
    some = evaluate(ev, name="t", strategy="full", replicate=1, shard=8, groups=groups,
                       reshard=[True] * 4, root_reshard=False, forward_prefetch=0,
                       backward_prefetch=1, checkpoint=frozenset({1, 3})).memory.peak_bytes
    assert every < some < none
    assert evaluate(ev, name="t", strategy="full", replicate=1, shard=8, groups=groups,
                       reshard=[True] * 4, root_reshard=False, forward_prefetch=0,
                       backward_prefetch=1, checkpoint=frozenset(range(4))
                       ).memory.peak_bytes == every


def test_collective_counts_follow_the_rule():
    ev = evaluator(two_block_facts())
    cand = per_block(ev)
    # two block units gather in forward and again in backward; the root (head) once, since it
    # does not reshard after forward; every unit reduce-scatters once
    assert cand.collectives == {"all_gather": 5, "reduce_scatter": 3, "all_reduce": 0}
    hsdp = evaluate(ev, name="t", strategy="hybrid", replicate=2, shard=4,
                       groups=[["layers.0"], ["layers.1"]], reshard=[True, True],
                       root_reshard=False, forward_prefetch=0, backward_prefetch=1)
    assert hsdp.collectives == {"all_gather": 5, "reduce_scatter": 3, "all_reduce": 3}


@pytest.mark.parametrize("facts_name", ["two_block", "llama"])
def test_unit_compute_adds_up_to_the_models_flops(facts_name, llama):
    """Each op's FLOPs are counted in exactly one unit, whatever the layout (issue 12)."""
    facts = two_block_facts() if facts_name == "two_block" else llama
    ev = evaluator(facts)
    hw = ev.settings.hardware
    rate = hw.peak_flops * hw.efficiency
    for cand in (per_block(ev), evaluate(ev, name="root", strategy="full", replicate=1, shard=8,
                                            groups=[], reshard=[], root_reshard=False,
                                            forward_prefetch=0, backward_prefetch=1)):
        flops = [ev.clock.flops(u) for u in cand.units]
        assert sum(f[0] for f in flops) == pytest.approx(facts.analysis.total_fw_flops, rel=1e-9)
        assert sum(f[1] for f in flops) == pytest.approx(facts.analysis.total_bw_flops, rel=1e-9)
        assert cand.time.forward_s == pytest.approx(facts.analysis.total_fw_flops / rate,
                                                    rel=1e-9)


def test_step_time_is_the_sum_of_its_parts(llama):
    """step = forward + backward (with its contention) + forward contention + exposed (waits
    for all-gathers plus the tail) + optimizer (SPEC 6)."""
    t = per_block(evaluator(llama)).time
    without_fw_contention = t.forward_s + t.backward_s + t.exposed_comm_s + t.optimizer_s
    assert without_fw_contention - 1e-12 <= t.step_s <= without_fw_contention + t.contention_s
    assert t.exposed_comm_s == pytest.approx(t.bubbles_s + t.comm_tail_s, rel=1e-9, abs=1e-15)
    assert 0 <= t.exposed_comm_s and t.hidden_comm_s >= 0
    assert t.optimizer_s > 0 and t.forward_s > 0


def request(budget: int, world: int = 8, strategy: str = "auto") -> PlanRequest:
    return PlanRequest(source=SOURCE, budget_bytes=budget, headroom_bytes=0, world_size=world,
                       strategy=strategy)


def test_search_picks_a_fitting_plan_no_slower_than_any_fitting_recipe(llama):
    result = plan_from_facts(llama, request(10**9))
    assert result.best.fits and result.best.memory.peak_bytes <= 10**9
    for recipe in result.recipes:
        if recipe.fits:
            assert result.best.time.step_s <= recipe.time.step_s + 1e-12


def test_a_tighter_budget_checkpoints_more(llama):
    loose_result = plan_from_facts(llama, request(10**9))
    loose = loose_result.best
    smallest = min(c.memory.peak_bytes for c in loose_result.ranked)
    tight_budget = int(smallest * 1.01)
    tight = plan_from_facts(llama, request(tight_budget)).best
    assert tight.memory.peak_bytes <= tight_budget
    assert len(tight.checkpointed) >= len(loose.checkpointed)


def test_no_plan_fits_says_the_smallest_peak(llama):
    with pytest.raises(NoFeasiblePlan, match="smallest peak") as info:
        plan_from_facts(llama, request(10_000))
    assert info.value.smallest_peak_bytes > 10_000


def test_predict_reproduces_the_searched_plan_exactly(llama):
    result = plan_from_facts(llama, request(10**9))
    predicted = predict(result.plan, llama).predicted
    assert predicted == result.plan.predicted


def test_predict_a_hand_written_torchtitan_plan(llama):
    """One unit per block, every block checkpointed, last block kept unsharded (torchtitan)."""
    plan = plan_from_facts(llama, request(10**9, strategy="full")).plan
    blocks = llama.graph.blocks
    units = [dataclasses.replace(plan.units[0], modules=[b], reshard_after_forward=b != blocks[-1])
             for b in blocks] + [dataclasses.replace(plan.units[-1], modules=[""],
                                                     reshard_after_forward=False)]
    edited = dataclasses.replace(plan, units=units, activation_checkpointing=list(blocks),
                                 forward_prefetch={}, backward_prefetch={})
    got = predict(edited, llama)
    ev = evaluator(llama)
    direct = evaluate(ev, name="t", strategy="full", replicate=1, shard=8,
                         groups=[[b] for b in blocks], reshard=[True, True, True, False],
                         root_reshard=False, k=4, forward_prefetch=0, backward_prefetch=1)
    assert got.predicted["peak_bytes"] == direct.memory.peak_bytes
    assert got.predicted["collectives_per_step"] == direct.collectives


def test_predict_refuses_what_it_cannot_model(llama):
    plan = plan_from_facts(llama, request(10**9, strategy="full")).plan
    with pytest.raises(BadInput, match="not repeated blocks"):
        predict(dataclasses.replace(plan, activation_checkpointing=["layers.0.attn"]
                                    if "layers.0.attn" in llama.graph.modules else ["norm"]),
                llama)
    keys = [u.key for u in plan.units if u.key]
    if len(keys) >= 3:
        with pytest.raises(BadInput, match="uniform depth"):
            predict(dataclasses.replace(plan, forward_prefetch={keys[0]: [keys[2]]}), llama)
    with pytest.raises(BadInput, match="does not have|not have"):
        predict(dataclasses.replace(plan, activation_checkpointing=["no.such.block"]), llama)


def test_accumulation_records_the_gradient_sync_it_chose(llama):
    """With room for the held gradients, reducing only after the last of 4 micro-batches
    skips three reduce-scatters: the plan says so and counts one per unit."""
    req = dataclasses.replace(request(10**12, strategy="full"), grad_accum_steps=4)
    result = plan_from_facts(llama, req)
    plan = result.plan
    assert plan.grad_accum_steps == 4 and plan.fsdp_plan_version == 2
    assert plan.gradient_sync == "last"
    assert any(r.startswith("reduce gradients only after the last") for r in result.reasons)
    units = len([u for u in result.best.units if u.numel])
    assert plan.predicted["collectives_per_step"]["reduce_scatter"] == units
    assert plan.predicted["tokens_per_s"] > 0
