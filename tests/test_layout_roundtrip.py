"""One ``Layout`` everywhere (issue 17): every candidate the search evaluates is written as a
plan and read back into the layout it was evaluated from, and re-evaluating that layout gives
the same figures. Torch-free: the search runs on a JSON fixture of the tiny Llama."""

from __future__ import annotations

import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest

from fsdp_plan.cost.hardware import hardware_for
from fsdp_plan.facts.types import ModelFacts
from fsdp_plan.model.source import ModelSource
from fsdp_plan.plan.build import layout_of, predicted_block, to_plan
from fsdp_plan.search.batching import BatchChoice, choose_batch
from fsdp_plan.search.evaluator import Evaluator
from fsdp_plan.search.request import PlanRequest
from fsdp_plan.search.run import plug_ins_for, run_search

FIXTURE = Path(__file__).parent / "fixtures" / "tiny_llama_facts.json"
SOURCE = ModelSource(source="examples/llama.py", args={"size": "tiny"}, batch_size=1,
                     seq_len=64)


@pytest.fixture(scope="module")
def facts() -> ModelFacts:
    return ModelFacts.from_json(FIXTURE.read_text())


def choice_for(facts: ModelFacts, **fields) -> BatchChoice:
    request = PlanRequest(source=SOURCE, hardware=hardware_for("h100"), **fields)
    generators, fallbacks = plug_ins_for(request.strategy, request.allow_offload)
    return choose_batch(request, facts_at=lambda _: facts,
                        search=partial(run_search, generators=generators, fallbacks=fallbacks))


REQUESTS = {
    "auto (FSDP, HSDP, DDP)": {"budget_bytes": 10**9, "world_size": 16, "gpus_per_node": 8},
    "full, tight": {"budget_bytes": 4 * 10**6, "world_size": 8, "strategy": "full"},
    "hybrid": {"budget_bytes": 10**9, "world_size": 16, "strategy": "hybrid"},
    "grad-op": {"budget_bytes": 10**9, "world_size": 8, "strategy": "grad-op"},
    "ddp": {"budget_bytes": 10**9, "world_size": 4, "strategy": "ddp"},
    "accumulation": {"budget_bytes": 10**9, "world_size": 8, "strategy": "full",
                     "grad_accum_steps": 4},
}


@pytest.mark.parametrize("name", list(REQUESTS))
def test_every_candidate_survives_plan_and_back(facts, name):
    """``layout_of(to_plan(c)) == c.layout`` for every candidate and recipe, and the layout
    read back evaluates to the same ``predicted`` block."""
    choice = choice_for(facts, **REQUESTS[name])
    candidates = choice.result.ranked + choice.result.recipes
    assert len(candidates) > 1
    # the search's own settings; the winner may come from the sweep's (gradient sync "last")
    searched = choice.result.evaluator
    chosen = Evaluator(facts.graph, facts.analysis, choice.request.settings())
    for c in candidates:
        plan = to_plan(c, choice.request, facts)
        assert layout_of(plan, facts) == c.layout, c.name
        evaluator = chosen if c is choice.best else searched
        again = evaluator.evaluate(layout_of(plan, facts), c.name)
        assert predicted_block(again) == predicted_block(c), c.name


def test_an_offloaded_plan_reads_back_offloaded(facts):
    choice = choice_for(facts, budget_bytes=2 * 10**6, headroom_bytes=0, world_size=2,
                        strategy="full", allow_offload=True)
    assert choice.best.layout.offload
    plan = to_plan(choice.best, choice.request, facts)
    assert plan.offload and layout_of(plan, facts) == choice.best.layout


def test_an_explicit_strategy_is_never_replaced_by_an_offloaded_other(facts):
    """S3-03: DDP that does not fit is not rescued by an offloaded FSDP plan."""
    from fsdp_plan.common.errors import NoFeasiblePlan
    with pytest.raises(NoFeasiblePlan, match="no --strategy ddp plan fits"):
        choice_for(facts, budget_bytes=2 * 10**6, headroom_bytes=0, world_size=2,
                   strategy="ddp", allow_offload=True)


def test_the_package_face_and_the_search_import_no_torch():
    """``import fsdp_plan`` and a search over saved facts never import torch."""
    code = ("import sys, json; from functools import partial; import fsdp_plan\n"
            "from fsdp_plan import ModelFacts, ModelSource, PlanRequest, plan_from_facts\n"
            f"facts = ModelFacts.from_json(open({str(FIXTURE)!r}).read())\n"
            "r = plan_from_facts(facts, PlanRequest(source=ModelSource(source='m.py', "
            "seq_len=64), budget_bytes=10**9, world_size=8))\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n"
            "print(r.plan.strategy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
