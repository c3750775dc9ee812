"""The frontier reuses the planner's search (issue 29): the planner's evaluator, its caches and
every plan it evaluated serve every budget ([Note: evaluations across budgets] in
search/evaluator.py), and the best plan at each budget is the one re-planning there chooses."""

from __future__ import annotations

from pathlib import Path

import pytest

from fsdp_plan.api import plan_from_facts
from fsdp_plan.facts.types import ModelFacts
from fsdp_plan.model.source import ModelSource
from fsdp_plan.search.frontier import Variant, compute_frontier
from fsdp_plan.search.request import PlanRequest

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "tiny_llama_facts.json"
SOURCE = ModelSource(source=str(ROOT / "examples" / "llama.py"), args={"size": "tiny"},
                     batch_size=2, seq_len=64)


@pytest.fixture(scope="module")
def facts() -> ModelFacts:
    return ModelFacts.from_json(FIXTURE.read_text())


@pytest.mark.parametrize("strategy", ["full", "auto"])
def test_every_frontier_point_is_the_plan_made_at_its_budget(facts, strategy):
    request = PlanRequest(source=SOURCE, budget_bytes=3_000_000, world_size=4,
                          strategy=strategy)
    here = plan_from_facts(facts, request)
    variant = Variant(micro_batch=2, grad_accum_steps=1, facts=facts)
    reused = compute_frontier([variant], request.settings(), seq_len=64,
                              evaluator=here.evaluator)
    fresh = compute_frontier([variant], request.settings(), seq_len=64)
    assert reused.points == fresh.points
    # the planner's own evaluations are not evaluated again
    assert reused.plans_evaluated < fresh.plans_evaluated
    fitting = [p for p in reused.points if p.fits]
    assert len(fitting) >= 3
    for point in fitting:
        again = plan_from_facts(facts, PlanRequest(source=SOURCE, budget_bytes=point.budget_bytes,
                                                   world_size=4, strategy=strategy))
        assert (again.best.name, again.best.time.step_s, again.best.memory.peak_bytes) == (
            point.name, point.step_s, point.peak_bytes)
    assert not [p for p in reused.points if not p.fits and p.budget_bytes >= fitting[0].budget_bytes]


def test_an_evaluator_at_another_budget_answers_from_what_was_evaluated(facts):
    request = PlanRequest(source=SOURCE, budget_bytes=3_000_000, world_size=4, strategy="full")
    here = plan_from_facts(facts, request)
    evaluator = here.evaluator
    before = evaluator.evaluations
    best = here.best
    larger = evaluator.with_budget(10**12, 10**11)
    again = larger.evaluate(best.layout, best.name)
    assert evaluator.evaluations == before  # nothing computed
    assert again.memory is best.memory and again.fits
    tiny = evaluator.with_budget(1000, 100)
    assert not tiny.evaluate(best.layout, best.name).fits
    # the planner's own evaluator computes afresh: its callers get their own candidates
    assert evaluator.evaluate(best.layout, best.name) is not best
