"""Candidate -> Plan and Plan -> Layout: the one writer of a plan document and its inverse.

``to_plan`` writes the choice of the search and the micro-batch sweep (search/batching.py) as
SPEC's plan: units, checkpointing, prefetch lists, mixed precision, DDP's arguments, offload,
accumulation, the version and the ``predicted`` block. ``layout_of`` reads a plan (written by
``to_plan``, tuned, or by hand) back into the ``Layout`` the evaluator takes, refusing what the
models cannot predict; ``layout_of(to_plan(c)) == c.layout``.
"""

from __future__ import annotations

from typing import Any

from fsdp_plan.common.errors import BadInput
from fsdp_plan.cost.ddp_buckets import DDPConfig
from fsdp_plan.cost.hardware import Hardware
from fsdp_plan.cost.hardware.stored import stored_block
from fsdp_plan.cost.step_time import step_phases
from fsdp_plan.cost.units import unit_mixed_precision
from fsdp_plan.facts.checkpointing import DEFAULT_SELECTIVE_OPS, modes_mapping
from fsdp_plan.facts.types import ModelFacts
from fsdp_plan.plan.document import Mesh, Plan, Unit
from fsdp_plan.plan.prefetch import prefetch_depths, prefetch_maps
from fsdp_plan.plan.schema import needed_version
from fsdp_plan.plan.sections import CompiledBlocks, ModelRecipe, Offload, PlanPrecision
from fsdp_plan.search.batching import throughput
from fsdp_plan.search.candidate import Candidate, DDPDetail, Layout, OffloadDetail
from fsdp_plan.search.request import PlanRequest


def to_plan(best: Candidate, request: PlanRequest, facts: ModelFacts, *, digest: str = "",
            notes: list[str] | None = None, global_batch_size: int | None = None) -> Plan:
    """The SPEC plan document for ``best`` evaluated under ``request`` (as the micro-batch
    sweep chose it: micro-batch, accumulation, gradient sync, reduce dtype) on ``facts``."""
    selective_ops = facts.analysis.selective_ops
    forward, backward = prefetch_maps([u.key for u in best.units], best.forward_prefetch,
                                      best.backward_prefetch)
    offload = isinstance(best.detail, OffloadDetail)
    plan = Plan(
        model=ModelRecipe.from_dict({**request.source.to_plan_dict(),
                                     "params": facts.graph.total_numel, "digest": digest or None,
                                     "notes": list(notes) if notes else None}),
        budget_bytes=request.budget_bytes, headroom_bytes=int(request.headroom_bytes or 0),
        world_size=request.world_size, gpus_per_node=request.gpus_per_node, mesh=Mesh(replicate=best.replicate, shard=best.shard),
        strategy=best.strategy,
        units=[Unit(modules=u.modules, reshard_after_forward=u.reshard_after_forward,
                    mixed_precision=unit_mixed_precision(u, request.param_dtype))
               for u in best.units],
        activation_checkpointing=(
            modes_mapping(best.checkpointed, [b for b in best.checkpointed
                                              if b not in best.selective], best.selective)
            if best.selective else best.checkpointed),
        selective_ops=list(selective_ops or DEFAULT_SELECTIVE_OPS) if best.selective else [],
        selective_mm_stride=best.layout.selective_mm_stride if best.selective else 1,
        framework=request.framework,
        forward_prefetch=forward, backward_prefetch=backward,
        mixed_precision=PlanPrecision(param_dtype=request.param_dtype,
                                      reduce_dtype=request.reduce_dtype,
                                      autocast_dtype=request.autocast_dtype or None),
        optimizer=request.optimizer, gpu=request.hardware.name,
        hardware=stored_block(request.hardware, request.hardware_origin),
        predicted=predicted_block(best),
        ddp=best.detail.config if isinstance(best.detail, DDPDetail) else None,
        grad_accum_steps=request.grad_accum_steps,
        gradient_sync=request.gradient_sync if request.grad_accum_steps > 1 else "every",
        offload=Offload() if offload else None,
        optimizer_overlap=best.layout.optimizer_overlap,
        compile=CompiledBlocks(modules=tuple(facts.graph.blocks),
                               activation_memory_budget=request.activation_memory_budget)
        if request.compile_blocks else None,
    )
    plan.fsdp_plan_version = needed_version(plan.to_dict())  # plan/schema.py: one version rule
    plan.predicted.update(throughput_fields(best, facts, plan, request.hardware))
    if global_batch_size:
        plan.predicted["global_batch_size"] = global_batch_size
    return plan


def throughput_fields(candidate: Candidate, facts: ModelFacts, plan: Plan,
                      hardware: Hardware) -> dict[str, float]:
    """``predicted.tokens_per_s`` (per GPU) and ``predicted.mfu`` of ``candidate`` run as
    ``plan`` says (its micro-batch, sequence and accumulation; search/batching.py
    ``throughput``) on ``hardware``."""
    rate = throughput(candidate, facts, micro_batch=plan.model.batch_size,
                      seq_len=plan.model.seq_len, grad_accum_steps=plan.grad_accum_steps,
                      peak_flops=hardware.peak_flops)
    return {"tokens_per_s": round(rate.tokens_per_s, 3), "mfu": round(rate.mfu, 4)}


def predicted_block(candidate: Candidate) -> dict[str, Any]:
    """The plan file's ``predicted`` mapping for an evaluated candidate (SPEC section 3): a
    DDP plan adds its gradient buckets (SPEC 6), an offloaded one its host bytes."""
    block = _fsdp_predicted_block(candidate)
    match candidate.detail:
        case DDPDetail(buckets=buckets):
            block["buckets"] = [int(b.nbytes) for b in buckets]
            block["comm_tail_s"] = round(candidate.time.exposed_comm_s, 6)
        case OffloadDetail(host_bytes=host):
            block["host_bytes"] = dict(host)
    return block


def _fsdp_predicted_block(candidate: Candidate) -> dict[str, Any]:
    return {
        "peak_bytes": int(candidate.memory.peak_bytes),
        "collectives_per_step": candidate.collectives,
        "collectives_per_step_fsdp1": candidate.collectives_fsdp1,
        "step_time_s": round(candidate.time.step_s, 6),
        "exposed_comm_s": round(candidate.time.exposed_comm_s, 6),
        "comm_tail_s": round(candidate.time.comm_tail_s, 6),
        "hidden_comm_s": round(candidate.time.hidden_comm_s, 6),
        "phases_s": {k: round(v, 6) for k, v in step_phases(candidate.time).items()},
        "compute_s": round(candidate.time.compute_s, 6),
        "total_comm_s": round(candidate.time.total_comm_s, 6),
        "peak_phase": candidate.memory.phase,
        "breakdown": {k: int(v) for k, v in candidate.memory.breakdown.items()},
        "units": [{"key": u.key, "params": u.numel, "shard_numel": u.shard_numel}
                  for u in candidate.units],
        **({"activation_checkpointing": _checkpointing_summary(candidate)}
           if candidate.checkpointed else {}),
    }


def _checkpointing_summary(candidate: Candidate) -> dict[str, Any]:
    """Blocks per mode, activation bytes saved and recompute seconds (all blocks, per rank)."""
    modes = candidate.block_modes
    return {"full": sum(m.mode == "full" for m in modes),
            "selective": sum(m.mode == "selective" for m in modes),
            "saved_bytes": int(sum(m.saved_bytes for m in modes)),
            "recompute_s": round(sum(m.recompute_s for m in modes), 6)}


def layout_of(plan: Plan, facts: ModelFacts) -> Layout:
    """The layout ``plan`` applies, for ``Evaluator.evaluate``; ``BadInput`` for what the models
    cannot predict (modules the model lacks, checkpointing of non-blocks, non-uniform
    prefetch, a selective op list other than the analysed one)."""
    graph = facts.graph
    if plan.strategy == "ddp":  # one replicated model and its gradient buckets
        if plan.activation_checkpointing:
            raise BadInput("the DDP plan checkpoints modules; fsdp-plan predicts DDP plans "
                           "without activation checkpointing only: remove "
                           "activation_checkpointing.")
        return Layout(strategy="ddp", mesh=(plan.world_size, 1),
                      ddp=plan.ddp or DDPConfig(), optimizer_overlap=plan.optimizer_overlap)
    units = list(plan.units)
    if not units or units[-1].modules != [""]:
        raise BadInput("the plan's last unit must be the root (modules: [\"\"]); FSDP2 needs the "
                       "root to be a unit.")
    missing = sorted({m for u in units for m in u.modules if m not in graph.modules}
                     | {m for m in plan.activation_checkpointing if m not in graph.modules})
    if missing:
        raise BadInput(f"the plan names modules the model does not have: {missing[:5]}"
                       + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
                       + "; was it written for this model?")
    block_index = {b: i for i, b in enumerate(graph.blocks)}
    not_blocks = [m for m in plan.activation_checkpointing if m not in block_index]
    if not_blocks:
        raise BadInput(f"the plan checkpoints {not_blocks[:3]}, which are not repeated blocks "
                       f"({_block_example(graph.blocks)}); fsdp-plan models activation "
                       "checkpointing of whole repeated blocks only.")
    modes = (dict(plan.activation_checkpointing) if isinstance(plan.activation_checkpointing, dict)
             else {m: "full" for m in plan.activation_checkpointing})
    checkpoint = frozenset(block_index[m] for m, mode in modes.items() if mode == "full")
    selective = frozenset(block_index[m] for m, mode in modes.items() if mode == "selective")
    if checkpoint and facts.analysis.checkpointed_timeline is None:
        raise BadInput("the plan checkpoints blocks, but this model's blocks could not be traced "
                       "with checkpointing, so their memory cannot be predicted.")
    if selective and facts.analysis.selective_timeline is None:
        raise BadInput("the plan checkpoints blocks selectively, but "
                       + (facts.analysis.selective_unavailable
                          or "this model's blocks could not be traced with selective checkpointing")
                       + "; write full for those blocks.")
    if selective and facts.analysis.with_selective_stride(plan.selective_mm_stride) is None:
        raise BadInput(f"the plan saves every {plan.selective_mm_stride}th matmul of its "
                       "selective blocks (selective_mm_stride), but the model was analysed at "
                       f"stride {facts.analysis.selective_mm_stride} only; analyse it as the "
                       "plan says (fsdp-plan predict PLAN.yaml does).")
    if selective and sorted(plan.selective_ops) != sorted(facts.analysis.selective_ops):
        raise BadInput("the plan's selective_ops differ from the ops fsdp-plan analysed "
                       f"({', '.join(facts.analysis.selective_ops)}); fsdp-plan predicts selective "
                       "checkpointing with that list only. Write it as fsdp-plan does.")
    forward_depth, backward_depth = prefetch_depths(plan)
    return Layout(strategy=plan.strategy, mesh=(plan.mesh.replicate, plan.mesh.shard),
                  groups=tuple(tuple(u.modules) for u in units[:-1]),
                  reshard=tuple(u.reshard_after_forward for u in units[:-1]),
                  root_reshard=units[-1].reshard_after_forward, full=checkpoint,
                  selective=selective - checkpoint, forward_prefetch=forward_depth,
                  backward_prefetch=backward_depth,
                  offload=plan.offload is not None,
                  selective_mm_stride=plan.selective_mm_stride if selective else 1,
                  optimizer_overlap=plan.optimizer_overlap)


def _block_example(blocks: list[str]) -> str:
    if not blocks:
        return "this model has none"
    return f"{blocks[0]} ... {blocks[-1]}" if len(blocks) > 1 else blocks[0]
