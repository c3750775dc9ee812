"""The library API: plan a model for a budget, or predict a plan as written, from Python.

Every front end calls these (the ``fsdp-plan`` command, ``benchmarks/``,
``policies/regenerate.py``, the GPU check); the command line only parses and prints.

Example usage::

    from fsdp_plan.api import PlanRequest, make_plan
    from fsdp_plan.source import ModelSource

    result = make_plan(PlanRequest(
        source=ModelSource(source="examples/llama.py", args={"size": "8b"}, seq_len=4096),
        budget_bytes=80 * 10**9, world_size=8))
    result.write(policy="policies/llama8b.py", plan="policies/llama8b.yaml")

    facts = analyze_model(source, param_dtype="bfloat16").facts   # one fake step (torch)
    prediction = predict(read_plan("policies/llama8b.yaml"), facts)  # pure, no torch

``analyze_model`` is the only step that builds a model (on ``meta``, under fake tensors);
``plan_from_facts`` and ``predict`` are pure functions over ``ModelFacts`` (facts.py).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fsdp_plan.checkpointing import DEFAULT_SELECTIVE_OPS, modes_mapping
from fsdp_plan.cost import Hardware, hardware_for, step_phases
from fsdp_plan.errors import BadInput, NoFeasiblePlan
from fsdp_plan.facts import ModelFacts
from fsdp_plan.memory import DTYPE_BYTES, OPTIMIZER_STATES, Precision, canonical_dtype
from fsdp_plan.plan import Mesh, Plan, Unit
from fsdp_plan.search import (
    Candidate,
    Evaluator,
    SearchSettings,
    choose,
    cycle_collector_paused,
    search,
    standard_recipes,
)
from fsdp_plan.sizes import format_bytes
from fsdp_plan.source import ModelSource
from fsdp_plan.units import unit_mixed_precision

if TYPE_CHECKING:
    from fsdp_plan.load import LoadedModel

Progress = Callable[[str], None]


@dataclass(kw_only=True)
class PlanRequest:
    """What the user asks for: a model, a per-GPU budget, the cluster and the training setup."""

    source: ModelSource
    budget_bytes: int
    """Per-GPU memory budget in bytes (``--mem``)."""
    headroom_bytes: int | None = None
    """Kept free for the CUDA context, communication buffers and fragmentation; default 10%."""
    world_size: int = 8
    gpus_per_node: int = 8
    strategy: str = "auto"
    """``auto``, ``full``, ``hybrid``, ``grad-op``, ``none`` or ``ddp`` (DistributedDataParallel)."""
    param_dtype: str = "bfloat16"
    reduce_dtype: str = "float32"
    optimizer: str = "adamw"
    hardware: Hardware = field(default_factory=lambda: hardware_for("h100"))
    hardware_origin: dict[str, str] | None = None
    """Where ``hardware`` came from (``hardware.stored.file_origin`` of a ``--hardware``
    file): the plan stores it beside the figures (SPEC 7)."""
    exact_analysis: bool = False
    """Analyse every block instead of three per stack (depth.py)."""
    allow_offload: bool = False
    """When nothing fits on the device, plan FSDP2 ``CPUOffloadPolicy`` (``--allow-offload``;
    offload.py [Note: offload as the last resort])."""
    grad_accum_steps: int = 1
    """Micro-batches (``source.batch_size`` samples each, per rank) per optimizer step."""
    gradient_sync: str = "every"
    """Reduce gradients after ``every`` micro-batch or only the ``last``."""
    global_batch_size: int | None = None
    """Samples per optimizer step over all data-parallel ranks: the planner chooses the
    micro-batch, accumulation and gradient sync (batching.py)."""
    auto_batch: bool = False
    """``--batch-size auto``: the largest micro-batch that fits, or the fastest if larger is
    not faster."""

    def __post_init__(self) -> None:
        self.param_dtype = canonical_dtype(self.param_dtype, "param_dtype")
        if self.reduce_dtype != "auto":  # auto: the search tries float32 and bfloat16
            self.reduce_dtype = canonical_dtype(self.reduce_dtype, "reduce_dtype")
        if self.headroom_bytes is None:
            self.headroom_bytes = self.budget_bytes // 10
        if not 0 <= self.headroom_bytes < self.budget_bytes:
            raise BadInput(f"headroom {format_bytes(self.headroom_bytes)} must be at least 0 and "
                           f"leave part of the budget {format_bytes(self.budget_bytes)}.")
        if self.optimizer not in OPTIMIZER_STATES:
            raise BadInput(f"optimizer {self.optimizer!r} is not one of "
                           f"{', '.join(OPTIMIZER_STATES)}.")
        if self.allow_offload:  # before any work: h2d_bandwidth 0 cannot price the copies
            from fsdp_plan.offload import pcie_bandwidth
            pcie_bandwidth(self.hardware)

    @property
    def limit_bytes(self) -> int:
        """The peak a plan may reach: budget minus headroom."""
        return self.budget_bytes - int(self.headroom_bytes or 0)

    def settings(self) -> SearchSettings:
        return SearchSettings(budget_bytes=self.budget_bytes,
                              headroom_bytes=int(self.headroom_bytes or 0),
                              world_size=self.world_size, gpus_per_node=self.gpus_per_node,
                              strategy=self.strategy, precision=precision_of(
                                  self.param_dtype, self.reduce_dtype),
                              optimizer=self.optimizer, hardware=self.hardware,
                              grad_accum_steps=self.grad_accum_steps,
                              gradient_sync=self.gradient_sync)


@dataclass(kw_only=True)
class Analyzed:
    """A model built on ``meta`` and its facts (the one step that needs torch)."""

    loaded: LoadedModel
    facts: ModelFacts
    digest: str
    notes: list[str] = field(default_factory=list)


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
    """Why the throughput choices went as they did (throughput.py), one line each."""
    batch_options: list[dict[str, Any]] = field(default_factory=list)
    """Every micro-batch size tried for a global batch, with what it reached."""

    def policy_source(self) -> str:
        """The generated policy module (SPEC section 4)."""
        from fsdp_plan.emit import render_policy_module
        return render_policy_module(self.plan)

    def plan_yaml(self) -> str:
        from fsdp_plan.plan import plan_to_yaml
        return plan_to_yaml(self.plan)

    def trace_json(self) -> str:
        """The predicted step as a Chrome trace."""
        from fsdp_plan.report import chrome_trace
        return chrome_trace(self.best.time)

    def relocate_source(self, folder: str) -> None:
        """Record a relative model path relative to ``folder`` (the plan file's), so the plan
        finds its model from any working folder; absolute paths and imports stay as given."""
        model = self.plan.model
        source = str(model.get("source", ""))
        if model.get("kind") in ("file", "hf-config") and source and not os.path.isabs(source):
            model["source"] = os.path.relpath(os.path.abspath(source), os.path.abspath(folder))

    def write(self, *, policy: str | None = None, plan: str | None = None,
              trace: str | None = None) -> list[str]:
        """Write the chosen outputs all-or-nothing; returns the paths written."""
        from fsdp_plan.outputs import atomic_write_all
        outputs = [(path, render()) for path, render in ((policy, self.policy_source),
                                                         (plan, self.plan_yaml),
                                                         (trace, self.trace_json)) if path]
        atomic_write_all(outputs)
        return [path for path, _ in outputs]


def precision_of(param_dtype: str, reduce_dtype: str) -> Precision:
    """Element sizes for the plan's mixed precision (parameters are stored in fp32)."""
    return Precision(orig_bytes=4, param_bytes=DTYPE_BYTES[canonical_dtype(param_dtype)],
                     reduce_bytes=DTYPE_BYTES[canonical_dtype(reduce_dtype)])


def analyze_model(source: ModelSource, *, param_dtype: str = "bfloat16", exact: bool = False,
                  progress: Progress | None = None) -> Analyzed:
    """Build the model on ``meta`` and run the fake forward + backward (analysis.py)."""
    from fsdp_plan.load import load_model
    return analyze_loaded(load_model(source), param_dtype=param_dtype, exact=exact,
                          progress=progress)


def analyze_loaded(loaded: LoadedModel, *, param_dtype: str = "bfloat16", exact: bool = False,
                   progress: Progress | None = None) -> Analyzed:
    """``analyze_model`` for a model already loaded (verify and predict load it to check it)."""
    import torch

    from fsdp_plan.analysis import analyze
    from fsdp_plan.graph import build_module_graph
    from fsdp_plan.source import source_digest

    source = loaded.source
    graph = build_module_graph(loaded.model)
    if graph.total_numel == 0:
        raise BadInput(f"model {source.source!r} has no parameters; there is nothing to shard.")
    if progress:
        for note in loaded.notes:
            progress(f"note: {note}")
        progress(f"analysing {graph.total_numel:,} parameters, batch {source.batch_size} x "
                 f"sequence {source.seq_len}")
    from fsdp_plan.load import user_code_output_to_stderr
    with user_code_output_to_stderr():  # the model's print()s: stdout is the report's
        analysis = analyze(loaded, param_dtype=getattr(torch, canonical_dtype(param_dtype)),
                           blocks=graph.blocks, exact=exact, progress=progress)
    return Analyzed(loaded=loaded, facts=ModelFacts(graph=graph, analysis=analysis),
                    digest=source_digest(source), notes=list(loaded.notes))


def analyze_for_plan(plan: Plan, loaded: LoadedModel) -> ModelFacts:
    """The facts a plan is predicted from: ``loaded`` analysed at the plan's compute dtype
    (``predict``, ``verify`` and ``tune`` all start here)."""
    return analyze_loaded(loaded, param_dtype=plan.mixed_precision.get("param_dtype")
                          or "float32").facts


def plan_hardware(plan: Plan, *, gpu: str | None = None, hardware_file: str | None = None
                  ) -> Hardware:
    """The hardware a plan is timed on: a hardware file's figures (``--hardware``, e.g. from
    ``fsdp-plan calibrate``) over ``gpu`` or the plan's preset; else the ``gpu`` preset; else
    the figures the plan stored; else its ``gpu`` preset (hardware/stored.py [Note: plans keep
    their hardware])."""
    from fsdp_plan.cost import read_hardware_file
    if hardware_file:
        return hardware_for(gpu or plan.gpu or "h100", read_hardware_file(hardware_file),
                            where=f"--hardware {hardware_file!r}")
    if gpu is None and plan.hardware is not None:
        from fsdp_plan.hardware.stored import hardware_of
        return hardware_of(plan.hardware)
    return hardware_for(gpu or plan.gpu or "h100")


def make_plan(request: PlanRequest, progress: Progress | None = None) -> PlanResult:
    """Analyse the model, search, and return the fastest plan that fits (``NoFeasiblePlan`` if
    none does)."""
    started = time.perf_counter()
    if request.global_batch_size is not None or request.auto_batch:
        from fsdp_plan.throughput import plan_micro_batches
        result = plan_micro_batches(request, progress)
        result.seconds = time.perf_counter() - started
        return result
    analyzed = analyze_model(request.source, param_dtype=request.param_dtype,
                             exact=request.exact_analysis, progress=progress)
    if progress:
        graph = analyzed.facts.graph
        progress(f"searching units, prefetch and checkpointing over {len(graph.modules):,} "
                 f"modules ({len(graph.blocks)} repeated blocks)")
    from fsdp_plan.throughput import plan_with_choices
    result = plan_with_choices(analyzed.facts, request, digest=analyzed.digest,
                               notes=analyzed.notes)
    result.seconds = time.perf_counter() - started
    result.loaded = analyzed.loaded
    return result


def plan_from_facts(facts: ModelFacts, request: PlanRequest, *, digest: str = "",
                    notes: list[str] | None = None) -> PlanResult:
    """The search over ``facts``: a pure function (no model, no torch)."""
    started = time.perf_counter()
    with cycle_collector_paused():
        evaluator = Evaluator(facts.graph, facts.analysis, request.settings())
        recipes = standard_recipes(evaluator)
        ranked = choose(search(evaluator), recipes, request.strategy)
        best = ranked[0]
        if not best.fits:
            best = _offload_or_raise(evaluator, ranked, recipes, request)
            ranked = [best, *ranked]
    plan = to_plan(best, request, numel=facts.graph.total_numel, digest=digest,
                   selective_ops=facts.analysis.selective_ops)
    if getattr(best, "offload", None):
        plan.offload, plan.fsdp_plan_version = dict(best.offload), 2
        plan.predicted["host_bytes"] = dict(best.host_bytes)
    if notes:
        plan.model["notes"] = list(notes)
    seconds = time.perf_counter() - started
    return PlanResult(plan=plan, best=best, ranked=ranked, recipes=recipes, facts=facts,
                      seconds=seconds, search_seconds=seconds)


def _offload_or_raise(evaluator: Evaluator, ranked: list[Candidate], recipes: list[Candidate],
                      request: PlanRequest) -> Candidate:
    """Nothing fits on the device: the fastest offloaded plan that fits when the user allowed
    offload, else ``NoFeasiblePlan`` saying whether offload would fit and at what peak."""
    from fsdp_plan.offload import best_offloaded
    smallest = min(ranked + recipes, key=lambda c: c.memory.peak_bytes)
    offloaded = best_offloaded(evaluator, ranked + recipes)
    if offloaded is not None and offloaded.fits and request.allow_offload:
        return offloaded
    if offloaded is not None and offloaded.fits:
        offload_text = (f" With --allow-offload it would fit: FSDP2 CPUOffloadPolicy keeps "
                        f"parameters, gradients and optimizer states on the host (device peak "
                        f"{format_bytes(offloaded.memory.peak_bytes)}, predicted step "
                        f"{offloaded.time.step_s:.3g} s, {offloaded.name}).")
    elif offloaded is not None:
        offload_text = (" Even CPU offload (--allow-offload) does not fit: its smallest device "
                        f"peak is {format_bytes(offloaded.memory.peak_bytes)}.")
    else:
        offload_text = ""
    raise NoFeasiblePlan(
        f"no plan fits --mem {format_bytes(request.budget_bytes)} minus headroom "
        f"{format_bytes(int(request.headroom_bytes or 0))} (limit "
        f"{format_bytes(request.limit_bytes)}) at world size {request.world_size}: the "
        f"smallest peak any plan reached is {format_bytes(smallest.memory.peak_bytes)} "
        f"({smallest.name}). To fit, try: {suggestions(smallest, request)}.{offload_text}",
        smallest_peak_bytes=smallest.memory.peak_bytes)


def suggestions(smallest: Candidate, request: PlanRequest) -> str:
    """What would make the smallest plan fit, most effective first."""
    limit = request.limit_bytes
    states = smallest.memory.breakdown.get("sharded_params", 0) + smallest.memory.breakdown.get(
        "optimizer_states", 0)
    tips = []
    if request.strategy == "ddp":  # DDP cannot shard: every rank holds all model states
        tips.append("sharding (--strategy auto or full): DDP keeps every parameter, gradient "
                    "and optimizer state on each GPU")
    if states > limit:
        need = int(request.world_size * states / max(limit, 1)) + 1
        tips.append(f"more GPUs (the sharded parameters and optimizer states alone take "
                    f"{format_bytes(states)} per rank; about {need} GPUs would hold them)")
    else:
        tips.append("more GPUs (--world-size) to shard the model states further")
    if request.source.batch_size > 1:
        tips.append("a smaller --batch-size (with gradient accumulation)")
    tips.append("a shorter --seq-len")
    tips.append("CPU offload of parameters and optimizer states (--allow-offload: FSDP2 "
                "CPUOffloadPolicy)")
    if not smallest.checkpointed:
        tips.append("activation checkpointing inside blocks")
    return "; ".join(tips)


def prefetch_maps(unit_keys: list[str], forward_depth: int, backward_depth: int
                  ) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """The plan's explicit prefetch lists for prefetch depths over the non-root units.

    Forward depth 1 makes each unit prefetch the next; backward depth 1 is FSDP2's implicit
    prefetch (no lists); depth ``d > 1`` lists the ``d`` units before it in backward order."""
    keys = [k for k in unit_keys if k]
    forward = {}
    if forward_depth:
        forward = {a: keys[i + 1: i + 1 + forward_depth] for i, a in enumerate(keys)
                   if keys[i + 1: i + 1 + forward_depth]}
    backward = {}
    if backward_depth > 1:
        rev = list(reversed(keys))
        backward = {a: rev[i + 1: i + 1 + backward_depth] for i, a in enumerate(rev)
                    if rev[i + 1: i + 1 + backward_depth]}
    return forward, backward


def prefetch_depths(plan: Plan) -> tuple[int, int]:
    """The prefetch depths whose lists (``prefetch_maps``) equal the plan's, or ``BadInput``."""
    keys = [u.key for u in plan.units]
    for fwd in range(4):
        for bwd in range(1, 5):
            if prefetch_maps(keys, fwd, bwd) == (plan.forward_prefetch, plan.backward_prefetch):
                return fwd, bwd
    raise BadInput("the plan's forward_prefetch/backward_prefetch lists are not a uniform depth "
                   "(each unit prefetching the next d units in forward, or the d before it in "
                   "backward); fsdp-plan predicts such uniform prefetch only. Write the lists as "
                   "fsdp-plan does, or leave them empty.")


def predicted_block(candidate: Candidate) -> dict[str, Any]:
    """The plan file's ``predicted`` mapping for an evaluated candidate (SPEC section 3); a
    DDP plan adds its gradient buckets (SPEC 6, ddp.py)."""
    from fsdp_plan.ddp import ddp_predicted
    return {**_fsdp_predicted_block(candidate), **ddp_predicted(candidate)}


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


def to_plan(best: Candidate, request: PlanRequest, *, numel: int, digest: str,
            selective_ops: list[str] | None = None) -> Plan:
    """The SPEC plan document for an evaluated candidate (version 2, with a mapping of modes
    and the saved ops, when a block is selectively checkpointed)."""
    from fsdp_plan.ddp import ddp_plan_block
    from fsdp_plan.hardware.stored import stored_block
    forward, backward = prefetch_maps([u.key for u in best.units], best.forward_prefetch,
                                      best.backward_prefetch)
    return Plan(
        model={**request.source.to_plan_dict(), "params": numel,
               **({"digest": digest} if digest else {})},
        budget_bytes=request.budget_bytes, headroom_bytes=int(request.headroom_bytes or 0),
        world_size=request.world_size, mesh=Mesh(replicate=best.replicate, shard=best.shard),
        strategy=best.strategy,
        units=[Unit(modules=u.modules, reshard_after_forward=u.reshard_after_forward,
                    mixed_precision=unit_mixed_precision(u, request.param_dtype))
               for u in best.units],
        activation_checkpointing=(
            modes_mapping(list(best.checkpointed), [b for b in best.checkpointed
                                                    if b not in best.selective], best.selective)
            if best.selective else list(best.checkpointed)),
        selective_ops=list(selective_ops or DEFAULT_SELECTIVE_OPS) if best.selective else [],
        fsdp_plan_version=2 if best.selective or best.strategy == "ddp" else 1,
        forward_prefetch=forward, backward_prefetch=backward,
        mixed_precision={"param_dtype": request.param_dtype,
                         "reduce_dtype": request.reduce_dtype},
        optimizer=request.optimizer, gpu=request.hardware.name,
        hardware=stored_block(request.hardware, request.hardware_origin),
        predicted=predicted_block(best), ddp=ddp_plan_block(best),
    )


@dataclass(kw_only=True)
class Prediction:
    """What the models say about one plan as written."""

    candidate: Candidate
    predicted: dict[str, Any]
    """The ``predicted`` mapping the planner would write for this plan."""
    limit_bytes: int
    fits: bool


def predict(plan: Plan, facts: ModelFacts, *, hardware: Hardware | None = None,
            gpus_per_node: int = 8) -> Prediction:
    """Memory, collectives and step time of ``plan`` exactly as written (no search).

    A pure function over the model's facts: the plan's units, ``reshard_after_forward``,
    checkpointed blocks, prefetch depths, mesh, mixed precision and optimizer are evaluated
    with the same memory model, collective rule and step-time model the search uses."""
    graph = facts.graph
    hardware = hardware or plan_hardware(plan)
    if plan.strategy == "ddp":  # one replicated model and its gradient buckets (ddp.py)
        from fsdp_plan.ddp import ddp_plan_candidate
        ddp = ddp_plan_candidate(plan, facts, hardware=hardware, gpus_per_node=gpus_per_node)
        return Prediction(candidate=ddp, predicted=predicted_block(ddp),
                          limit_bytes=plan.budget_bytes - plan.headroom_bytes, fits=ddp.fits)
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
    if selective and sorted(plan.selective_ops) != sorted(facts.analysis.selective_ops):
        raise BadInput("the plan's selective_ops differ from the ops fsdp-plan analysed "
                       f"({', '.join(facts.analysis.selective_ops)}); fsdp-plan predicts selective "
                       "checkpointing with that list only. Write it as fsdp-plan does.")
    forward_depth, backward_depth = prefetch_depths(plan)
    mp = plan.mixed_precision or {}
    settings = SearchSettings(
        budget_bytes=plan.budget_bytes, headroom_bytes=plan.headroom_bytes,
        world_size=plan.world_size, gpus_per_node=gpus_per_node, strategy=plan.strategy,
        precision=precision_of(mp.get("param_dtype") or "float32",
                               mp.get("reduce_dtype") or mp.get("param_dtype") or "float32"),
        optimizer=plan.optimizer, hardware=hardware, grad_accum_steps=plan.grad_accum_steps,
        gradient_sync=plan.gradient_sync)
    evaluator = Evaluator(graph, facts.analysis, settings)
    candidate = evaluator.evaluate(
        name="plan as written", strategy=plan.strategy, replicate=plan.mesh.replicate,
        shard=plan.mesh.shard, groups=[list(u.modules) for u in units[:-1]],
        reshard=[u.reshard_after_forward for u in units[:-1]],
        root_reshard=units[-1].reshard_after_forward, checkpoint=checkpoint, selective=selective,
        forward_prefetch=forward_depth, backward_prefetch=backward_depth)
    if any((getattr(plan, "offload", None) or {}).values()):
        from fsdp_plan.offload import with_offload
        candidate = with_offload(evaluator, candidate)
    return Prediction(candidate=candidate, predicted=predicted_block(candidate),
                      limit_bytes=settings.limit_bytes, fits=candidate.fits)


def _block_example(blocks: list[str]) -> str:
    if not blocks:
        return "this model has none"
    return f"{blocks[0]} ... {blocks[-1]}" if len(blocks) > 1 else blocks[0]


def verify_by_measurement(result: PlanResult, loaded: LoadedModel,
                          progress: Progress | None = None) -> int:
    """Measure the chosen plan with FSDPMemTracker on the fake process group (``--verify``);
    records the figure in the plan and raises ``NoFeasiblePlan`` when it is over the limit."""
    from fsdp_plan.emit import load_policy_module
    from fsdp_plan.measure.memory import measure_peak
    plan = result.plan
    measured = measure_peak(loaded, plan, load_policy_module(result.policy_source()))
    predicted = plan.predicted["peak_bytes"]
    plan.predicted["measured_peak_bytes"] = int(measured.peak_bytes)
    if progress:
        progress(f"verify: predicted peak {format_bytes(predicted)}, FSDPMemTracker measured "
                 f"{format_bytes(measured.peak_bytes)} "
                 f"({(predicted - measured.peak_bytes) / measured.peak_bytes:+.1%})")
    limit = plan.budget_bytes - plan.headroom_bytes
    if measured.peak_bytes > limit:
        raise NoFeasiblePlan(f"the chosen plan measured {format_bytes(measured.peak_bytes)} under "
                             f"FSDPMemTracker, above the limit {format_bytes(limit)}; nothing "
                             "was written. Raise --headroom or add GPUs.",
                             smallest_peak_bytes=measured.peak_bytes)
    return int(measured.peak_bytes)
