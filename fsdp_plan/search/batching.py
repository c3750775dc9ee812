"""Choices that trade memory or numerics for tokens per second: micro-batch size, gradient
accumulation, when gradients are reduced, and the reduction dtype: the outer sweep around
the search. It is handed the analysis (``facts_at``) and the search (``search``) as functions,
and returns its choice; ``api`` writes the plan once, from that choice (plan/build.py).

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
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fsdp_plan.common.errors import BadInput, NoFeasiblePlan
from fsdp_plan.common.limits import MAX_BATCH_SIZE, MAX_GRAD_ACCUM_STEPS, MAX_TOKENS
from fsdp_plan.facts.types import ModelFacts
from fsdp_plan.search.candidate import Candidate, SearchSettings
from fsdp_plan.search.evaluator import Evaluator
from fsdp_plan.search.request import PlanRequest
from fsdp_plan.search.run import SearchResult

REDUCE_DTYPE_GAIN = 0.02
"""bfloat16 gradient reduction must beat float32 by this share of step time to be chosen."""
MAX_AUTO_MICRO_BATCH = 1 << 16

Search = Callable[[ModelFacts, SearchSettings], SearchResult]
"""The search with its strategies bound (search/run.py ``run_search``)."""
FactsAt = Callable[[int], ModelFacts]
"""The model's facts at a micro-batch size (facts/analyze.py, injected by ``api``)."""


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


@dataclass(kw_only=True)
class BatchChoice:
    """What the sweep chose: the search that won, the request as chosen (micro-batch in
    ``request.source.batch_size``, accumulation, gradient sync, reduce dtype), its facts and
    throughput, why, and every micro-batch tried."""

    result: SearchResult
    request: PlanRequest
    facts: ModelFacts
    throughput: Throughput
    reasons: list[str] = field(default_factory=list)
    options: list[BatchOption] = field(default_factory=list)
    global_batch_size: int | None = None
    """The global batch the micro-batch and accumulation were chosen for, if one was asked."""

    @property
    def best(self) -> Candidate:
        return self.result.best

    @property
    def gradient_sync(self) -> str:
        """When gradients are reduced (``every`` without accumulation)."""
        return self.request.gradient_sync if self.request.grad_accum_steps > 1 else "every"


def choose_batch(request: PlanRequest, *, facts_at: FactsAt, search: Search) -> BatchChoice:
    """The micro-batch, accumulation, gradient sync and reduce dtype with the most tokens per
    second per GPU ([Note: choosing for throughput]); ``NoFeasiblePlan`` when nothing fits.
    Without ``global_batch_size`` or ``auto_batch`` the micro-batch is the request's."""
    if request.global_batch_size is None and not request.search.auto_batch:
        return _choose_at(request, facts_at(request.source.batch_size), search)
    per_rank = (request.global_batch_size // request.world_size
                if request.global_batch_size else None)
    options: list[BatchOption] = []
    best: BatchChoice | None = None
    failure: NoFeasiblePlan | None = None
    for b in micro_batch_sizes(request):
        k = per_rank // b if per_rank else 1
        one = dataclasses.replace(request.at_its_micro_batch(),
                                  source=dataclasses.replace(request.source, batch_size=b),
                                  grad_accum_steps=k)
        try:
            choice = _choose_at(one, facts_at(b), search)
        except NoFeasiblePlan as e:
            failure = failure or e
            options.append(BatchOption(micro_batch=b, grad_accum_steps=k, note="no plan fits; "
                                       "larger micro-batches hold more activations"))
            break  # larger micro-batches need more memory still
        options.append(BatchOption(
            micro_batch=b, grad_accum_steps=k, gradient_sync=choice.gradient_sync,
            reduce_dtype=choice.request.reduce_dtype, fits=True, step_s=choice.best.time.step_s,
            tokens_per_s=round(choice.throughput.tokens_per_s, 3),
            mfu=round(choice.throughput.mfu, 4), peak_bytes=choice.best.memory.peak_bytes))
        # a larger micro-batch must be strictly faster to win (auto: "largest that fits, or
        # the fastest if larger is not faster")
        if best is None or options[-1].tokens_per_s > round(best.throughput.tokens_per_s, 3) * (
                1 + 1e-9):
            best = choice
    if best is None:
        assert failure is not None
        first = options[0]
        if per_rank and first.micro_batch > 1:  # the accumulation cap set the smallest
            raise NoFeasiblePlan(
                f"{failure} For --global-batch-size {request.global_batch_size} over "
                f"{request.world_size} ranks ({per_rank:,} samples per rank) the smallest "
                f"micro-batch is {first.micro_batch:,} x {first.grad_accum_steps:,} "
                f"accumulation steps, since a plan accumulates at most "
                f"{MAX_GRAD_ACCUM_STEPS:,} micro-batches: a smaller global batch or more ranks "
                "make the micro-batch smaller.",
                smallest_peak_bytes=failure.smallest_peak_bytes) from failure
        raise failure
    chosen = next(o for o in options if o.fits and o.micro_batch == best.request.source.batch_size)
    others = ", ".join(f"{o.micro_batch}x{o.grad_accum_steps}: "
                       + (f"{o.tokens_per_s:.4g} tokens/s" if o.fits else "does not fit")
                       for o in options if o is not chosen)
    best.reasons = [(f"micro-batch {chosen.micro_batch} x {chosen.grad_accum_steps} "
                     f"accumulation step(s): {chosen.tokens_per_s:.4g} tokens/s per GPU, the "
                     f"most of the micro-batches tried ({others or 'no other fits'})"),
                    *best.reasons]
    best.options = options
    best.global_batch_size = request.global_batch_size
    return best


def _choose_at(request: PlanRequest, facts: ModelFacts, search: Search) -> BatchChoice:
    """One micro-batch: the reduce-dtype choice (``auto``) and, with accumulation, the
    gradient-sync choice."""
    reasons: list[str] = []
    if request.reduce_dtype == "auto":
        result, request = _with_reduce_dtype_choice(request, facts, search, reasons)
    else:
        result = search(facts, request.settings())
    # A framework's configuration reduces after every micro-batch ([Note: framework limits]).
    if (request.grad_accum_steps > 1 and not result.best.layout.offload
            and request.limits is None):
        result, request = _with_sync_choice(facts, request, result, reasons)
    rate = throughput(result.best, facts, micro_batch=request.source.batch_size,
                      seq_len=request.source.seq_len, grad_accum_steps=request.grad_accum_steps,
                      peak_flops=request.hardware.peak_flops)
    return BatchChoice(result=result, request=request, facts=facts, throughput=rate,
                       reasons=reasons)


def _with_reduce_dtype_choice(request: PlanRequest, facts: ModelFacts, search: Search,
                              reasons: list[str]) -> tuple[SearchResult, PlanRequest]:
    """Search with float32 and bfloat16 reduction; bfloat16 only when it gains at least
    ``REDUCE_DTYPE_GAIN`` of step time (or float32 fits nowhere)."""
    results: dict[str, SearchResult] = {}
    for dtype in ("float32", "bfloat16"):
        try:
            results[dtype] = search(facts, dataclasses.replace(request,
                                                               reduce_dtype=dtype).settings())
        except NoFeasiblePlan:
            continue
    if not results:  # neither fits: the bfloat16 search's NoFeasiblePlan is the answer
        bf16_request = dataclasses.replace(request, reduce_dtype="bfloat16")
        return search(facts, bf16_request.settings()), bf16_request
    fp32, bf16 = results.get("float32"), results.get("bfloat16")
    if fp32 is None:
        result, chosen = bf16, "bfloat16"
        reasons.append("reduce in bfloat16: with float32 reduction no plan fits")
    elif bf16 is None or bf16.best.time.step_s > fp32.best.time.step_s * (1 - REDUCE_DTYPE_GAIN):
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
    assert result is not None
    return result, dataclasses.replace(request, reduce_dtype=chosen)


def _with_sync_choice(facts: ModelFacts, request: PlanRequest, result: SearchResult,
                      reasons: list[str]) -> tuple[SearchResult, PlanRequest]:
    """The faster of reducing after every micro-batch and only after the last (the winner's
    layout evaluated again under ``gradient_sync: last``), with the request that produced it."""
    last_request = dataclasses.replace(request, gradient_sync="last")
    evaluator = Evaluator(facts.graph, facts.analysis, last_request.settings())
    best = result.best
    other = evaluator.evaluate(best.layout, best.name + " sync-last")
    every_s = best.time.step_s
    if other.fits and other.time.step_s < every_s:
        reasons.append(f"reduce gradients only after the last of {request.grad_accum_steps} "
                       f"micro-batches: step {other.time.step_s:.4g} s vs {every_s:.4g} s "
                       "reducing after every one (the held unsharded gradients fit)")
        return dataclasses.replace(result, ranked=[other, *result.ranked]), last_request
    why = ("its held unsharded gradients do not fit" if not other.fits
           else f"it is not faster ({other.time.step_s:.4g} s vs {every_s:.4g} s)")
    reasons.append(f"reduce gradients after every micro-batch: reducing only after the last, "
                   f"{why}")
    return result, request


def micro_batch_sizes(request: PlanRequest) -> list[int]:
    """Micro-batch sizes to try, smallest first: divisors of the per-rank batch for a global
    batch (``doubling_ladder``); powers of two for ``--batch-size auto``."""
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
    # A micro-batch is at most MAX_BATCH_SIZE samples and MAX_TOKENS tokens, and a plan
    # accumulates at most MAX_GRAD_ACCUM_STEPS of them (plan/check.py refuses more).
    largest = min(MAX_BATCH_SIZE, MAX_TOKENS // request.source.seq_len)
    smallest = -(-per_rank // MAX_GRAD_ACCUM_STEPS)
    sizes = [b for b in divisors(per_rank) if smallest <= b <= largest]
    if not sizes:
        raise BadInput(f"--global-batch-size {request.global_batch_size} over {ranks} ranks is "
                       f"{per_rank:,} samples per rank, and none of its divisors from "
                       f"{smallest:,} (at most {MAX_GRAD_ACCUM_STEPS:,} accumulation steps) to "
                       f"{largest:,} (at most {MAX_BATCH_SIZE:,} samples and {MAX_TOKENS:,} tokens "
                       "per micro-batch) can be the micro-batch. Give a global batch with such a "
                       "divisor, more ranks (--world-size) or a shorter --seq-len.")
    return doubling_ladder(sizes)


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` in increasing order, by trial division up to its square root: at
    the largest accepted global batch (2^44 samples) 4 million trials, under a second, where
    trying every number up to ``n`` never answered (issue 21, S3-10)."""
    small, large = [], []
    for d in range(1, math.isqrt(n) + 1):
        if n % d == 0:
            small.append(d)
            if d != n // d:
                large.append(n // d)
    return small + large[::-1]


def doubling_ladder(sizes: list[int]) -> list[int]:
    """Of the increasing ``sizes``, the first, then each one at least twice the last kept, and
    the last: at most 26 micro-batches (each is analysed once) whatever the global batch. A
    per-rank batch with thousands of divisors once meant thousands of analyses (issue 21,
    S3-10); neighbours closer than a factor of two differ little in tokens per second, and
    ``--batch-size auto`` tries powers of two the same way."""
    kept: list[int] = []
    for b in sizes:
        if not kept or b >= 2 * kept[-1]:
            kept.append(b)
    if kept[-1] != sizes[-1]:
        kept.append(sizes[-1])  # the largest allowed: the fewest accumulation steps
    return kept
