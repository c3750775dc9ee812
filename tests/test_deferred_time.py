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



@pytest.mark.parametrize("overlap", [False, True], ids=["optimizer-after", "optimizer-overlap"])
def test_the_search_clock_keeps_no_spans_and_makes_the_same_ones_when_read(
        facts, monkeypatch, overlap):
    """[Note: spans when read]: a step time from the search's clock holds ``DeferredSpans``,
    which run nothing until read and are then exactly the spans the same evaluation keeps
    when its clock keeps them (optimizer stepped in backward too); they pickle and copy as
    that list, and a forward cached by a clock that kept none is not continued by one that
    keeps them."""
    import copy

    from fsdp_plan.cost import unit_time
    from fsdp_plan.cost.step_time import simulate_step
    from fsdp_plan.cost.streams import DeferredSpans

    request = PlanRequest(source=TINY_LLAMA, budget_bytes=3_000_000, world_size=4,
                          strategy="full", optimizer_overlap=overlap)
    result = plan_from_facts(facts, request)
    evaluator = result.evaluator
    timed = [c for c, _ in evaluator._seen.values()
             if c.strategy != "ddp" and c.deferred_time.computed]
    assert timed and all(isinstance(c.time.spans, DeferredSpans) for c in timed)
    # the chosen plan's were read (its phases, in the plan); the others' never ran
    assert [c for c in timed if not c.time.spans._spans.computed]
    assert not overlap or any(c.layout.optimizer_overlap for c in timed)

    def keeping(*args, **kwargs):  # the clock as it ran before it deferred its spans
        kwargs["record_spans"] = True
        return simulate_step(*args, **kwargs)
    monkeypatch.setattr(unit_time, "simulate_step", keeping)
    for c in timed:
        spans = c.time.spans
        kept = Evaluator(facts.graph, facts.analysis, evaluator.settings).evaluate(
            c.layout, c.name).time
        assert isinstance(kept.spans, list) and kept.spans
        assert spans == kept.spans and kept.spans == spans and len(spans) == len(kept.spans)
        assert list(spans) == kept.spans and spans[-1] == kept.spans[-1]
        assert repr(spans) == repr(kept.spans) and c.time == kept  # every field
        assert pickle.loads(pickle.dumps(spans)) == kept.spans
        assert type(pickle.loads(pickle.dumps(spans))) is list
        assert type(copy.deepcopy(spans)) is list
    monkeypatch.undo()
    # a clock keeping spans does not continue a forward cached by one that kept none
    ordered, _ = evaluator.clock.ordered_costs(
        timed[0].units, shard=timed[0].shard, replicate=timed[0].replicate, recompute={},
        optimizer_overlap=False, layout_key=None)
    hw, quiet = evaluator.clock.setup.hardware, {}
    first = simulate_step(ordered, hw, forward_prefetch=1, forwards=quiet, record_spans=False)
    again = simulate_step(ordered, hw, forward_prefetch=1, forwards=quiet)
    alone = simulate_step(ordered, hw, forward_prefetch=1)
    assert again.spans == alone.spans and first.spans == alone.spans
    assert any(label.startswith("FW ") for _, label, _, _ in again.spans)


def test_ddp_candidates_make_the_same_spans_when_read(facts, monkeypatch):
    """DDP's clock in the search keeps no spans either ([Note: spans when read]): each DDP
    candidate's spans, read late, are those the same evaluation keeps when its clock keeps
    them, and candidates that share a simulated bucket layout each read their own list."""
    from fsdp_plan.cost import ddp_buckets
    from fsdp_plan.cost.streams import DeferredSpans

    request = PlanRequest(source=TINY_LLAMA, budget_bytes=10**12, world_size=4, strategy="ddp")
    result = plan_from_facts(facts, request)
    evaluator = result.evaluator
    ddp = [c for c, _ in evaluator._seen.values() if c.strategy == "ddp"]
    assert len(ddp) >= 2 and all(isinstance(c.time.spans, DeferredSpans) for c in ddp)
    simulate = ddp_buckets.ddp_step_time
    kept: list = []

    def keeping(*args, **kwargs):  # the clock as it ran before it deferred its spans
        kwargs["record_spans"] = True
        step, ready = simulate(*args, **kwargs)
        kept.append(list(step.spans))
        return step, ready
    monkeypatch.setattr(ddp_buckets, "ddp_step_time", keeping)
    for c in ddp:
        kept.clear()
        again = Evaluator(facts.graph, facts.analysis, evaluator.settings).evaluate(
            c.layout, c.name).time
        assert len(kept) == 1 and kept[0]  # the one run, keeping its spans
        assert c.time.spans == kept[0] and repr(c.time.spans) == repr(kept[0])
        assert dataclasses.replace(c.time, spans=[]) == dataclasses.replace(again, spans=[])
        assert any(label.startswith("AR bucket") for _, label, _, _ in c.time.spans)
    lists = [c.time.spans._list() for c in ddp]
    assert len({id(x) for x in lists}) == len(lists)  # each its own list
