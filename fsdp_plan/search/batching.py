"""Choices that trade memory or numerics for tokens per second: micro-batch size, gradient
accumulation, when gradients are reduced, and the reduction dtype (issue 11).

[Note: choosing for throughput]
Users have a global batch (samples per optimizer step over all data-parallel ranks) and want
the most tokens per second per GPU that reaches it. For each micro-batch size ``b`` dividing
the per-rank batch, the model is analysed once at ``b`` (activations and FLOPs scale with it)
and searched with ``k = per-rank batch / b`` accumulation steps; larger micro-batches run
matmuls more efficiently and issue fewer collectives per sample but hold more activations,
so they are tried smallest first and the loop stops at the first that fits nowhere. For the
best plan of each ``b`` the same layout is evaluated again with gradients reduced only after
the last micro-batch (``gradient_sync: last``: no reduce-scatter in the earlier ones, but
every unsharded gradient held in between), and the faster of the two that fits is kept.
``--reduce-dtype auto`` searches with float32 and bfloat16 reduction and takes bfloat16 only
when it is at least ``REDUCE_DTYPE_GAIN`` faster: it halves reduce-scatter bytes at a cost
in gradient precision the user opted into. The plan with the most tokens per second per GPU
wins; every option's figures are kept for the report.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fsdp_plan.common.errors import BadInput, NoFeasiblePlan
from fsdp_plan.search.fsdp import Candidate, Evaluator

if TYPE_CHECKING:
    from fsdp_plan.api import PlanRequest, PlanResult, Progress
    from fsdp_plan.facts.types import ModelFacts

REDUCE_DTYPE_GAIN = 0.02
"""bfloat16 gradient reduction must beat float32 by this share of step time to be chosen."""
MAX_AUTO_MICRO_BATCH = 1 << 16


@dataclass(kw_only=True)
class BatchOption:
    """One micro-batch size tried for the global batch, with what it reached."""

    micro_batch: int
    grad_accum_steps: int
    gradient_sync: str = "every"
    reduce_dtype: str = "float32"
    fits: bool = False
    step_s: float = 0.0
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    peak_bytes: int = 0
    note: str = ""

    def row(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(kw_only=True)
class Throughput:
    """Tokens per second per GPU and model FLOPs utilisation of one optimizer step."""

    tokens_per_s: float
    mfu: float


def throughput(candidate: Candidate, facts: ModelFacts, *, micro_batch: int, seq_len: int,
               grad_accum_steps: int, peak_flops: float) -> Throughput:
    """``micro_batch * seq_len`` tokens per micro-batch and the analysed model FLOPs (forward
    and backward, recomputation excluded as MFU conventionally does) per rank, per step."""
    step = max(candidate.time.step_s, 1e-12)
    tokens = micro_batch * seq_len * grad_accum_steps
    flops = (facts.analysis.total_fw_flops + facts.analysis.total_bw_flops) * grad_accum_steps
    return Throughput(tokens_per_s=tokens / step, mfu=flops / step / peak_flops)


def evaluate_like(evaluator: Evaluator, candidate: Candidate, name: str) -> Candidate:
    """``candidate``'s layout, checkpointing and prefetch evaluated under ``evaluator``'s
    settings (another gradient sync, another reduce dtype)."""
    units = candidate.units
    index = {b: i for i, b in enumerate(evaluator.graph.blocks)}
    selective = frozenset(index[b] for b in getattr(candidate, "selective", []) or [])
    full = frozenset(index[b] for b in candidate.checkpointed if index[b] not in selective)
    return evaluator.evaluate(
        name=name, strategy=candidate.strategy, replicate=candidate.replicate,
        shard=candidate.shard, groups=[list(u.modules) for u in units[:-1]],
        reshard=[u.reshard_after_forward for u in units[:-1]],
        root_reshard=units[-1].reshard_after_forward, checkpoint=full, selective=selective,
        forward_prefetch=candidate.forward_prefetch, backward_prefetch=candidate.backward_prefetch)


def plan_with_choices(facts: ModelFacts, request: PlanRequest, *, digest: str = "",
                      notes: list[str] | None = None) -> PlanResult:
    """``plan_from_facts`` plus the reduce-dtype choice (``auto``) and, with accumulation,
    the gradient-sync choice; the plan records throughput and the reasons."""
    from fsdp_plan.api import plan_from_facts
    reasons: list[str] = []
    if request.reduce_dtype == "auto":
        results = {}
        for dtype in ("float32", "bfloat16"):
            try:
                results[dtype] = plan_from_facts(
                    facts, dataclasses.replace(request, reduce_dtype=dtype), digest=digest,
                    notes=notes)
            except NoFeasiblePlan:
                continue
        if not results:
            return plan_from_facts(facts, dataclasses.replace(request, reduce_dtype="bfloat16"),
                                   digest=digest, notes=notes)
        fp32, bf16 = results.get("float32"), results.get("bfloat16")
        if fp32 is None:
            result, chosen = bf16, "bfloat16"
            reasons.append("reduce in bfloat16: with float32 reduction no plan fits")
        elif bf16 is None or bf16.best.time.step_s > fp32.best.time.step_s * (
                1 - REDUCE_DTYPE_GAIN):
            result, chosen = fp32, "float32"
            gain = 0.0 if bf16 is None else 1 - bf16.best.time.step_s / fp32.best.time.step_s
            reasons.append(f"reduce in float32: bfloat16 would gain {gain:.1%} of step time, "
                           f"under the {REDUCE_DTYPE_GAIN:.0%} that pays for its precision loss")
        else:
            result, chosen = bf16, "bfloat16"
            reasons.append(f"reduce in bfloat16: step {bf16.best.time.step_s:.4g} s vs "
                           f"{fp32.best.time.step_s:.4g} s in float32 (reduce-scatter bytes "
                           "halved; gradients are summed in bfloat16, as --reduce-dtype auto "
                           "allows)")
        request = dataclasses.replace(request, reduce_dtype=chosen)
    else:
        result = plan_from_facts(facts, request, digest=digest, notes=notes)
    if request.grad_accum_steps > 1 and not getattr(result.best, "offload", None):
        result, request = _with_sync_choice(facts, request, result, reasons)
    _record(result, request, facts, reasons)
    return result


def _with_sync_choice(facts: ModelFacts, request: PlanRequest, result: PlanResult,
                      reasons: list[str]) -> tuple[PlanResult, PlanRequest]:
    """The faster of reducing after every micro-batch and only after the last, with the
    request that produced it."""
    from fsdp_plan.api import to_plan
    last_request = dataclasses.replace(request, gradient_sync="last")
    evaluator = Evaluator(facts.graph, facts.analysis, last_request.settings())
    other = evaluate_like(evaluator, result.best, result.best.name + " sync-last")
    every_s = result.best.time.step_s
    if other.fits and other.time.step_s < every_s:
        reasons.append(f"reduce gradients only after the last of {request.grad_accum_steps} "
                       f"micro-batches: step {other.time.step_s:.4g} s vs {every_s:.4g} s "
                       "reducing after every one (the held unsharded gradients fit)")
        plan = to_plan(other, last_request, numel=facts.graph.total_numel,
                       digest=str(result.plan.model.get("digest", "")),
                       selective_ops=facts.analysis.selective_ops)
        plan.model.update({k: v for k, v in result.plan.model.items() if k == "notes"})
        return dataclasses.replace(result, plan=plan, best=other,
                                   ranked=[other, *result.ranked]), last_request
    why = ("its held unsharded gradients do not fit" if not other.fits
           else f"it is not faster ({other.time.step_s:.4g} s vs {every_s:.4g} s)")
    reasons.append(f"reduce gradients after every micro-batch: reducing only after the last, "
                   f"{why}")
    return result, request


def _record(result: PlanResult, request: PlanRequest, facts: ModelFacts,
            reasons: list[str]) -> None:
    """Accumulation, throughput and the reasons for each choice, in the plan and result."""
    plan = result.plan
    plan.grad_accum_steps = request.grad_accum_steps
    plan.gradient_sync = request.gradient_sync if request.grad_accum_steps > 1 else "every"
    if plan.grad_accum_steps > 1:
        plan.fsdp_plan_version = 2
    rate = throughput(result.best, facts, micro_batch=request.source.batch_size,
                      seq_len=request.source.seq_len, grad_accum_steps=request.grad_accum_steps,
                      peak_flops=request.hardware.peak_flops)
    plan.predicted["tokens_per_s"] = round(rate.tokens_per_s, 3)
    plan.predicted["mfu"] = round(rate.mfu, 4)
    result.reasons = [*getattr(result, "reasons", []), *reasons]


def micro_batch_sizes(request: PlanRequest) -> list[int]:
    """Micro-batch sizes to try, smallest first: divisors of the per-rank batch for a global
    batch; powers of two for ``--batch-size auto``."""
    if request.global_batch_size is None:
        sizes, b = [], 1
        while b <= MAX_AUTO_MICRO_BATCH:
            sizes.append(b)
            b *= 2
        return sizes
    ranks = request.world_size
    if request.global_batch_size % ranks:
        nearest = max(1, request.global_batch_size // ranks) * ranks
        raise BadInput(f"--global-batch-size {request.global_batch_size} is not a multiple of "
                       f"the {ranks} data-parallel ranks (--world-size); each rank takes the same "
                       f"number of samples per step. Try {nearest}.")
    per_rank = request.global_batch_size // ranks
    return [b for b in range(1, per_rank + 1) if per_rank % b == 0]


def plan_micro_batches(request: PlanRequest, progress: Progress | None = None) -> PlanResult:
    """The micro-batch, accumulation and gradient sync with the most tokens per second per GPU
    ([Note: choosing for throughput]); ``NoFeasiblePlan`` when no micro-batch fits."""
    from fsdp_plan.api import analyze_model
    per_rank = (request.global_batch_size // request.world_size
                if request.global_batch_size else None)
    options: list[BatchOption] = []
    best: tuple[float, PlanResult] | None = None
    failure: NoFeasiblePlan | None = None
    for b in micro_batch_sizes(request):
        k = per_rank // b if per_rank else 1
        source = dataclasses.replace(request.source, batch_size=b)
        one = dataclasses.replace(request, source=source, grad_accum_steps=k,
                                  global_batch_size=None, auto_batch=False)
        if progress:
            progress(f"micro-batch {b} x {k} accumulation step(s)")
        analyzed = analyze_model(source, param_dtype=one.param_dtype, exact=one.exact_analysis)
        try:
            result = plan_with_choices(analyzed.facts, one, digest=analyzed.digest,
                                       notes=analyzed.notes)
        except NoFeasiblePlan as e:
            failure = failure or e
            options.append(BatchOption(micro_batch=b, grad_accum_steps=k, note="no plan fits; "
                                       "larger micro-batches hold more activations"))
            break  # larger micro-batches need more memory still
        result.loaded = analyzed.loaded
        rate = result.plan.predicted
        options.append(BatchOption(
            micro_batch=b, grad_accum_steps=k, gradient_sync=result.plan.gradient_sync,
            reduce_dtype=str(result.plan.mixed_precision.get("reduce_dtype")), fits=True,
            step_s=result.best.time.step_s, tokens_per_s=rate["tokens_per_s"], mfu=rate["mfu"],
            peak_bytes=result.best.memory.peak_bytes))
        # a larger micro-batch must be strictly faster to win (auto: "largest that fits, or
        # the fastest if larger is not faster")
        if best is None or rate["tokens_per_s"] > best[0] * (1 + 1e-9):
            best = (rate["tokens_per_s"], result)
    if best is None:
        assert failure is not None
        raise failure
    result = best[1]
    chosen = next(o for o in options if o.fits and o.micro_batch == result.plan.model[
        "batch_size"])
    others = ", ".join(f"{o.micro_batch}x{o.grad_accum_steps}: "
                       + (f"{o.tokens_per_s:.4g} tokens/s" if o.fits else "does not fit")
                       for o in options if o is not chosen)
    result.reasons = [f"micro-batch {chosen.micro_batch} x {chosen.grad_accum_steps} "
                      f"accumulation step(s): {chosen.tokens_per_s:.4g} tokens/s per GPU, the "
                      f"most of the micro-batches tried ({others or 'no other fits'})",
                      *getattr(result, "reasons", [])]
    result.batch_options = [o.row() for o in options]
    if request.global_batch_size:
        result.plan.predicted["global_batch_size"] = request.global_batch_size
    return result

