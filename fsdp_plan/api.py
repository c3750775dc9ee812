"""The library API: plan a model for a budget, or predict a plan as written, from Python.

Composition only: each function calls the pipeline's stages in order (facts/ -> search/ ->
plan/), and the command line, ``benchmarks/``, ``policies/regenerate.py`` and the GPU check
call these functions. The public names are re-exported by ``fsdp_plan/__init__.py``.

Example usage::

    from fsdp_plan import ModelSource, PlanRequest, make_plan

    result = make_plan(PlanRequest(
        source=ModelSource(source="examples/llama.py", args={"size": "8b"}, seq_len=4096),
        budget_bytes=80 * 10**9, world_size=8))
    result.write(policy="policies/llama8b.py", plan="policies/llama8b.yaml")

    facts = analyze_model(source, param_dtype="bfloat16").facts   # one fake step (torch)
    prediction = predict(read_plan("policies/llama8b.yaml"), facts)  # pure, no torch

``analyze_model`` is the only step that builds a model (on ``meta``, under fake tensors);
``plan_from_facts`` and ``predict`` are pure functions over ``ModelFacts`` (facts/types.py).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

from fsdp_plan.common.arguments import require_type, require_whole
from fsdp_plan.common.autocast import plan_autocast_dtype
from fsdp_plan.common.errors import NoFeasiblePlan
from fsdp_plan.common.files import atomic_write_all, check_outputs
from fsdp_plan.common.limits import MAX_GPUS_PER_NODE
from fsdp_plan.common.progress import Progress
from fsdp_plan.common.sizes import format_bytes
from fsdp_plan.cost.hardware import Hardware, hardware_for, read_hardware_file
from fsdp_plan.cost.hardware.stored import hardware_of
from fsdp_plan.export.common import Gap, framework_gaps
from fsdp_plan.facts.analyze import Analyzed, analyze_loaded, analyze_model
from fsdp_plan.facts.cache import FactsCache
from fsdp_plan.facts.types import ModelFacts, ModelOutline
from fsdp_plan.model.source import ModelSource
from fsdp_plan.plan.build import layout_of, predicted_block, throughput_fields, to_plan
from fsdp_plan.plan.document import Plan, plan_to_yaml
from fsdp_plan.plan.emit import load_policy_module, render_policy_module
from fsdp_plan.plan.model_match import check_outline_matches, source_from_plan
from fsdp_plan.plan.read import plan_model_file
from fsdp_plan.plan.report import chrome_trace
from fsdp_plan.plan.schema import needed_version
from fsdp_plan.search.batching import BatchChoice, choose_batch
from fsdp_plan.search.candidate import Candidate, SearchSettings
from fsdp_plan.search.compile_choice import compare_compile
from fsdp_plan.search.ddp import DdpStrategy
from fsdp_plan.search.evaluator import Evaluator
from fsdp_plan.search.framework import LIGHTNING_WHY, FrameworkCost
from fsdp_plan.search.request import PlanRequest
from fsdp_plan.search.run import plug_ins_for, run_search

if TYPE_CHECKING:
    from fsdp_plan.model.load import LoadedModel


@dataclass(kw_only=True)
class PlanResult:
    """The chosen plan, every candidate behind the choice, and what they were computed from."""

    plan: Plan
    best: Candidate
    ranked: list[Candidate]
    """The search's candidates, best first (fitting ones by step time)."""
    recipes: list[Candidate]
    """Standard recipes (torchtitan, FSDP1 size-based, root only) on the same models."""
    facts: ModelFacts
    seconds: float
    """Planning time: analysis and search (``make_plan``), or the search alone."""
    search_seconds: float = 0.0
    loaded: LoadedModel | None = None
    """The model on ``meta`` when ``make_plan`` built it (``--verify`` measures it)."""
    reasons: list[str] = field(default_factory=list)
    """Why the throughput choices went as they did (search/batching.py), one line each."""
    batch_options: list[dict[str, Any]] = field(default_factory=list)
    """Every micro-batch size tried for a global batch, with what it reached."""
    framework: FrameworkCost | None = None
    """With ``--framework``: what keeping to its configuration costs (search/framework.py)."""
    facts_by_micro_batch: dict[int, tuple[int, ModelFacts]] = field(default_factory=dict)
    """Per micro-batch tried: its accumulation steps and facts (the frontier searches them)."""
    compiled_facts: dict[int, ModelFacts] = field(default_factory=dict)
    """With ``--compile auto``: per micro-batch analysed, the facts with the compiled
    partitions, whichever plan was kept (the frontier weighs eager and compiled at every
    budget, as the plan did)."""
    evaluator: Evaluator | None = None
    """The winning search's evaluator: its caches and evaluated plans serve the frontier
    (search/frontier.py)."""
    request: PlanRequest | None = None
    """The request as the plan chose it (micro-batch, accumulation, gradient sync, reduce
    dtype): the frontier searches other budgets with it."""

    def policy_source(self) -> str:
        """The generated policy module (SPEC section 4)."""
        return render_policy_module(self.plan)

    def plan_yaml(self) -> str:
        return plan_to_yaml(self.plan)

    def trace_json(self) -> str:
        """The predicted step as a Chrome trace."""
        return chrome_trace(self.best.time)

    def relocate_source(self, folder: str) -> None:
        """Record a relative model path relative to ``folder`` (the plan file's), so the plan
        finds its model from any working folder; absolute paths and imports stay as given."""
        model = self.plan.model
        if model.kind in ("file", "hf-config") and model.source and not os.path.isabs(model.source):
            self.plan.model = dataclasses.replace(model, source=os.path.relpath(
                os.path.abspath(model.source), os.path.abspath(folder)))

    def write(self, *, policy: str | None = None, plan: str | None = None,
              trace: str | None = None,
              extra: list[tuple[str, str | bytes]] | None = None) -> list[str]:
        """Write the chosen outputs all-or-nothing (``extra``: more ``(path, content)``, such
        as the pictures); returns the paths written."""
        for name, path in (("policy", policy), ("plan", plan), ("trace", trace)):
            require_type(path, (str, os.PathLike, type(None)), f"PlanResult.write({name}=...)")
        outputs: list[tuple[str, str | bytes]] = [
            (path, render()) for path, render in ((policy, self.policy_source),
                                                  (plan, self.plan_yaml),
                                                  (trace, self.trace_json)) if path]
        outputs += extra or []
        # the model it was planned from is never an output (issue 31, S4-02); a relocated
        # relative model.source is read from the plan file's folder
        inputs = [("model file the plan names", plan_model_file(self.plan.model, plan))]
        if self.request is not None and self.request.source.kind in ("file", "hf-config"):
            inputs.append(("model file it was planned from", self.request.source.source))
        flags = {policy: "policy", plan: "plan", trace: "trace"}
        check_outputs(inputs, [(flags.get(path, "output"), path) for path, _ in outputs])
        atomic_write_all(outputs)
        return [path for path, _ in outputs]


def make_plan(request: PlanRequest, progress: Progress | None = None, *,
              facts_cache: FactsCache | None = None) -> PlanResult:
    """Analyse the model, search, and return the fastest plan that fits (``NoFeasiblePlan`` if
    none does). ``facts_cache``: facts kept on disk are read instead of tracing, and new ones
    written ([Note: the facts cache] in facts/cache.py); the result then has no ``loaded``
    model when every analysis came from it."""
    require_type(request, PlanRequest, "make_plan(request)")  # [Note: API arguments]
    _check_progress(progress, "make_plan")
    started = time.perf_counter()
    batching = request.global_batch_size is not None or request.search.auto_batch
    analyses: dict[int, Analyzed] = {}

    def facts_at(batch: int) -> ModelFacts:
        if batch in analyses:  # the unrestricted search of --framework reuses the analysis
            return analyses[batch].facts
        source = dataclasses.replace(request.source, batch_size=batch)
        if batching and progress:
            steps = (request.global_batch_size // request.world_size // batch
                     if request.global_batch_size else 1)
            progress(f"micro-batch {batch} x {steps} accumulation step(s)")
        options = request.analysis_options()
        cached = facts_cache.load(source, options) if facts_cache is not None else None
        outline = None
        if cached is not None and request.framework is not None:
            # --framework reads the plan against the model's outline: traced without one
            outline = facts_cache.load_outline(source)
            cached = cached if outline is not None else None
        if cached is not None:
            analyzed = Analyzed(loaded=None, facts=cached.facts, digest=cached.digest,
                                notes=cached.notes, outline=outline)
            if progress and not batching:
                for note in cached.notes:
                    progress(f"note: {note}")
                progress(f"{cached.facts.graph.total_numel:,} parameters, batch {batch} x "
                         f"sequence {source.seq_len}: facts from the cache ({cached.path}), "
                         "no tracing")
        else:
            analyzed = analyze_model(source, progress=None if batching else progress,
                                     **options)
            if facts_cache is not None:
                facts_cache.store(source, options, analyzed.facts, analyzed.digest,
                                  analyzed.notes)
                if analyzed.outline is not None:  # export reads it without building the model
                    facts_cache.store_outline(source, analyzed.outline)
        analyses[batch] = analyzed
        if progress and not batching:
            graph = analyzed.facts.graph
            progress(f"searching units, prefetch and checkpointing over "
                     f"{len(graph.modules):,} modules ({len(graph.blocks)} repeated blocks)")
        return analyzed.facts

    if request.framework is None and request.search.compile_auto:
        choice = compare_compile(request, facts_at, _search_for)
        cost = None
    elif request.framework is None:
        choice = choose_batch(request, facts_at=facts_at, search=_search_for(request))
        cost = None
    else:
        choice, cost = _framework_choice(request, facts_at,
                                         lambda: next(iter(analyses.values())).outline)
    analyzed = analyses[choice.request.source.batch_size]
    result = _result(choice, digest=analyzed.digest, notes=analyzed.notes)
    if request.framework is not None:  # the plan is made for it, restricted or not
        result.plan.framework = request.framework
        result.plan.fsdp_plan_version = needed_version(result.plan.to_dict())
    result.framework = cost
    if batching:
        per_rank = (request.global_batch_size // request.world_size
                    if request.global_batch_size else None)
        result.facts_by_micro_batch = {b: (per_rank // b if per_rank else 1, a.facts)
                                       for b, a in analyses.items()}
    if request.search.compile_auto:
        result.compiled_facts = {b: a.facts for b, a in analyses.items()}
    result.seconds = time.perf_counter() - started
    result.loaded = analyzed.loaded
    return result


def _check_progress(progress: Any, where: str) -> None:
    if progress is not None and not callable(progress):
        raise TypeError(f"{where}(progress) must be a callable taking one str, or None; got "
                        f"{type(progress).__name__}.")


def _framework_choice(request: PlanRequest, facts_at, outline_of
                      ) -> tuple[BatchChoice, FrameworkCost]:
    """``--framework``: the search kept to the framework's configuration and, on the same
    facts, the unrestricted one it is priced against. The restricted plan is checked against
    the export's own reading of the configuration (no ``Gap``: export writes no hook); where
    the configuration says no plan that fits, or none for this model, the unrestricted plan
    is chosen and the report says why."""
    name = request.framework or ""
    limits = request.limits
    if limits is None:  # Lightning: its configuration says no unit (the policy applies the plan)
        choice = (compare_compile(request, facts_at, _search_for) if request.search.compile_auto
                  else choose_batch(request, facts_at=facts_at, search=_search_for(request)))
        return choice, FrameworkCost(framework=name, restricted=False, why=LIGHTNING_WHY)
    free_request = request.unrestricted()
    try:
        restricted = choose_batch(request, facts_at=facts_at, search=_search_for(request))
    except NoFeasiblePlan as error:
        free = choose_batch(free_request, facts_at=facts_at, search=_search_for(free_request))
        return free, FrameworkCost(framework=name, restricted=False,
                                   why=f"no plan its configuration says fits ({error})")
    try:
        free: BatchChoice | None = choose_batch(free_request, facts_at=facts_at,
                                                search=_search_for(free_request))
    except NoFeasiblePlan:
        free = None
    gaps = _framework_gaps(name, restricted, outline_of())
    if gaps:
        return free or restricted, FrameworkCost(
            framework=name, restricted=False,
            why="its configuration cannot say " + "; ".join(g.line() for g in gaps))
    best = restricted.best
    return restricted, FrameworkCost(
        framework=name, restricted=True, step_s=best.time.step_s,
        peak_bytes=best.memory.peak_bytes,
        free_step_s=free.best.time.step_s if free else None,
        free_peak_bytes=free.best.memory.peak_bytes if free else None,
        free_name=free.best.name if free else "")


def _framework_gaps(framework: str, choice: BatchChoice, outline: ModelOutline | None
                    ) -> list[Gap]:
    """What ``framework``'s configuration cannot say of the plan written for ``choice``
    (export/common ``framework_gaps``, read on the model's outline)."""
    plan = to_plan(choice.best, choice.request, choice.facts,
                   global_batch_size=choice.global_batch_size)
    return framework_gaps(framework, plan, outline) if outline is not None else []


def plan_from_facts(facts: ModelFacts, request: PlanRequest, *, digest: str = "",
                    notes: list[str] | None = None) -> PlanResult:
    """The search over ``facts`` at the request's own micro-batch: a pure function (no model,
    no torch)."""
    require_type(facts, ModelFacts, "plan_from_facts(facts)")
    require_type(request, PlanRequest, "plan_from_facts(request)")
    require_type(digest, str, "plan_from_facts(digest)")
    require_type(notes, (list, type(None)), "plan_from_facts(notes)")
    single = request.at_its_micro_batch()
    choice = choose_batch(single, facts_at=lambda _: facts, search=_search_for(single))
    return _result(choice, digest=digest, notes=notes)


def _search_for(request: PlanRequest):
    """The search with the strategies and fallbacks ``request`` admits, kept to its
    framework's limits (``--framework``)."""
    generators, fallbacks = plug_ins_for(request.strategy, request.allow_offload,
                                         request.limits)
    if request.compile_blocks:  # DDP reads the eager timeline: compiled DDP is not modelled
        generators = tuple(g for g in generators if not isinstance(g, DdpStrategy))
    return partial(run_search, generators=generators, fallbacks=fallbacks,
                   limits=request.limits)


def _result(choice: BatchChoice, *, digest: str, notes: list[str] | None) -> PlanResult:
    search = choice.result
    plan = to_plan(choice.best, choice.request, choice.facts, digest=digest, notes=notes,
                   global_batch_size=choice.global_batch_size)
    return PlanResult(plan=plan, best=choice.best,
                      ranked=search.ranked, recipes=search.recipes, facts=choice.facts,
                      seconds=search.seconds, search_seconds=search.seconds,
                      reasons=list(choice.reasons),
                      batch_options=[o.row() for o in choice.options], request=choice.request,
                      evaluator=search.evaluator)


def analyze_for_plan(plan: Plan, loaded: LoadedModel, *,
                     facts_cache: FactsCache | None = None) -> ModelFacts:
    """The facts a plan is predicted from: ``loaded`` analysed as the plan computes (FSDP
    mixed precision at its ``param_dtype``, or float32 parameters under ``torch.autocast``:
    [Note: autocast precision]) with its selective stride (``predict``, ``verify`` and
    ``tune`` all start here). ``facts_cache``: facts kept on disk for this model and these
    options are read instead of tracing, and new ones written ([Note: the facts cache] in
    facts/cache.py): predicting the same plan again (another GPU, a refitted hardware file)
    traces nothing."""
    require_type(plan, Plan, "analyze_for_plan(plan)")
    if loaded is None or not hasattr(loaded, "model"):
        raise TypeError(f"analyze_for_plan(loaded) must be a LoadedModel (model/load.py), got "
                        f"{type(loaded).__name__}.")
    require_type(facts_cache, (FactsCache, type(None)), "analyze_for_plan(facts_cache)")
    options = plan_analysis_options(plan)
    cached = facts_cache.load(loaded.source, options) if facts_cache is not None else None
    if cached is not None:
        return cached.facts
    analyzed = analyze_loaded(loaded, **options)
    if facts_cache is not None:
        facts_cache.store(loaded.source, options, analyzed.facts, analyzed.digest,
                          analyzed.notes)
        if analyzed.outline is not None:  # cached_facts_for_plan reads the plan against it
            facts_cache.store_outline(loaded.source, analyzed.outline)
    return analyzed.facts


def cached_facts_for_plan(plan: Plan, source: ModelSource,
                          facts_cache: FactsCache | None) -> ModelFacts | None:
    """The facts ``analyze_for_plan`` gives ``plan``, read from ``facts_cache`` with the
    model's outline, and the plan checked against that outline as export checks it
    (plan/model_match.py): no model built, no torch imported. None when either entry is
    missing (or the cache is off): build the model and call ``analyze_for_plan`` then."""
    require_type(plan, Plan, "cached_facts_for_plan(plan)")
    require_type(source, ModelSource, "cached_facts_for_plan(source)")
    if facts_cache is None:
        return None
    cached = facts_cache.load(source, plan_analysis_options(plan))
    outline = facts_cache.load_outline(source) if cached is not None else None
    if cached is None or outline is None:
        return None
    check_outline_matches(plan, outline, source)
    return cached.facts


def facts_for_plan(plan: Plan, *, model: str | None = None, plan_path: str | None = None,
                   facts_cache: FactsCache | None = None) -> ModelFacts:
    """The facts ``plan`` is predicted from, for a command that needs no live model (``predict``,
    ``trace --plan``): read from ``facts_cache`` with the kept outline where they are there
    (``cached_facts_for_plan``: no model built, no torch imported), else the plan's model built
    on ``meta``, checked against the plan and traced (``analyze_for_plan``, which keeps them).
    ``model`` (the command line's MODEL) and ``plan_path`` say where the model is, as
    ``source_from_plan`` reads them."""
    facts = cached_facts_for_plan(plan, source_from_plan(plan, model, plan_path), facts_cache)
    if facts is not None:
        return facts
    from fsdp_plan.measure import runtime  # torch (seconds): only when the model is built

    return analyze_for_plan(plan, runtime.load_planned_model(plan, model, plan_path),
                            facts_cache=facts_cache)


def plan_analysis_options(plan: Plan) -> dict[str, Any]:
    """How ``analyze_for_plan`` traces for ``plan`` (``analyze_loaded``'s options, and the
    facts cache's key): the plan's precision, its selective stride and compiled blocks."""
    compiled = plan.compile
    autocast = plan_autocast_dtype(plan)
    return {"param_dtype": "float32" if autocast else plan.mixed_precision.param_dtype or "float32",
            "autocast_dtype": autocast, "selective_mm_stride": plan.selective_mm_stride,
            "compile_blocks": compiled is not None,
            "activation_memory_budget": compiled.activation_memory_budget if compiled else None}


def plan_hardware(plan: Plan, *, gpu: str | None = None, hardware_file: str | None = None
                  ) -> Hardware:
    """The hardware a plan is timed on: a hardware file's figures (``--hardware``, e.g. from
    ``fsdp-plan calibrate``) over ``gpu`` or the plan's preset; else the ``gpu`` preset; else
    the figures the plan stored; else its ``gpu`` preset (cost/hardware/stored.py [Note: plans
    keep their hardware])."""
    require_type(plan, Plan, "plan_hardware(plan)")
    require_type(gpu, (str, type(None)), "plan_hardware(gpu)")
    require_type(hardware_file, (str, os.PathLike, type(None)), "plan_hardware(hardware_file)")
    if hardware_file:
        return hardware_for(gpu or plan.gpu or "h100", read_hardware_file(hardware_file),
                            where=f"--hardware {hardware_file!r}")
    if gpu is None and plan.hardware is not None:
        return hardware_of(plan.hardware)
    return hardware_for(gpu or plan.gpu or "h100")


@dataclass(kw_only=True)
class Prediction:
    """What the models say about one plan as written."""

    candidate: Candidate
    predicted: dict[str, Any]
    """The ``predicted`` mapping the planner would write for this plan."""
    limit_bytes: int
    fits: bool
    evaluator: Evaluator | None = None
    """The evaluator the plan was predicted with (its activation profiles and memory context,
    for pictures of the step)."""


def predict(plan: Plan, facts: ModelFacts, *, hardware: Hardware | None = None,
            gpus_per_node: int | None = None) -> Prediction:
    """Memory, collectives and step time of ``plan`` exactly as written (no search).

    A pure function over the model's facts: the plan's layout (plan/build.py ``layout_of``) is
    evaluated with the same memory model, collective rule and step-time model the search uses.
    ``gpus_per_node`` None reads the plan's (``Plan.node_gpus``)."""
    require_type(plan, Plan, "predict(plan)")  # [Note: API arguments]
    require_type(facts, ModelFacts, "predict(facts)")
    require_type(hardware, (Hardware, type(None)), "predict(hardware)")
    if gpus_per_node is not None:
        require_whole(gpus_per_node, "predict(gpus_per_node)", 1, MAX_GPUS_PER_NODE)
    layout = layout_of(plan, facts)
    settings = SearchSettings(
        budget_bytes=plan.budget_bytes, headroom_bytes=plan.headroom_bytes,
        world_size=plan.world_size,
        gpus_per_node=plan.node_gpus if gpus_per_node is None else gpus_per_node,
        hardware=hardware or plan_hardware(plan), strategy=plan.strategy,
        precision=plan.mixed_precision.precision, optimizer=plan.optimizer,
        grad_accum_steps=plan.grad_accum_steps, gradient_sync=plan.gradient_sync)
    evaluator = Evaluator(facts.graph, facts.analysis, settings)
    candidate = evaluator.evaluate(layout, "plan as written" + (" offload" if layout.offload
                                                                else ""))
    predicted = {**predicted_block(candidate),
                 **throughput_fields(candidate, facts, plan, settings.hardware)}
    return Prediction(candidate=candidate, predicted=predicted,
                      limit_bytes=settings.limit_bytes, fits=candidate.fits, evaluator=evaluator)


def verify_by_measurement(result: PlanResult, loaded: LoadedModel,
                          progress: Progress | None = None) -> int:
    """Measure the chosen plan (FSDPMemTracker on the fake process group, or one real DDP rank:
    measure/peak.py) for ``--verify``;
    records the figure in the plan and raises ``NoFeasiblePlan`` when it is over the limit."""
    require_type(result, PlanResult, "verify_by_measurement(result)")
    if loaded is None or not hasattr(loaded, "model"):
        raise TypeError(f"verify_by_measurement(loaded) must be a LoadedModel (model/load.py), "
                        f"got {type(loaded).__name__}.")
    # measurement imports torch: ``import fsdp_plan`` and planning from facts stay torch-free
    from fsdp_plan.measure.peak import measured_peak
    plan = result.plan
    measured = measured_peak(loaded, plan, load_policy_module(result.policy_source()))
    predicted = plan.predicted["peak_bytes"]
    plan.predicted["measured_peak_bytes"] = int(measured.peak_bytes)
    figure = format_bytes(measured.peak_bytes)
    how = (f"measured {figure} {measured.where}" if measured.where  # a DDP plan: one real rank
           else f"FSDPMemTracker measured {figure}")
    if progress:
        progress(f"verify: predicted peak {format_bytes(predicted)}, {how} "
                 f"({(predicted - measured.peak_bytes) / measured.peak_bytes:+.1%})")
    limit = plan.limit_bytes
    if measured.peak_bytes > limit:
        raise NoFeasiblePlan(f"the chosen plan: {how}, above the limit {format_bytes(limit)}; "
                             "nothing was written. Raise --headroom or add GPUs.",
                             smallest_peak_bytes=measured.peak_bytes)
    return int(measured.peak_bytes)
