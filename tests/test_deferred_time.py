"""A candidate's step time is simulated when first read ([Note: step times when asked] in
fsdp_plan/common/deferred.py): the search leaves the time of a plan that does not fit
uncomputed, and a time computed late equals the one computed at once. Fixture-level (the tiny
Llama facts), no torch model."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
from layouts import TINY_LLAMA, tiny_llama_facts

from fsdp_plan.api import plan_from_facts
from fsdp_plan.common.deferred import Deferred
from fsdp_plan.cost.unit_time import unit_step_time
from fsdp_plan.facts.types import ModelFacts
from fsdp_plan.search.evaluator import Evaluator
from fsdp_plan.search.request import PlanRequest


@pytest.fixture(scope="module")
def facts() -> ModelFacts:
    return tiny_llama_facts()


def test_a_deferred_value_is_computed_once_for_every_copy():
    calls = []

    @dataclasses.dataclass
    class Holder:
        value: Deferred[int]
        tag: str = ""

    held = Holder(Deferred(lambda: calls.append(1) or 42))
    copy = dataclasses.replace(held, tag="copy")
    assert not held.value.computed and calls == []
    assert copy.value.get() == 42 and held.value.get() == 42 and calls == [1]
    assert Deferred.known(42) == held.value and Deferred.known(41) != held.value
    assert pickle.loads(pickle.dumps(Deferred(lambda: 7))).get() == 7  # the value, not the lambda
    assert repr(Deferred(lambda: 3)) == "Deferred(3)"


def test_the_search_leaves_what_does_not_fit_untimed_and_a_late_time_is_the_same(facts):
    request = PlanRequest(source=TINY_LLAMA, budget_bytes=3_000_000, world_size=4, strategy="full")
    result = plan_from_facts(facts, request)
    evaluator = result.evaluator
    seen = [c for c, _ in evaluator._seen.values()]
    sharded = [c for c in seen if c.strategy != "ddp"]
    untimed = [c for c in sharded if not c.deferred_time.computed]
    assert result.best.deferred_time.computed
    assert all(c.deferred_time.computed for c in sharded if c.fits)  # ranked by their step
    assert untimed and not any(c.fits for c in untimed)
    # computed now, after every other evaluation, each equals its layout's time on a fresh
    # evaluator, read at once
    for c in untimed:
        fresh = Evaluator(facts.graph, facts.analysis, evaluator.settings)
        assert c.time == fresh.evaluate(c.layout, c.name).time
    # and the clock's own answer for the chosen plan, recomputed from its parts
    best = result.best
    again = unit_step_time(
        evaluator.clock, best.units, shard=best.shard, replicate=best.replicate,
        recompute={m.block: (m.recompute_s, m.recompute_host_s) for m in best.block_modes},
        forward_prefetch=best.forward_prefetch, backward_prefetch=best.backward_prefetch,
        optimizer_overlap=best.layout.optimizer_overlap)
    assert again == best.time
