"""``--compile auto``: plan eager and compiled blocks on the same facts and keep the better.

[Note: choosing compile]
The analysis of a ``--compile`` request holds everything an eager plan needs (the eager
passes) plus each block class's compiled partitions (facts/compiled.py); dropping the
partitions gives the eager facts, so both searches run on one analysis. Each runs the whole
sweep (micro-batch, accumulation, reduce dtype) with its own strategies (eager may choose
DDP; compiled plans are FSDP2). The plan kept is the one with more tokens per second among
those that fit; a tie keeps the lower peak. The report's first reason says what compile buys
for this model and budget: the step time and peak of both bests, and which was kept.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from fsdp_plan.common.errors import NoFeasiblePlan
from fsdp_plan.common.sizes import format_bytes
from fsdp_plan.facts.types import ModelFacts
from fsdp_plan.search.batching import BatchChoice, choose_batch
from fsdp_plan.search.request import PlanRequest


def eager_facts(facts: ModelFacts) -> ModelFacts:
    """``facts`` without the compiled partitions: the eager model of the same analysis."""
    if facts.analysis.compiled is None:
        return facts
    return dataclasses.replace(facts, analysis=dataclasses.replace(facts.analysis,
                                                                   compiled=None))


def eager_request(request: PlanRequest) -> PlanRequest:
    """``request`` for eager blocks."""
    return dataclasses.replace(request, compile_blocks=False, activation_memory_budget=None,
                               search=dataclasses.replace(request.search, compile_auto=False))


def compare_compile(request: PlanRequest, facts_at: Callable[[int], ModelFacts],
                    search_for: Callable[[PlanRequest], Callable]) -> BatchChoice:
    """The better of the eager and compiled sweeps ([Note: choosing compile]); raises the
    compiled sweep's ``NoFeasiblePlan`` when neither fits."""
    plain = eager_request(request)
    choices: dict[str, BatchChoice] = {}
    errors: dict[str, NoFeasiblePlan] = {}
    for name, req, at in (("compiled", request, facts_at),
                          ("eager", plain, lambda b: eager_facts(facts_at(b)))):
        try:
            choices[name] = choose_batch(req, facts_at=at, search=search_for(req))
        except NoFeasiblePlan as e:
            errors[name] = e
    if not choices:
        raise errors["compiled"]
    if len(choices) == 1:
        (name, only), = choices.items()
        other = "eager" if name == "compiled" else "compiled"
        only.reasons.insert(0, f"compile: {name} blocks, since no {other} plan fits "
                               f"({_stats(only)})")
        return only
    comp, eager = choices["compiled"], choices["eager"]

    def key(c: BatchChoice) -> tuple[float, float]:
        return (-c.throughput.tokens_per_s, c.best.memory.peak_bytes)

    kept = comp if key(comp) <= key(eager) else eager
    gain = comp.throughput.tokens_per_s / max(eager.throughput.tokens_per_s, 1e-12) - 1
    saved = eager.best.memory.peak_bytes - comp.best.memory.peak_bytes
    kept.reasons.insert(0, (
        f"compile: compiled blocks {_stats(comp)}; eager {_stats(eager)}: compile buys "
        f"{gain:+.1%} tokens/s and {format_bytes(saved)} less peak at this budget; "
        f"kept {'compiled' if kept is comp else 'eager'}"))
    return kept


def _stats(c: BatchChoice) -> str:
    best = c.best
    return (f"step {best.time.step_s:.4g} s, peak {format_bytes(best.memory.peak_bytes)}, "
            f"{c.throughput.tokens_per_s:,.0f} tokens/s per GPU ({best.name})")
