"""The frontier reuses the planner's search (issue 29): the planner's evaluator, its caches and
every plan it evaluated serve every budget ([Note: evaluations across budgets] in
search/evaluator.py), and the best plan at each budget is the one re-planning there chooses."""

from __future__ import annotations

import sys

import pytest
from layouts import TINY_LLAMA, tiny_llama_facts

from fsdp_plan.api import plan_from_facts
from fsdp_plan.facts.types import ModelFacts
from fsdp_plan.search.frontier import Variant, compute_frontier
from fsdp_plan.search.request import PlanRequest

SOURCE = TINY_LLAMA


@pytest.fixture(scope="module")
def facts() -> ModelFacts:
    return tiny_llama_facts()


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


def _along_paths(evaluator) -> list[list[tuple[int, float, int]]]:
    """Every evaluated checkpointing path point, per layout and path: (index, step, peak)."""
    paths = evaluator.checkpoint_options()
    out = []
    for met in evaluator.checkpointing_met.values():
        for path in paths:
            where = {counts: i for i, counts in enumerate(path)}
            out.append(sorted((where[c], cand.time.step_s, cand.memory.peak_bytes)
                              for c, (cand, _) in met.items() if c in where))
    return [points for points in out if len(points) > 1]


@pytest.mark.parametrize("world_size", [4, 8, 16])
def test_the_step_never_falls_along_a_checkpointing_path(facts, world_size):
    """What [Note: bounded frontier searches] rests on: each point further along a path
    recomputes more, so no point steps faster than one before it."""
    request = PlanRequest(source=SOURCE, budget_bytes=3_000_000, world_size=world_size,
                          strategy="auto")
    here = plan_from_facts(facts, request)
    variant = Variant(micro_batch=2, grad_accum_steps=1, facts=facts)
    compute_frontier([variant], request.settings(), seq_len=64, evaluator=here.evaluator)
    along = _along_paths(here.evaluator)
    assert sum(len(points) for points in along) > 50
    for points in along:  # at ``rank``'s rounding (the clock's sums differ in the last bit)
        steps = [round(step, 9) for _, step, _ in points]
        assert steps == sorted(steps), points


class _Point:
    """A stand-in for a candidate on a path: a peak, a step, and whether it fits."""

    def __init__(self, index: int, peak: int, limit: int) -> None:
        self.index = index
        self.memory = type("M", (), {"peak_bytes": peak})()
        self.time = type("T", (), {"step_s": 1.0 + index})()
        self.fits = peak <= limit


@pytest.mark.parametrize("limit", [5, 100, 333, 500, 777, 999, 1010])
@pytest.mark.parametrize("shape", ["line", "convex", "steps"])
def test_a_bracketed_interpolated_search_answers_as_the_binary_search(limit, shape):
    from fsdp_plan.search.fsdp import fewest_checkpointed
    n = 60
    peak = {"line": lambda i: 1000 - 16 * i, "convex": lambda i: 40 + (60 - i) ** 2 // 4,
            "steps": lambda i: 1000 - 200 * (i // 12)}[shape]
    ks = [(0, i) for i in range(n)]
    probes: list[int] = []

    def at(counts):
        probes.append(counts[1])
        return _Point(counts[1], peak(counts[1]), limit)
    plain, plain_at = fewest_checkpointed(at, ks, None)
    plain_probes = len(probes)
    # another budget's search met a few points (judged at this limit)
    known = [(i, _Point(i, peak(i), limit)) for i in (7, 19, 31, 44)]
    probes.clear()
    bounded, bounded_at = fewest_checkpointed(at, ks, None, known=known, limit_bytes=limit)
    assert (bounded.index if bounded_at is not None else None) == (
        plain.index if plain_at is not None else None)
    assert bounded_at == plain_at
    assert len(probes) <= plain_probes
    if shape == "line" and plain_at not in (None, 0):
        assert len(probes) <= 4  # the two path ends, the line's guess and its neighbour


@pytest.mark.parametrize("budget", [3_000_000, 4_000_000, 6_000_000])
@pytest.mark.parametrize("world_size", [4, 8, 16])
def test_the_more_memory_line_searches_only_the_budgets_it_reads(facts, monkeypatch, budget,
                                                                  world_size):
    """[Note: the more-memory line's budgets]: the report's line stops at the first round
    budget that pays, with the same line as the whole grid above the user's budget, and never
    more evaluations."""
    from fsdp_plan.common.errors import NoFeasiblePlan
    from fsdp_plan.search import frontier as frontier_module

    request = PlanRequest(source=SOURCE, budget_bytes=budget, world_size=world_size,
                          strategy="auto")
    try:
        plan_from_facts(facts, request)
    except NoFeasiblePlan:
        pytest.skip("nothing fits this budget")
    variant = Variant(micro_batch=2, grad_accum_steps=1, facts=facts)

    def line(count: int) -> tuple[str, int, int]:
        found = compute_frontier([variant], request.settings(), seq_len=64, count=count,
                                 above_only=True)
        return frontier_module.more_memory_line(found), len(found.points), found.plans_evaluated

    stopped = False
    for count in (3, 10):
        short = line(count)
        monkeypatch.setattr(frontier_module, "_line_settled", lambda *a: False)
        whole = line(count)
        monkeypatch.undo()
        assert short[0] == whole[0]
        assert short[1] <= whole[1] and short[2] <= whole[2]
        stopped |= short[1] < whole[1]
    if (world_size, budget) == (4, 3_000_000):  # its first round budget pays: the rest unsearched
        assert stopped and "more memory: at " in short[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="forks only on Linux")
@pytest.mark.parametrize("spare", [1, 3])
def test_the_pages_budgets_searched_beside_the_planner_give_the_same_frontier(facts, monkeypatch,
                                                                            spare):
    """[Note: the page's budgets beside the planner]: forked children search the later round
    budgets; every point is the one the planner alone finds, and what the children searched
    and evaluated is counted."""
    from fsdp_plan.facts import forked
    from fsdp_plan.search import frontier as frontier_module

    request = PlanRequest(source=SOURCE, budget_bytes=3_000_000, world_size=4, strategy="auto")
    variant = Variant(micro_batch=2, grad_accum_steps=1, facts=facts)
    monkeypatch.setattr(forked, "forking_allowed", lambda: False)
    alone = compute_frontier([variant], request.settings(), seq_len=64)
    monkeypatch.setattr(forked, "forking_allowed", lambda: True)
    monkeypatch.setattr(forked, "spare_cpus", lambda: spare)
    elsewhere = []
    searched = frontier_module._Searcher.points_beside

    def counted(self, budgets):
        found = searched(self, budgets)
        elsewhere.append(self._evaluated_elsewhere)
        return found
    monkeypatch.setattr(frontier_module._Searcher, "points_beside", counted)
    beside = compute_frontier([variant], request.settings(), seq_len=64)
    assert elsewhere and elsewhere[0] > 0, "no child searched a budget"
    assert beside.points == alone.points and len(alone.points) >= 5
    assert beside.searches == alone.searches
    assert beside.plans_evaluated >= alone.plans_evaluated > 0
