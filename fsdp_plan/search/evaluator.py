"""The one evaluation entry point: a ``Layout`` in, a ``Candidate`` out.

``Evaluator(graph, analysis, settings).evaluate(layout, name)`` runs the memory model
(cost/memory.py), the collective counts (cost/collectives.py) and the two-stream clock
(cost/unit_time.py on cost/step_time.py, cost/ddp_buckets.py) for any layout the search, a
fallback, the micro-batch sweep or ``predict`` hands it: FSDP and HSDP units, DDP buckets, CPU
offload. It caches what many layouts share (activation profiles per checkpointed set, per-unit
times in its ``UnitClock``, DDP's parameter order and event clock).

[Note: recompute time]
A checkpointed block replays part of its forward inside its unit's backward: all of it
(``full``) or the ops not saved (``selective``: norms, activations, rotary embeddings,
casts: few FLOPs, much memory traffic). Both are measured per block as the backward its
mode's pass ran beyond the plain pass's, and timed like any other ops (cost/step_time.py
``compute_time``: matmul FLOPs by shape class, attention, memory-bound bytes, per-op
overhead). The cost of a set of modes is the sum over its blocks.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math

from fsdp_plan.common.deferred import Deferred
from fsdp_plan.common.errors import BadInput
from fsdp_plan.common.records import with_fields
from fsdp_plan.cost.collectives import count_fsdp1, count_fsdp2, cross_node_bytes, per_step
from fsdp_plan.cost.compiled_time import compiled_times, without_inside
from fsdp_plan.cost.ddp_buckets import (
    DdpOrder,
    ddp_order,
    evaluate_ddp,
    event_times,
    host_issue_times,
    parameter_tensors,
)
from fsdp_plan.cost.memory import ActivationProfile, StepContext, estimate_peak
from fsdp_plan.cost.offload import host_bytes, offload_seconds, offloaded_time
from fsdp_plan.cost.optimizer_overlap import overlap_refusal
from fsdp_plan.cost.step_time import (
    Rates,
    add_ops,
    compute_time,
    issue_time,
)
from fsdp_plan.cost.timeline import TimelineComposer
from fsdp_plan.cost.unit_time import StepSetup, UnitClock, unit_step_time
from fsdp_plan.cost.units import UnitSpec, build_units
from fsdp_plan.facts.types import Analysis, ModuleGraph
from fsdp_plan.search.candidate import (
    BlockMode,
    Candidate,
    DDPDetail,
    Layout,
    OffloadDetail,
    SearchSettings,
)


class Evaluator:
    """Evaluates layouts against one analysis and one set of settings."""

    def __init__(self, graph: ModuleGraph, analysis: Analysis, settings: SearchSettings, *,
                 like: Evaluator | None = None) -> None:
        """``like``: the evaluator of the same facts and settings at another selective matmul
        stride (``with_mm_stride``), whose timelines, per-module times and unit clock are
        this one's: only the selective pass differs."""
        self.graph = graph
        self.analysis = analysis
        self.settings = settings
        self.composer = TimelineComposer(analysis, graph.blocks,
                                         like=like.composer if like is not None else None)
        self._profiles: dict[tuple[frozenset[int], frozenset[int]], ActivationProfile] = {}
        hw = settings.hardware
        if like is not None and like.analysis.modules is analysis.modules and (
                like.analysis.compiled is analysis.compiled and like.settings == settings):
            self.exclusive_fw, self.exclusive_bw = like.exclusive_fw, like.exclusive_bw
            self.compiled_s, self.block_fw, self.clock = like.compiled_s, like.block_fw, like.clock
        else:
            self.exclusive_fw, self.exclusive_bw = _exclusive_flops(graph, analysis)
            self.compiled_s = (compiled_times(Rates.of(hw, analysis.param_dtype),
                                              analysis.compiled, set(graph.modules))
                               if hw is not None and analysis.compiled is not None else None)
            """Compiled blocks' graph times ([Note: compiled block time]); None for eager
            blocks."""
            self.exclusive_fw = without_inside(self.exclusive_fw, self.compiled_s)
            self.exclusive_bw = without_inside(self.exclusive_bw, self.compiled_s)
            self.block_fw = {b: analysis.modules[b].fw_flops for b in graph.blocks
                             if b in analysis.modules}
            self.clock = UnitClock(
                StepSetup(hardware=hw, param_dtype=analysis.param_dtype,
                          precision=settings.precision, optimizer=settings.optimizer,
                          gpus_per_node=settings.gpus_per_node,
                          grad_accum_steps=settings.grad_accum_steps,
                          gradient_sync=settings.gradient_sync),
                module_names=frozenset(graph.modules), blocks=frozenset(graph.blocks),
                modules=analysis.modules,
                fw_flops=self.exclusive_fw, bw_flops=self.exclusive_bw,
                compiled=self.compiled_s,
                param_tensors=parameter_tensors(graph))
            """The per-unit cost model and its caches (cost/unit_time.py), shared by budget
            copies (the budget is the only setting ``with_budget`` changes, and no time depends
            on it) and by the evaluator at another stride (no unit's time without recompute
            depends on the selective pass, and the recompute is passed in)."""
        self._ddp_order: DdpOrder | None = None
        self._ddp_times: list[float] | None = None
        self._ddp_issued: list[float] | None = None
        """DDP's parameters in their ready order with the events' peaks, its event clock
        and the host's issue times: shared by every bucket configuration."""
        self._ddp_step_times: dict[tuple, tuple] = {}
        """DDP's simulated steps by bucket layout (``evaluate_ddp``'s ``step_times``)."""
        self._block_modes: dict[tuple[frozenset[int], frozenset[int]],
                                tuple[list[BlockMode], dict[str, tuple[float, float]]]] = {}
        """Checkpointed blocks' modes and recompute seconds by mix (``_modes_of``)."""
        self._unit_layouts: dict[tuple, tuple[list[UnitSpec], list[int]]] = {}
        """Units and their forward calls by layout (``_units_and_calls``)."""
        self._not_once: frozenset[str] | None = None
        """The analysed modules not called exactly once in forward (``_calls``)."""
        self._communicated: dict[tuple, tuple[dict[str, int], dict[str, int], int]] = {}
        """Collectives and cross-node bytes by layout and which units ran
        (``_communication``)."""
        self._strided: dict[int, Evaluator | None] = {}
        """Evaluators at other selective ``aten.mm`` strides (``with_mm_stride``)."""
        self.grouped_cuts: dict[tuple[int, ...], dict[int, list[list[str]]]] = {}
        """Grouped-unit cuts of the block stacks (search/layouts.py, [Note: grouped units]) by
        the allowance multiples asked for, shared by budget copies: a cut depends on the
        hardware, mesh and dtypes, never on the budget (the frontier's searches reuse them)."""
        self._seen: dict[tuple[Layout, str], tuple[Candidate, bool]] = {}
        """Every layout evaluated, with whether it can run at all: see [Note: evaluations
        across budgets]."""
        self.serves_seen = False
        """Whether ``evaluate`` answers a layout met before from ``_seen`` (``with_budget``)."""
        self.checkpointing_met: dict[tuple[Layout, str],
                                     dict[tuple[int, int], tuple[Candidate, bool]]] = {}
        """Per layout without checkpointing and name, the ``(n_full, n_selective)`` counts
        evaluated, with ``runs`` (shared by budget copies): search/fsdp.py bounds the
        frontier's searches with them ([Note: bounded frontier searches])."""
        self.fastest_fitting_s = math.inf
        """A budget copy's fastest fitting step so far (rounded as ``rank`` rounds it): the
        frontier's searches leave out what cannot beat it ([Note: bounded frontier searches]
        in search/fsdp.py)."""
        self.block_cost = self._block_costs(like)

    def evaluate(self, layout: Layout, name: str) -> Candidate:
        """Memory, collectives and step time of ``layout``, named ``name``.

        [Note: evaluations across budgets]
        A plan's peak and time do not depend on the budget, only whether it fits (``fits`` is
        ``runnable and peak <= limit`` for every kind of layout). So every evaluation is kept
        with whether it can run at all, and an evaluator at another budget (``with_budget``,
        the frontier's) answers a layout met before, by this search or another budget's, with
        the same candidate and ``fits`` for its own limit, computing nothing.
        """
        layout = self._as_evaluated(layout)
        candidate = self.seen(layout, name)
        if candidate is None:
            candidate = self._evaluate(layout, name)
            self._seen.setdefault((layout, name), (candidate, self.runs(candidate)))
        if self.serves_seen and candidate.fits:
            self.fastest_fitting_s = min(self.fastest_fitting_s, round(candidate.time.step_s, 9))
        return candidate

    def seen(self, layout: Layout, name: str) -> Candidate | None:
        """``layout`` as ``evaluate`` answers it when a search at another budget met it
        before ([Note: evaluations across budgets]), computing nothing; None when it was not
        met or this evaluator is no budget copy (a search's own evaluations are never
        served, so a plan never depends on what was evaluated before it)."""
        if not self.serves_seen:
            return None
        found = self._seen.get((self._as_evaluated(layout), name))
        if found is None:
            return None
        return self.judged(*found)

    def runs(self, candidate: Candidate) -> bool:
        """Whether ``candidate``, evaluated here, can run at all at some budget (it fits, or
        only its peak keeps it out)."""
        return candidate.fits or candidate.memory.peak_bytes > self.settings.limit_bytes

    def judged(self, candidate: Candidate, runs: bool) -> Candidate:
        """``candidate`` (evaluated at any budget; ``runs``: ``self.runs`` there) with
        ``fits`` judged at this evaluator's limit."""
        return dataclasses.replace(
            candidate, fits=runs and candidate.memory.peak_bytes <= self.settings.limit_bytes)

    def bound_by(self, candidates: list[Candidate]) -> None:
        """Start this budget copy's ``fastest_fitting_s`` at the fastest of ``candidates``
        (another budget's search's, on the same search space) that fits here: the search at
        this budget finds one at least as fast ([Note: bounded frontier searches])."""
        for c in candidates:
            here = self.seen(c.layout, c.name)
            if here is not None and here.fits:
                self.fastest_fitting_s = min(self.fastest_fitting_s, round(here.time.step_s, 9))

    def _as_evaluated(self, layout: Layout) -> Layout:
        """``layout`` with the optimizer stepped in backward where the request allows it and
        the layout can have it (``overlap_refusal``)."""
        if self.settings.optimizer_overlap and not layout.optimizer_overlap and overlap_refusal(
                strategy=layout.strategy, optimizer=self.settings.optimizer,
                grad_accum_steps=self.settings.grad_accum_steps, offload=layout.offload,
                comm_hook=layout.ddp.comm_hook if layout.ddp is not None else None) is None:
            return with_fields(layout, optimizer_overlap=True)
        return layout

    @property
    def evaluations(self) -> int:
        """How many distinct layouts this evaluator (and its budget copies) computed."""
        return len(self._seen)

    def _evaluate(self, layout: Layout, name: str) -> Candidate:
        if layout.selective and layout.selective_mm_stride != self.analysis.selective_mm_stride:
            strided = self.with_mm_stride(layout.selective_mm_stride)
            if strided is None:
                raise BadInput(f"the layout saves every {layout.selective_mm_stride}th matmul of "
                               "its selective blocks, and the model was not analysed at that "
                               "stride (Analysis.selective_variants).")
            return strided.evaluate(layout, name)
        if layout.strategy == "ddp":
            return self._replicated(layout, name)
        candidate = self._sharded(layout, name)
        return self._offloaded(candidate) if layout.offload else candidate

    def with_mm_stride(self, stride: int) -> Evaluator | None:
        """An evaluator of the same facts and settings whose selective blocks save every
        ``stride``-th ``aten.mm`` (None when the analysis ran no pass at that stride)."""
        if stride not in self._strided:
            analysis = self.analysis.with_selective_stride(stride)
            self._strided[stride] = (None if analysis is None else self
                                     if analysis is self.analysis
                                     else Evaluator(self.graph, analysis, self.settings,
                                                    like=self))
        found = self._strided[stride]  # shared by budget copies, which judge fits at theirs
        if found is None or found.analysis is self.analysis:
            return None if found is None else self
        if found.settings != self.settings:
            return found.with_budget(self.settings.budget_bytes, self.settings.headroom_bytes)
        return found

    def _sharded(self, layout: Layout, name: str) -> Candidate:
        """FSDP or HSDP units with their checkpointed blocks and prefetch."""
        s = self.settings
        replicate, shard = layout.mesh
        which, selective = layout.full, layout.selective - layout.full
        units, calls = self._units_and_calls(layout)
        ctx = self.step_context(shard, optimizer_overlap=layout.optimizer_overlap)
        profile = self.profile(which, selective)
        memory = estimate_peak(profile, units, ctx, forward_prefetch=layout.forward_prefetch,
                               backward_prefetch=layout.backward_prefetch)
        ran = profile.ran_of(units)
        block_modes, recompute = self._modes_of(which, selective)
        time = Deferred(functools.partial(  # [Note: step times when asked]
            unit_step_time, self.clock, units, shard=shard, replicate=replicate,
            recompute=recompute,
            forward_prefetch=layout.forward_prefetch, backward_prefetch=layout.backward_prefetch,
            optimizer_overlap=layout.optimizer_overlap, layout_key=layout.units_key))
        collectives, collectives_fsdp1, crossing = self._communication(layout, units, ran, calls)
        return Candidate(
            name=name, layout=layout, units=units, memory=memory, deferred_time=time,
            collectives=dict(collectives), collectives_fsdp1=dict(collectives_fsdp1),
            fits=memory.peak_bytes <= s.limit_bytes and runnable(units, ran),
            block_modes=list(block_modes), cross_node_bytes=crossing,
        )

    def _modes_of(self, which: frozenset[int], selective: frozenset[int]
                  ) -> tuple[list[BlockMode], dict[str, tuple[float, float]]]:
        """The checkpointed blocks' modes, in block order, and each one's recompute seconds
        (compute, host) by block: the same for every candidate with that checkpointing, so
        worked out once per mix (read only)."""
        key = (which, selective)
        found = self._block_modes.get(key)
        if found is None:
            blocks = self.graph.blocks
            modes = [self._block_mode(blocks[i], "selective" if i in selective else "full")
                     for i in sorted(which | selective)]
            found = self._block_modes[key] = (
                modes, {m.block: (m.recompute_s, m.recompute_host_s) for m in modes})
        return found

    def _units_and_calls(self, layout: Layout) -> tuple[list[UnitSpec], list[int]]:
        """The units of ``layout`` and each one's forward calls, built once per
        ``Layout.units_key``: the search evaluates one layout under many checkpointing and
        prefetch choices, and nothing changes a candidate's units."""
        found = self._unit_layouts.get(layout.units_key)
        if found is None:
            units = self.units_of(layout)
            found = self._unit_layouts[layout.units_key] = (units, self._calls(units))
        return found

    def _communication(self, layout: Layout, units: list[UnitSpec], ran: tuple[bool, ...],
                       calls: list[int]) -> tuple[dict[str, int], dict[str, int], int]:
        """Collectives per step under FSDP2 and FSDP1 and the bytes crossing nodes of
        ``layout``'s units (``_units_and_calls``) given which ran forward; cached by its
        ``units_key``, which ran and the strategy (FSDP1's counts read it)."""
        key = (layout.units_key, layout.strategy, ran)
        found = self._communicated.get(key)
        if found is not None:
            return found
        s = self.settings
        replicate, shard = layout.mesh
        found = self._communicated[key] = (
            per_step(count_fsdp2(units, replicate=replicate, shard=shard, ran=list(ran),
                                 calls=calls), s.grad_accum_steps, s.gradient_sync),
            per_step(count_fsdp1(units, strategy=layout.strategy, replicate=replicate,
                                 ran=list(ran), calls=calls),
                     s.grad_accum_steps, s.gradient_sync),
            cross_node_bytes(units, replicate=replicate, shard=shard, world_size=s.world_size,
                             gpus_per_node=s.gpus_per_node, precision=s.precision))
        return found

    def step_context(self, shard: int, *, offload: bool = False,
                     optimizer_overlap: bool = False) -> StepContext:
        """What the memory model holds fixed for a layout sharded over ``shard`` ranks (with
        ``CPUOffloadPolicy``: no accumulation held on the device, cost/memory.py; with
        ``optimizer_overlap``: no gradients outlive their unit's step)."""
        s = self.settings
        if offload:
            return StepContext(precision=s.precision, shard_size=shard, optimizer=s.optimizer,
                               buffer_bytes=self.graph.total_buffer_bytes,
                               input_bytes=self.analysis.input_bytes, offload=True)
        return StepContext(precision=s.precision, shard_size=shard, optimizer=s.optimizer,
                           buffer_bytes=self.graph.total_buffer_bytes,
                           input_bytes=self.analysis.input_bytes,
                           grad_accum_steps=s.grad_accum_steps, gradient_sync=s.gradient_sync,
                           optimizer_overlap=optimizer_overlap)

    def profile_of(self, candidate: Candidate) -> ActivationProfile:
        """The activation profile ``candidate`` was evaluated with (its checkpointed blocks)."""
        layout = candidate.layout
        return self.profile(layout.full, layout.selective - layout.full)

    def with_budget(self, budget_bytes: int, headroom_bytes: int) -> Evaluator:
        """This evaluator at another budget, sharing every cache (profiles, unit costs): none
        depends on the budget, which only decides what fits (the frontier searches many)."""
        other = copy.copy(self)
        other.settings = dataclasses.replace(self.settings, budget_bytes=budget_bytes,
                                             headroom_bytes=headroom_bytes)
        other.serves_seen = True  # [Note: evaluations across budgets]
        other.fastest_fitting_s = math.inf
        return other

    def units_of(self, layout: Layout) -> list[UnitSpec]:
        """The ``fully_shard`` units of a sharded layout, children first, the root last."""
        return build_units(self.graph, [list(g) for g in layout.groups] + [[""]],
                           [*layout.reshard, layout.root_reshard], layout.shard)

    def _offloaded(self, candidate: Candidate) -> Candidate:
        """``candidate`` with ``CPUOffloadPolicy``: device peak and step time
        (cost/offload.py [Note: offload as the last resort])."""
        s = self.settings
        layout = candidate.layout
        ctx = self.step_context(layout.shard, offload=True)
        profile = self.profile(layout.full, layout.selective - layout.full)
        memory = estimate_peak(profile, candidate.units, ctx,
                               forward_prefetch=layout.forward_prefetch,
                               backward_prefetch=layout.backward_prefetch)
        orig = s.precision.orig_bytes
        copy_s, exposed, cpu_optimizer_s = offload_seconds(candidate.units, candidate.time,
                                                           s.hardware, s.optimizer, orig)
        ran = list(profile.ran_of(candidate.units))
        return dataclasses.replace(
            candidate, memory=memory,
            deferred_time=Deferred.known(offloaded_time(candidate.time, copy_s, exposed,
                                                        cpu_optimizer_s)),
            fits=runnable(candidate.units, ran) and memory.peak_bytes <= s.limit_bytes,
            detail=OffloadDetail(host_bytes=host_bytes(candidate.units, s.optimizer, orig),
                                 copy_s=copy_s))

    def ddp_ready_order(self) -> DdpOrder:
        """DDP's parameters in the order their gradients become ready in the step as DDP
        computes it (``Analysis.for_ddp``), shared by every bucket configuration (and read by
        the DDP strategy for the parameters that get none)."""
        if self._ddp_order is None:
            self._ddp_order = ddp_order(self.graph, self.analysis.for_ddp().timeline.events)
        return self._ddp_order

    def _replicated(self, layout: Layout, name: str) -> Candidate:
        """``DistributedDataParallel`` with ``layout.ddp``'s buckets (cost/ddp_buckets.py)."""
        s = self.settings
        analysis = self.analysis.for_ddp()  # below float32 DDP computes under autocast (SPEC 7)
        if self._ddp_times is None:
            events = analysis.timeline.events
            self._ddp_times = event_times(events, s.hardware, analysis.param_dtype)
            self._ddp_issued = host_issue_times(events, s.hardware)
        assert layout.ddp is not None, "a DDP layout carries its bucket configuration"
        e = evaluate_ddp(self.graph, analysis, layout.ddp, hw=s.hardware,
                         world_size=s.world_size, gpus_per_node=s.gpus_per_node,
                         precision=s.precision, optimizer=s.optimizer,
                         dtype=analysis.param_dtype, shared=self.ddp_ready_order(),
                         times=self._ddp_times, issued=self._ddp_issued,
                         grad_accum_steps=s.grad_accum_steps,
                         gradient_sync=s.gradient_sync,
                         optimizer_overlap=layout.optimizer_overlap,
                         step_times=self._ddp_step_times)
        return Candidate(
            name=name, layout=layout, units=build_units(self.graph, [[""]], [False], 1),
            memory=e.memory, deferred_time=Deferred.known(e.time),
            collectives=dict(e.collectives),
            collectives_fsdp1=dict(e.collectives),
            fits=e.memory.peak_bytes <= s.limit_bytes,
            detail=DDPDetail(config=e.config, buckets=e.buckets, unused=e.unused,
                             ready_s=e.ready_s))

    def _block_costs(self, like: Evaluator | None = None) -> dict[str, dict[str, BlockMode]]:
        """Per block and mode: bytes saved and recompute seconds ([Note: recompute time]);
        a fully checkpointed block's from ``like`` when it shares this one's passes and
        clock."""
        hw = self.settings.hardware
        rates = Rates.of(hw, self.analysis.param_dtype) if hw else None
        c = self.composer
        modes = ["full"] if c.ckpt_seg is not None else []
        modes += ["selective"] if c.sel_seg is not None else []
        out: dict[str, dict[str, BlockMode]] = {}
        self._plain_ops: list[dict[str, float] | None] = []
        """Each block's backward op counters in the plain pass (``like``'s when its plain
        pass is this one's), read for both modes."""
        if c.plain_seg is None:
            return out
        shared = like is not None and like.clock is self.clock and like.composer.ckpt is c.ckpt
        sums = _OpSums()
        self._plain_ops = (
            like._plain_ops if like is not None and like.composer.plain is c.plain
            else [_backward_ops(c, i, "none", sums) for i in range(len(self.graph.blocks))])
        for i, b in enumerate(self.graph.blocks):
            kept, _ = c.segment_delta(i, "none")
            plain_ops = self._plain_ops[i]
            per: dict[str, BlockMode] = {}
            for mode in modes:
                if shared and mode == "full" and "full" in like.block_cost.get(b, {}):
                    per[mode] = like.block_cost[b]["full"]
                    continue
                level, _ = c.segment_delta(i, mode)
                # under autocast the cached weight casts a checkpointed block's forward made are
                # freed before backward: [Note: autocast and checkpointed blocks]
                saved = max(0, kept - level + c.released_delta(i, mode))
                flops, ops = _replayed(c, i, mode, plain_ops, sums)
                compiled = (self.compiled_s.recompute_s.get(b, {}).get(mode)
                            if self.compiled_s is not None else None)
                host_s = 0.0
                if rates is None:
                    seconds = 0.0
                elif compiled is not None:  # [Note: compiled block time]
                    seconds = compiled
                elif ops is not None:
                    seconds = compute_time(rates, ops, flops)
                    host_s = issue_time(rates, ops)
                else:  # facts without op counters: the FLOPs, and for the memory-bound ops
                    # the bytes no longer kept, written once and read once
                    flops = self.block_fw.get(b, flops) if mode == "full" else flops
                    seconds = (compute_time(rates, None, flops)
                               + compute_time(rates, {"memory_bytes": 2.0 * saved}, 0.0))
                if rates is not None:  # the checkpoint wrapper's own host cost
                    if rates.async_launch:
                        host_s += rates.checkpoint_overhead_s
                    else:
                        seconds += rates.checkpoint_overhead_s
                per[mode] = BlockMode(block=b, mode=mode, saved_bytes=saved, recompute_s=seconds,
                                      recompute_host_s=host_s)
            out[b] = per
        return out

    def _calls(self, units: list[UnitSpec]) -> list[int]:
        """Forward calls of each unit's modules in one step (a shared module runs twice): the
        most of any of its analysed modules (1 for a unit with none). Only a module not called
        exactly once makes that other than 1, so a unit with none of those reads 1 at once."""
        mods = self.analysis.modules
        if self._not_once is None:
            self._not_once = frozenset(m for m, info in mods.items() if info.calls != 1)
        not_once = self._not_once
        return [1 if not_once.isdisjoint(u.modules)
                else max([mods[m].calls for m in u.modules if m in mods] or [1]) for u in units]

    def profile(self, checkpointed: frozenset[int],
                selective: frozenset[int] = frozenset()) -> ActivationProfile:
        """The activation profile with the given block indices fully and selectively
        checkpointed."""
        key = (checkpointed, selective)
        if key not in self._profiles:
            self._profiles[key] = ActivationProfile(self.composer.events(checkpointed, selective))
        return self._profiles[key]

    def checkpoint_options(self) -> list[list[tuple[int, int]]]:
        """Paths of ``(n_full, n_selective)`` block counts to search, each ordered by recompute
        time with the peak falling along it ([Note: choosing checkpointing modes])."""
        c = self.composer
        n = c.max_checkpointed
        if n == 0:
            return [[(0, 0)]]
        full = [(k, 0) for k in range(n + 1)] if c.supports_partial() else [(0, 0), (n, 0)]
        if not c.has_selective:
            return [full]
        if not c.supports_mixed():
            return [full, [(0, 0), (0, n)]]
        # The cheaper path by the modes' bytes saved per recompute second, summed over blocks.
        per = [m for m in self.block_cost.values() if "full" in m and "selective" in m]
        sel_saved = sum(m["selective"].saved_bytes for m in per)
        full_saved = sum(m["full"].saved_bytes for m in per)
        sel_s = sum(m["selective"].recompute_s for m in per)
        full_s = sum(m["full"].recompute_s for m in per)
        if sel_saved <= 0 or sel_saved * full_s <= full_saved * sel_s:
            return [full]  # selective saves less per second than full: never on the hull
        return [[(0, k) for k in range(n + 1)] + [(k, n - k) for k in range(1, n + 1)]]

    def _block_mode(self, block: str, mode: str) -> BlockMode:
        cost = self.block_cost.get(block, {}).get(mode)
        if cost is None:  # a hand-written plan on blocks without aligned segments
            hw = self.settings.hardware
            rate = hw.peak_flops * hw.efficiency if hw else 1.0
            flops = self.block_fw.get(block, 0.0) if mode == "full" else 0.0
            cost = BlockMode(block=block, mode=mode, saved_bytes=0, recompute_s=flops / rate)
        return cost



class _OpSums:
    """``_block_costs``'s sums of op counters, by the identity of what they sum: a deep
    model's repeated blocks replay the same events' counters (the depth-cut analysis repeats
    its middle block's, facts/depth.py), so 80 blocks' segments are summed once. Lives for
    one ``_block_costs`` call, while the counters it names by ``id`` are alive."""

    def __init__(self) -> None:
        self.segments: dict[tuple[int, ...], dict[str, float]] = {}
        self.deltas: dict[tuple[int, int], dict[str, float]] = {}


def _replayed(composer: TimelineComposer, i: int, mode: str,
              plain_ops: dict[str, float] | None, sums: _OpSums
              ) -> tuple[float, dict[str, float] | None]:
    """FLOPs and op-class counters ([Note: op classes]) block ``i`` replays in backward in
    ``mode``: its backward segment in that mode's pass minus the plain pass's, whose counters
    are ``plain_ops`` (``_backward_ops``; None for the counters when either has none).

    See [Note: recompute time].
    """
    _, flops = composer.segment_delta(i, mode, "bw")
    _, plain = composer.segment_delta(i, "none", "bw")
    ops = None if plain_ops is None else _backward_ops(composer, i, mode, sums)
    if ops is None:
        return max(0.0, flops - plain), None
    key = (id(plain_ops), id(ops))
    delta = sums.deltas.get(key)
    if delta is None:
        delta = sums.deltas[key] = {k: max(0.0, ops.get(k, 0.0) - plain_ops.get(k, 0.0))
                                    for k in set(plain_ops) | set(ops)}
    return max(0.0, flops - plain), delta


def _backward_ops(composer: TimelineComposer, i: int, mode: str, sums: _OpSums
                  ) -> dict[str, float] | None:
    """The op-class counters of block ``i``'s backward segment in the pass of ``mode``,
    summed (None when its events have none); read only (``sums`` shares it)."""
    _, segments = composer.pass_of(mode)
    start, end = segments.bw[i]
    ops = composer.ops_of(mode)[start + 1:end + 1]
    if not any(ops):
        return None
    key = tuple(map(id, ops))
    total = sums.segments.get(key)
    if total is None:
        total = sums.segments[key] = {}
        for o in ops:
            add_ops(total, o)
    return total


def _exclusive_flops(graph: ModuleGraph, analysis: Analysis) -> tuple[dict[str, float], dict[str, float]]:
    """FLOPs of each module's own ops ([Note: FLOP attribution]); the root takes the rest."""
    fw = {m: c.own_fw_flops for m, c in analysis.modules.items() if m and m in graph.modules}
    bw = {m: c.own_bw_flops for m, c in analysis.modules.items() if m and m in graph.modules}
    # Ops outside every module (the loss) and the root's own ops: the root's unit runs them.
    fw[""] = max(0.0, analysis.total_fw_flops - sum(fw.values()))
    bw[""] = max(0.0, analysis.total_bw_flops - sum(bw.values()))
    return fw, bw




def runnable(units: list[UnitSpec], ran: list[bool]) -> bool:
    """Whether every unit with parameters runs forward: FSDP2 unshards a unit in its forward
    pre-hook, so a unit that never runs forward (a container such as ``ModuleList``) would
    leave its parameters sharded."""
    return all(r or u.numel == 0 or u.modules == [""] for r, u in zip(ran, units))
