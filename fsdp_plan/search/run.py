"""One search: the strategies and fallbacks it is handed, run over one model's facts.

``run_search(facts, settings, generators, fallbacks)`` evaluates every generator's candidates
and recipes with one ``Evaluator`` (its caches shared), ranks them, and when nothing fits asks
each fallback for a rescue; a rescue is used only when its fallback is allowed, and otherwise
the ``NoFeasiblePlan`` message quotes what it would reach. ``plug_ins_for`` is the only place
that names every strategy.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from fsdp_plan.common.collector import cycle_collector_paused
from fsdp_plan.common.errors import BadInput, NoFeasiblePlan
from fsdp_plan.common.sizes import format_bytes
from fsdp_plan.facts.types import ModelFacts
from fsdp_plan.search.candidate import Candidate, SearchSettings, choose
from fsdp_plan.search.ddp import DdpStrategy
from fsdp_plan.search.evaluator import Evaluator
from fsdp_plan.search.framework import FrameworkLimits
from fsdp_plan.search.fsdp import ShardedStrategy
from fsdp_plan.search.offload import OffloadFallback


class Generator(Protocol):
    """A strategy that proposes candidates: FSDP/HSDP (``search/fsdp.py``), DDP
    (``search/ddp.py``). ``recipes`` are the standard configurations the report compares."""

    def candidates(self, evaluator: Evaluator) -> list[Candidate]: ...

    def recipes(self, evaluator: Evaluator) -> list[Candidate]: ...


class Fallback(Protocol):
    """A way out when nothing fits (CPU offload, ``search/offload.py``). One that is not
    ``allowed`` still answers, so the no-fit message can say what it would reach."""

    allowed: bool

    def rescue(self, evaluator: Evaluator, tried: list[Candidate]) -> Candidate | None: ...


@dataclass(kw_only=True)
class SearchResult:
    """The search's candidates, best first, the recipes beside them, and their evaluator."""

    ranked: list[Candidate]
    recipes: list[Candidate]
    """Standard recipes (torchtitan, FSDP1 size-based, root only) on the same models."""
    evaluator: Evaluator
    seconds: float

    @property
    def best(self) -> Candidate:
        return self.ranked[0]


def plug_ins_for(strategy: str, allow_offload: bool, limits: FrameworkLimits | None = None
                 ) -> tuple[tuple[Generator, ...], tuple[Fallback, ...]]:
    """The generators ``--strategy`` admits (FSDP/HSDP always, for its recipes; DDP under
    ``auto`` and ``ddp``) and the fallbacks (CPU offload, used only with ``--allow-offload``),
    each kept to a framework's ``limits`` when given (``--framework``)."""
    generators: list[Generator] = [ShardedStrategy(limits)]
    if strategy in ("auto", "ddp"):  # DDP beside FSDP, on the same models and clock
        generators.append(DdpStrategy(limits))
    return tuple(generators), (OffloadFallback(allowed=allow_offload, limits=limits),)


def run_search(facts: ModelFacts, settings: SearchSettings, generators: Sequence[Generator],
               fallbacks: Sequence[Fallback] = (), limits: FrameworkLimits | None = None, *,
               evaluator: Evaluator | None = None) -> SearchResult:
    """Every generator's candidates ranked with the recipes that beat them; a fallback's
    rescue first when nothing fits, else ``NoFeasiblePlan``. With a framework's ``limits``
    only recipes and rescues its configuration says compete (all are still reported).
    ``evaluator``: one built for ``facts`` and ``settings`` already, whose caches to use (the
    frontier's, across budgets)."""
    started = time.perf_counter()
    with cycle_collector_paused(promote_after=True):
        evaluator = evaluator or Evaluator(facts.graph, facts.analysis, settings)
        recipes = [r for g in generators for r in g.recipes(evaluator)]
        found = [c for g in generators for c in g.candidates(evaluator)]

        def sayable(c: Candidate) -> bool:
            return limits is None or limits.allows(c.layout, facts.graph,
                                                   settings.precision.lowers_precision)
        competing = [r for r in recipes if sayable(r)]
        ranked = choose(found, competing, settings.strategy)
        if not ranked:
            raise _nothing_ranked(facts, settings, limits)
        if not ranked[0].fits:
            rescues = [(f, f.rescue(evaluator, ranked + competing)) for f in fallbacks]
            usable = [c for f, c in rescues
                      if f.allowed and c is not None and c.fits and sayable(c)]
            if not usable:
                raise no_fit_error(ranked + recipes, rescues, settings, evaluator)
            ranked = [usable[0], *ranked]
    return SearchResult(ranked=ranked, recipes=recipes, evaluator=evaluator,
                        seconds=time.perf_counter() - started)


def _nothing_ranked(facts: ModelFacts, settings: SearchSettings,
                    limits: FrameworkLimits | None) -> BadInput | NoFeasiblePlan:
    """Why a search ranked no candidate at all. Every FSDP search has the root-only layout,
    so it is ``--strategy ddp`` on a model whose step fails as DDP computes it (under
    autocast with float32 parameters, ``Analysis.ddp_unavailable``), or a framework's
    configuration that can say no plan of this model."""
    unavailable = facts.analysis.ddp_unavailable
    if settings.strategy == "ddp" and unavailable:
        return BadInput(f"--strategy ddp cannot be planned for this model: {unavailable}. "
                        "FSDP computes with the parameters in --param-dtype: plan with "
                        "--strategy auto or full.")
    return NoFeasiblePlan(f"{limits.name if limits else 'a'} configuration can say no plan for "
                          "this model ([Note: framework limits] in "
                          "fsdp_plan/search/framework.py).")


def no_fit_error(tried: list[Candidate], rescues: list[tuple[Fallback, Candidate | None]],
                 settings: SearchSettings, evaluator: Evaluator | None = None) -> NoFeasiblePlan:
    """SPEC's exit 3: the smallest peak any plan of the strategy asked for reached, what would
    make it fit, and what each fallback would reach.

    An explicit ``--strategy`` is never replaced (issue 21, S3-03: ``--strategy ddp
    --allow-offload`` once came back as a fully sharded offloaded plan), so its own smallest
    peak is quoted, not a recipe's of another strategy, and what another strategy would reach
    is said instead of planned (``other_strategy_advice``)."""
    same = [c for c in tried if settings.allows(c.strategy)] or tried
    smallest = min(same, key=lambda c: c.memory.peak_bytes)
    advice = "".join(f.advice(c) for f, c in rescues)
    allowed = any(f.allowed for f, _ in rescues)
    which = "plan" if settings.strategy == "auto" else f"--strategy {settings.strategy} plan"
    other = other_strategy_advice(tried, settings, evaluator) if evaluator else ""
    return NoFeasiblePlan(
        f"no {which} fits --mem {format_bytes(settings.budget_bytes)} minus headroom "
        f"{format_bytes(settings.headroom_bytes)} (limit "
        f"{format_bytes(settings.limit_bytes)}) at world size {settings.world_size}: the "
        f"smallest peak any {which} reached is {format_bytes(smallest.memory.peak_bytes)} "
        f"({smallest.name}). To fit, try: {suggestions(smallest, settings, allowed)}."
        f"{advice}{other}",
        smallest_peak_bytes=smallest.memory.peak_bytes)


def other_strategy_advice(tried: list[Candidate], settings: SearchSettings,
                          evaluator: Evaluator) -> str:
    """For an explicit ``--strategy``: whether the fully sharded recipes (tried beside it for
    the report) fit on the device, or offloaded, so the message says what would work."""
    others = [c for c in tried if not settings.allows(c.strategy) and c.strategy != "ddp"]
    if settings.strategy == "auto" or not others:
        return ""
    fitting = [c for c in others if c.fits]
    if fitting:
        best = min(fitting, key=lambda c: c.memory.peak_bytes)
        return (f" The strategy was kept as asked; --strategy {best.strategy} (or auto) fits "
                f"on the device (peak {format_bytes(best.memory.peak_bytes)}, {best.name}).")
    sharded = dataclasses.replace(settings, strategy="auto")
    rescued = OffloadFallback(allowed=True).rescue(
        Evaluator(evaluator.graph, evaluator.analysis, sharded), others)
    if rescued is not None and rescued.fits:
        return (f" The strategy was kept as asked; --strategy {rescued.strategy} (or auto) "
                f"with --allow-offload fits (device peak "
                f"{format_bytes(rescued.memory.peak_bytes)}, {rescued.name}).")
    return ""


def suggestions(smallest: Candidate, settings: SearchSettings,
                allow_offload: bool = False) -> str:
    """What would make the smallest plan fit, most effective first."""
    limit = settings.limit_bytes
    states = smallest.memory.breakdown.get("sharded_params", 0) + smallest.memory.breakdown.get(
        "optimizer_states", 0)
    tips = []
    if settings.strategy == "ddp":  # DDP cannot shard: every rank holds all model states,
        # so more GPUs do not lower its peak
        tips.append("sharding (--strategy auto or full): DDP keeps every parameter, gradient "
                    "and optimizer state on each GPU")
    elif states > limit:
        need = int(settings.world_size * states / max(limit, 1)) + 1
        tips.append(f"more GPUs (the sharded parameters and optimizer states alone take "
                    f"{format_bytes(states)} per rank; about {need} GPUs would hold them)")
    else:
        tips.append("more GPUs (--world-size) to shard the model states further")
    if settings.micro_batch > 1:
        tips.append("a smaller --batch-size (with gradient accumulation)")
    tips.append("a shorter --seq-len")
    if settings.strategy == "ddp":
        tips.append("CPU offload with sharding (--strategy full or auto with --allow-offload: "
                    "FSDP2 CPUOffloadPolicy; DDP has no CPU offload)")
    elif not allow_offload:
        tips.append("CPU offload of parameters and optimizer states (--allow-offload: FSDP2 "
                    "CPUOffloadPolicy)")
    if not smallest.checkpointed:
        tips.append("activation checkpointing inside blocks")
    return "; ".join(tips)


