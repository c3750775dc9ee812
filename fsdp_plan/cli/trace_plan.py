"""``fsdp-plan trace --plan P.yaml [MODEL]``: the plan's prediction beside the measured figures,
and the ``bucket_cap_mb`` that built the DDP buckets the trace shows."""

from __future__ import annotations

from typing import Any

from fsdp_plan.api import facts_for_plan
from fsdp_plan.cost.ddp_buckets import grad_parameters, rebuilt_order
from fsdp_plan.facts.cache import FactsCache
from fsdp_plan.measure.bucket_cap import cap_that_built
from fsdp_plan.measure.trace_ranks import TraceAnalysis
from fsdp_plan.plan.document import Plan, read_plan


def predicted_figures(plan: Plan) -> dict[str, Any]:
    """The plan's ``predicted`` block in the trace document's names (seconds per step)."""
    p = plan.predicted or {}
    phases = p.get("phases_s") or {}
    step = {"step_s": p.get("step_time_s"), "forward_s": phases.get("forward"),
            "backward_s": phases.get("backward"), "optimizer_s": phases.get("optimizer"),
            "comm_tail_s": p.get("comm_tail_s"), "comm_s": p.get("total_comm_s"),
            "hidden_comm_s": p.get("hidden_comm_s"), "exposed_comm_s": p.get("exposed_comm_s")}
    return {"step": {k: v for k, v in step.items() if v is not None},
            "collectives_per_step": p.get("collectives_per_step"),
            "ddp_buckets": p.get("buckets"), "strategy": plan.strategy,
            "world_size": plan.world_size}


def ready_ordered_sizes(plan: Plan, plan_path: str, model: str | None,
                        facts_cache: FactsCache | None = None) -> list[int]:
    """The gradients' bytes in the order DDP's reducer records them ready, from the model's
    facts (cost/ddp_buckets.py [Note: gradient ready order]; kept in ``facts_cache``)."""
    facts = facts_for_plan(plan, model=model, plan_path=plan_path, facts_cache=facts_cache)
    params = grad_parameters(facts.graph, facts.analysis.timeline.events)
    return [p.nbytes for p in rebuilt_order(facts.graph, params)]


def attach_plan(analysis: TraceAnalysis, plan_path: str, model: str | None,
                facts_cache: FactsCache | None = None) -> None:
    """Fill ``predicted`` and, for a trace with DDP buckets, ``bucket_cap_mb`` (the model's
    facts read from ``facts_cache`` where kept)."""
    plan = read_plan(plan_path)
    analysis.predicted = predicted_figures(plan)
    measured = next((r.ddp_buckets for r in analysis.ranks if r.ddp_buckets), [])
    if not measured or any(b.bytes is None for b in measured):
        return
    sizes = ready_ordered_sizes(plan, plan_path, model, facts_cache)
    found = cap_that_built(sizes, [b.bytes for b in measured])
    if found is not None:
        analysis.bucket_cap_mb, interval = found
        if interval is not None:
            analysis.predicted["bucket_cap_mb_range"] = [round(interval[0], 6),
                                                         round(interval[1], 6)]
