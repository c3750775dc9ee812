"""The search: a pure function from the analysis and the budget to ranked, evaluated candidates.

[Note: search space]
For each strategy (full sharding, HSDP with the shard axis inside a node, grad-op, none),
each unit layout (one unit per repeated block with the other parameterised top-level modules
as their own units, or left in the root), the last block's ``reshard_after_forward``,
forward prefetch depth 0-1 and backward prefetch depth 1-2, the memory model is monotone in
the number of checkpointed blocks, so a binary search finds the fewest checkpointed blocks
that fit; that is the fastest variant of the configuration. The winner is the fitting
candidate with the lowest simulated step time. Standard recipes (torchtitan's one unit per
block, FSDP1's size-based policy, root only) are evaluated with the same models for the report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import partial

from fsdp_plan.cost.collectives import count_fsdp1, count_fsdp2, per_step
from fsdp_plan.cost.hardware import Hardware
from fsdp_plan.cost.memory import (
    OPTIMIZER_STATES,
    ActivationProfile,
    MemoryEstimate,
    Precision,
    StepContext,
    estimate_peak,
)
from fsdp_plan.cost.step_time import (
    Rates,
    StepTime,
    UnitCost,
    accumulated_step,
    add_ops,
    collective_time,
    compute_time,
    exclusive_ops,
    fsdp_copy_time,
    optimizer_time,
    ranks_per_node_in,
    simulate_step,
)
from fsdp_plan.cost.timeline import TimelineComposer
from fsdp_plan.cost.units import UnitSpec, build_units, check_tied, with_full_precision_units
from fsdp_plan.facts.checkpointing import mode_sets
from fsdp_plan.facts.types import Analysis, ModuleGraph
from fsdp_plan.search.grouping import CommSetup, grouped_block_layouts

FSDP1_DEFAULT_MIN_PARAMS = 100_000_000


@dataclass(kw_only=True)
class SearchSettings:
    """The user's constraints, fixed during the search."""

    budget_bytes: int
    headroom_bytes: int
    world_size: int
    gpus_per_node: int
    strategy: str = "auto"
    precision: Precision = field(default_factory=Precision)
    optimizer: str = "adamw"
    hardware: Hardware | None = None
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step: memory, time and counts cover the whole step."""
    gradient_sync: str = "every"
    """Reduce gradients after ``every`` micro-batch or only the ``last``."""

    @property
    def limit_bytes(self) -> int:
        return self.budget_bytes - self.headroom_bytes


@dataclass(kw_only=True)
class Candidate:
    """One fully evaluated plan."""

    name: str
    strategy: str
    replicate: int
    shard: int
    units: list[UnitSpec]
    checkpointed: list[str]
    forward_prefetch: int
    backward_prefetch: int
    memory: MemoryEstimate
    time: StepTime
    collectives: dict[str, int]
    collectives_fsdp1: dict[str, int]
    fits: bool
    cross_node_bytes: int = 0
    """Bytes one GPU sends across nodes per step (``cross_node_bytes``)."""
    selective: list[str] = field(default_factory=list)
    """The blocks of ``checkpointed`` in selective mode (the others are fully checkpointed)."""
    block_modes: list[BlockMode] = field(default_factory=list)
    """Per checkpointed block: its mode, what it saves and what it costs."""

    @property
    def recompute_s(self) -> float:
        """Seconds of backward spent replaying checkpointed forwards (all blocks)."""
        return sum(m.recompute_s for m in self.block_modes)


@dataclass(kw_only=True, frozen=True)
class BlockMode:
    """One checkpointed block: ``full`` or ``selective``, the activation bytes its mode keeps
    out of memory (forward level rise saved against no checkpointing) and its replay time."""

    block: str
    mode: str
    saved_bytes: int
    recompute_s: float


class Evaluator:
    """Evaluates candidates against one analysis; caches the per-``k`` activation profiles."""

    def __init__(self, graph: ModuleGraph, analysis: Analysis, settings: SearchSettings) -> None:
        self.graph = graph
        self.analysis = analysis
        self.settings = settings
        self.composer = TimelineComposer(analysis, graph.blocks)
        self._profiles: dict[frozenset[int], ActivationProfile] = {}
        self.exclusive_fw, self.exclusive_bw = _exclusive_flops(graph, analysis)
        self.block_fw = {b: analysis.modules[b].fw_flops for b in graph.blocks if b in analysis.modules}
        self._flops_cache: dict[tuple[str, ...], tuple[float, float, frozenset[str]]] = {}
        self._ops_cache: dict[tuple[str, ...], tuple[dict, dict]] = {}
        self._cost_cache: dict[tuple, UnitCost] = {}
        """A unit's times without recompute, by what it owns, its bytes and the mesh."""
        self._param_tensors = sum(len(i.param_shapes) for i in graph.modules.values())
        self.block_cost = self._block_costs()

    def _block_costs(self) -> dict[str, dict[str, BlockMode]]:
        """Per block and mode: bytes saved and recompute seconds ([Note: recompute time])."""
        hw = self.settings.hardware
        rates = Rates.of(hw, self.analysis.param_dtype) if hw else None
        c = self.composer
        modes = ["full"] if c.ckpt_seg is not None else []
        modes += ["selective"] if c.sel_seg is not None else []
        out: dict[str, dict[str, BlockMode]] = {}
        if c.plain_seg is None:
            return out
        for i, b in enumerate(self.graph.blocks):
            kept, _ = c.segment_delta(i, "none")
            per: dict[str, BlockMode] = {}
            for mode in modes:
                level, _ = c.segment_delta(i, mode)
                saved = max(0, kept - level)
                flops, ops = _replayed(c, i, mode)
                if rates is None:
                    seconds = 0.0
                elif ops is not None:
                    seconds = compute_time(rates, ops, flops)
                else:  # facts without op counters: the FLOPs, and for the memory-bound ops
                    # the bytes no longer kept, written once and read once
                    flops = self.block_fw.get(b, flops) if mode == "full" else flops
                    seconds = (compute_time(rates, None, flops)
                               + compute_time(rates, {"memory_bytes": 2.0 * saved}, 0.0))
                per[mode] = BlockMode(block=b, mode=mode, saved_bytes=saved, recompute_s=seconds)
            out[b] = per
        return out

    def _calls(self, units: list[UnitSpec]) -> list[int]:
        """Forward calls of each unit's modules in one step (a shared module runs twice)."""
        mods = self.analysis.modules
        return [max([mods[m].calls for m in u.modules if m in mods] or [1]) for u in units]

    def _unit_flops(self, unit: UnitSpec) -> tuple[float, float, frozenset[str]]:
        """Forward and backward FLOPs of the modules a unit owns, and those modules."""
        key = tuple(unit.owned_modules)
        if key not in self._flops_cache:
            self._flops_cache[key] = (
                sum(self.exclusive_fw.get(m, 0.0) for m in unit.owned_modules),
                sum(self.exclusive_bw.get(m, 0.0) for m in unit.owned_modules),
                frozenset(unit.owned_modules))
        return self._flops_cache[key]

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

    def evaluate(self, *, name: str, strategy: str, replicate: int, shard: int,
                 groups: list[list[str]], reshard: list[bool], root_reshard: bool, k: int = 0,
                 forward_prefetch: int, backward_prefetch: int,
                 checkpoint: frozenset[int] | None = None,
                 selective: frozenset[int] = frozenset()) -> Candidate:
        """One plan: ``groups`` (children first, root excluded), the first ``k`` blocks
        fully checkpointed, or the block indices in ``checkpoint`` when given, and the block
        indices in ``selective`` selectively checkpointed."""
        s = self.settings
        which = frozenset(range(k)) if checkpoint is None else frozenset(checkpoint)
        selective = frozenset(selective) - which
        units = build_units(self.graph, groups + [[""]], reshard + [root_reshard], shard)
        ctx = StepContext(precision=s.precision, shard_size=shard, optimizer=s.optimizer,
                          buffer_bytes=self.graph.total_buffer_bytes,
                          input_bytes=self.analysis.input_bytes,
                          grad_accum_steps=s.grad_accum_steps, gradient_sync=s.gradient_sync)
        profile = self.profile(which, selective)
        memory = estimate_peak(profile, units, ctx, forward_prefetch=forward_prefetch,
                               backward_prefetch=backward_prefetch)
        ran = [profile.ran(u) for u in units]
        # FSDP2 unshards a unit in its forward pre-hook: a unit that never runs forward
        # (a container such as ModuleList) would leave its parameters sharded.
        runnable = all(r or u.numel == 0 or u.modules == [""] for r, u in zip(ran, units))
        blocks = self.graph.blocks
        checkpointed = [blocks[i] for i in sorted(which | selective)]
        block_modes = [self._block_mode(blocks[i], "selective" if i in selective else "full")
                       for i in sorted(which | selective)]
        time = self._time(units, shard, replicate, block_modes, forward_prefetch, backward_prefetch)
        return Candidate(
            name=name, strategy=strategy, replicate=replicate, shard=shard, units=units,
            checkpointed=checkpointed, forward_prefetch=forward_prefetch,
            backward_prefetch=backward_prefetch, memory=memory, time=time,
            collectives=per_step(count_fsdp2(units, replicate=replicate, shard=shard, ran=ran,
                                             calls=self._calls(units)),
                                 s.grad_accum_steps, s.gradient_sync),
            collectives_fsdp1=per_step(count_fsdp1(units, strategy=strategy, replicate=replicate,
                                                   ran=ran, calls=self._calls(units)),
                                       s.grad_accum_steps, s.gradient_sync),
            fits=runnable and memory.peak_bytes <= s.limit_bytes,
            selective=[blocks[i] for i in sorted(selective)], block_modes=block_modes,
            cross_node_bytes=cross_node_bytes(units, replicate=replicate, shard=shard,
                                              world_size=s.world_size,
                                              gpus_per_node=s.gpus_per_node,
                                              precision=s.precision),
        )

    def _unit_ops(self, unit: UnitSpec, own_fw, own_bw
                  ) -> tuple[dict[str, float], dict[str, float]]:
        """The op counters of the modules a unit owns, cached by those modules (the search
        times the same units under many prefetch and strategy choices)."""
        key = tuple(unit.owned_modules)
        if key not in self._ops_cache:
            fw_ops: dict[str, float] = {}
            bw_ops: dict[str, float] = {}
            for m in unit.owned_modules:
                add_ops(fw_ops, own_fw.get(m))
                add_ops(bw_ops, own_bw.get(m))
            self._ops_cache[key] = (fw_ops, bw_ops)
        return self._ops_cache[key]

    def _block_mode(self, block: str, mode: str) -> BlockMode:
        cost = self.block_cost.get(block, {}).get(mode)
        if cost is None:  # a hand-written plan on blocks without aligned segments
            hw = self.settings.hardware
            rate = hw.peak_flops * hw.efficiency if hw else 1.0
            flops = self.block_fw.get(block, 0.0) if mode == "full" else 0.0
            cost = BlockMode(block=block, mode=mode, saved_bytes=0, recompute_s=flops / rate)
        return cost

    def _time(self, units: list[UnitSpec], shard: int, replicate: int,
              block_modes: list[BlockMode], forward_prefetch: int, backward_prefetch: int
              ) -> StepTime:
        """Per-op unit times ([Note: per-op compute time] in cost.py), then the two streams."""
        s = self.settings
        hw = s.hardware
        assert hw is not None
        rates = Rates.of(hw, self.analysis.param_dtype)
        if not hasattr(self, "_own_ops"):  # each module's own op counters, once per evaluator
            self._own_ops = exclusive_ops(set(self.graph.modules), self.analysis.modules)
        own_fw, own_bw = self._own_ops
        p = s.precision
        shard_local = ranks_per_node_in(shard, 1, s.gpus_per_node)
        replicate_local = ranks_per_node_in(replicate, shard, s.gpus_per_node)
        recompute_of = {m.block: m.recompute_s for m in block_modes}
        costs: list[UnitCost] = []
        for u in units:
            fw, bw, owned = self._unit_flops(u)
            # The same unit recurs across prefetch, strategy and checkpointing choices: its
            # times without recompute depend only on what it owns, its bytes and the mesh.
            key = (owned, u.key, u.numel, u.shard_numel, p.unit_param_bytes(u),
                   u.reshard_after_forward, shard, replicate)
            base = self._cost_cache.get(key)
            if base is None:
                fw_ops, bw_ops = self._unit_ops(u, own_fw, own_bw)
                unsharded = u.unsharded_numel(shard)
                ag_bytes = unsharded * p.unit_param_bytes(u)
                rs_bytes = unsharded * p.reduce_bytes
                base = self._cost_cache[key] = UnitCost(
                    key=u.key or "<root>",
                    fw_compute_s=compute_time(rates, fw_ops, fw) + hw.unit_overhead_s,
                    bw_compute_s=compute_time(rates, bw_ops, bw) + hw.unit_overhead_s,
                    all_gather_s=collective_time(hw, ag_bytes, shard, ranks_per_node=shard_local)
                    + fsdp_copy_time(hw, rates, ag_bytes, "all_gather") if u.numel else 0.0,
                    reduce_scatter_s=collective_time(hw, rs_bytes, shard, "reduce_scatter",
                                                     ranks_per_node=shard_local)
                    + fsdp_copy_time(hw, rates, rs_bytes, "reduce_scatter")
                    if u.numel else 0.0,
                    all_reduce_s=collective_time(hw, u.shard_numel * p.reduce_bytes, replicate,
                                                 "all_reduce", ranks_per_node=replicate_local)
                    if replicate > 1 and u.numel else 0.0,
                    regather=u.reshard_after_forward,
                )
            # A checkpointed block's forward (or, selective, its unsaved ops) runs again inside
            # its unit's backward: [Note: recompute time].
            recompute_s = (sum(recompute_of[b] for b in owned if b in recompute_of)
                           if recompute_of else 0.0)
            costs.append(dataclasses.replace(base, bw_compute_s=base.bw_compute_s + recompute_s)
                         if recompute_s else base)
        # Forward order: the root gathers first, then units as they run.
        root = [c for c in costs if c.key == "<root>"]
        ordered = root + [c for c in costs if c.key != "<root>"]
        total_shard = sum(u.shard_numel for u in units)
        optimizer_s = optimizer_time(hw, rates, s.optimizer, total_shard, p.orig_bytes,
                                     OPTIMIZER_STATES.get(s.optimizer, 0), self._param_tensors)
        step = simulate_step(ordered, hw, forward_prefetch=forward_prefetch,
                             backward_prefetch=backward_prefetch, optimizer_s=optimizer_s)
        if s.grad_accum_steps == 1:
            return step
        earlier = step
        if s.gradient_sync == "last":  # micro-batches before the last reduce nothing
            quiet = [dataclasses.replace(c, reduce_scatter_s=0.0, all_reduce_s=0.0)
                     for c in ordered]
            earlier = simulate_step(quiet, hw, forward_prefetch=forward_prefetch,
                                    backward_prefetch=backward_prefetch, optimizer_s=optimizer_s)
        return accumulated_step(step, earlier, s.grad_accum_steps)


def _replayed(composer: TimelineComposer, i: int, mode: str
              ) -> tuple[float, dict[str, float] | None]:
    """FLOPs and op-class counters ([Note: op classes]) block ``i`` replays in backward in
    ``mode``: its backward segment in that mode's pass minus the plain pass's (None for the
    counters when the analysis has none).

    [Note: recompute time]
    A checkpointed block replays part of its forward inside its unit's backward: all of it
    (``full``) or the ops not saved (``selective``: norms, activations, rotary embeddings,
    casts: few FLOPs, much memory traffic). Both are measured per block as the backward its
    mode's pass ran beyond the plain pass's, and timed like any other ops (cost.py
    ``compute_time``: matmul FLOPs by shape class, attention, memory-bound bytes, per-op
    overhead). The cost of a set of modes is the sum over its blocks."""
    _, flops = composer.segment_delta(i, mode, "bw")
    _, plain = composer.segment_delta(i, "none", "bw")
    counters: list[dict[str, float]] = []
    for src, seg in ((composer.plain, composer.plain_seg),
                     ({"full": composer.ckpt, "selective": composer.sel}[mode],
                      {"full": composer.ckpt_seg, "selective": composer.sel_seg}[mode])):
        start, end = seg.bw[i]
        ops = [getattr(e, "ops", None) for e in src.events[start + 1:end + 1]]
        if not any(ops):
            return max(0.0, flops - plain), None
        total: dict[str, float] = {}
        for o in ops:
            add_ops(total, o)
        counters.append(total)
    delta = {k: max(0.0, counters[1].get(k, 0.0) - counters[0].get(k, 0.0))
             for k in set(counters[0]) | set(counters[1])}
    return max(0.0, flops - plain), delta


def _exclusive_flops(graph: ModuleGraph, analysis: Analysis) -> tuple[dict[str, float], dict[str, float]]:
    """FLOPs of each module's own ops ([Note: FLOP attribution]); the root takes the rest."""
    fw = {m: c.own_fw_flops for m, c in analysis.modules.items() if m and m in graph.modules}
    bw = {m: c.own_bw_flops for m, c in analysis.modules.items() if m and m in graph.modules}
    # Ops outside every module (the loss) and the root's own ops: the root's unit runs them.
    fw[""] = max(0.0, analysis.total_fw_flops - sum(fw.values()))
    bw[""] = max(0.0, analysis.total_bw_flops - sum(bw.values()))
    return fw, bw


def block_layouts(graph: ModuleGraph, full_precision_units: bool = True,
                  evaluator: Evaluator | None = None) -> dict[str, list[list[str]]]:
    """Unit layouts to try: blocks alone, or blocks plus other top-level parameter holders,
    and (given the ``evaluator``, for its analysis and hardware) consecutive blocks grouped
    into units where the shortest path over block boundaries says so ([Note: grouped units]).

    ``full_precision_units``: give batch norm units of its own (the plan computes below
    float32; [Note: batch norm in full precision])."""
    blocks = graph.blocks
    layouts: dict[str, list[list[str]]] = {}
    if blocks:
        layouts["per-block"] = [[b] for b in blocks]
        extra = _top_level_units(graph)
        order = {fqn: i for i, fqn in enumerate(graph.modules)}
        if extra:
            groups = [[b] for b in blocks] + extra
            groups.sort(key=lambda g: order[g[0]])
            layouts["per-block+top"] = groups
        if evaluator is not None:
            for multiple, grouped in _grouped_layouts(evaluator).items():
                groups = grouped + extra
                groups.sort(key=lambda g: order[g[0]])
                layouts[f"grouped/{multiple}x" + ("+top" if extra else "")] = groups
    else:
        # No repeated blocks (a CNN, an MLP): wrap big subtrees, at a few granularities.
        for parts in (4, 16, 64):
            groups = size_based_units(graph, max(1, graph.total_numel // parts))
            if groups and groups not in layouts.values():
                layouts[f"size/{parts}"] = groups
    layouts["root-only"] = []
    # Batch norm is a unit of its own in every layout: [Note: batch norm in full precision].
    return {k: with_full_precision_units(graph, v) if full_precision_units else v
            for k, v in layouts.items() if check_tied(graph, v)}


def _grouped_layouts(evaluator: Evaluator) -> dict[int, list[list[str]]]:
    """Block groups for a few memory allowances ([Note: grouped units]), cut for full sharding
    over the whole world (the search evaluates them under every strategy)."""
    s = evaluator.settings
    if s.hardware is None or s.world_size <= 1:
        return {}
    setup = CommSetup(hardware=s.hardware, shard=s.world_size,
                      ranks_per_node=ranks_per_node_in(s.world_size, 1, s.gpus_per_node),
                      param_bytes=s.precision.param_bytes, reduce_bytes=s.precision.reduce_bytes)
    return grouped_block_layouts(evaluator.graph, evaluator.analysis, setup)


def _top_level_units(graph: ModuleGraph) -> list[list[str]]:
    """Parameterised top-level modules outside the block stacks, tied ones grouped together."""
    root = graph.modules[""]
    block_set = set(graph.blocks)
    containers = {b.rpartition(".")[0] for b in graph.blocks}
    total = graph.total_numel or 1
    singles = [c for c in root.children
               if c not in block_set and c not in containers
               and not any(b.startswith(c + ".") for b in block_set)
               and graph.modules[c].subtree_numel >= 0.001 * total]
    groups: list[list[str]] = []
    for c in singles:
        tied = next((g for g in graph.tied_groups if any(m == c or m.startswith(c + ".") for m in g)), None)
        if tied:
            members = sorted({s for s in singles if any(m == s or m.startswith(s + ".") for m in tied)})
            if members not in groups:
                groups.append(members)
        else:
            groups.append([c])
    return groups


def size_based_units(graph: ModuleGraph, min_num_params: int = FSDP1_DEFAULT_MIN_PARAMS) -> list[list[str]]:
    """What FSDP1's ``size_based_auto_wrap_policy`` wraps: modules whose unwrapped subtree is big."""
    wrapped: list[str] = []
    remaining: dict[str, int] = {}
    for fqn in reversed(list(graph.modules)):
        info = graph.modules[fqn]
        left = info.direct_numel + sum(remaining[c] for c in info.children)
        # FSDP1 never wraps containers (exclude_wrap_modules): their forward never runs.
        if fqn and left >= min_num_params and info.class_name not in ("ModuleList", "ModuleDict"):
            wrapped.append(fqn)
            left = 0
        remaining[fqn] = left
    order = {fqn: i for i, fqn in enumerate(graph.modules)}
    # children first: deeper modules come later in named_modules order, so sort by depth desc
    wrapped.sort(key=lambda f: (-f.count("."), order[f]))
    return [[f] for f in wrapped]


def hybrid_shard_sizes(world_size: int, gpus_per_node: int) -> list[int]:
    """Shard-group sizes HSDP can use on ``world_size`` ranks: every proper divisor of the world
    size that is a whole number of nodes (1 node, 2 nodes, ...) or part of one node (when a
    node has more GPUs than the model needs to be sharded over)."""
    return [s for s in range(2, world_size) if world_size % s == 0
            and (s % gpus_per_node == 0 or gpus_per_node % s == 0)]


def strategies_for(settings: SearchSettings) -> list[tuple[str, int, int]]:
    """(strategy, replicate, shard) options for the user's ``--strategy``; HSDP at every shard
    size ``hybrid_shard_sizes`` allows, each with its own cross-node traffic."""
    w, gpn = settings.world_size, settings.gpus_per_node
    options: dict[str, list[tuple[str, int, int]]] = {
        "full": [("full", 1, w)],
        "grad-op": [("grad-op", 1, w)],
        "none": [("none", w, 1)],
        "hybrid": [("hybrid", w // s, s) for s in hybrid_shard_sizes(w, gpn)],
    }
    if settings.strategy == "ddp":
        return []  # DDP replicates without FSDP: its candidates come from ddp.py (search)
    if settings.strategy == "auto":
        return [o for opts in options.values() for o in opts]
    if settings.strategy == "hybrid" and not options["hybrid"]:
        return [("hybrid", 1, w)]
    return options[settings.strategy]


def cross_node_bytes(units: list[UnitSpec], *, replicate: int, shard: int, world_size: int,
                     gpus_per_node: int, precision: Precision) -> int:
    """Bytes one GPU sends across nodes per step: ring all-gathers (forward, and backward for
    units that reshard) and reduce-scatters when a shard group spans nodes, and the HSDP
    all-reduce when a replicate group does."""
    total = 0.0
    if shard > gpus_per_node:
        ring = (shard - 1) / shard
        for u in units:
            if u.numel:
                gathers = 2 if u.reshard_after_forward else 1
                total += ring * u.unsharded_numel(shard) * (
                    gathers * precision.unit_param_bytes(u) + precision.reduce_bytes)
    if replicate > 1 and world_size > gpus_per_node:
        ring = 2 * (replicate - 1) / replicate
        total += sum(ring * u.shard_numel * precision.reduce_bytes for u in units if u.numel)
    return int(total)


@contextlib.contextmanager
def cycle_collector_paused() -> Iterator[None]:
    """Pause Python's cycle collector while the search runs, and collect once after.

    The search allocates millions of short-lived tuples and dataclasses that reference
    counting frees at once, but each allocation counts towards the collector's next pass, and
    every pass walks the model's graph and analysis (tens of thousands of objects for 10,000
    modules). Paused, a 10,006-module search took 18.5 s instead of 25.3 s; the few cycles it
    makes (about 200) are collected at the end."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
            gc.collect()


def search(evaluator: Evaluator) -> list[Candidate]:
    """Every configuration's fastest fitting variant (or its smallest peak), best first."""
    settings = evaluator.settings
    results: list[Candidate] = []
    layouts = block_layouts(evaluator.graph, settings.precision.lowers_precision, evaluator)
    paths = evaluator.checkpoint_options()
    blocks = set(evaluator.graph.blocks)
    for strategy, replicate, shard in strategies_for(settings):
        for layout_name, groups in layouts.items():
            n = len(groups)
            grouped = any(len(g) > 1 and g[0] in blocks for g in groups)
            if grouped and strategy == "grad-op":
                # A grouped unit kept unsharded after forward measured 3.6% over its
                # prediction (HF Llama, FSDPMemTracker); grouped units are planned only where
                # they reshard after forward, where the model is checked (within 2.5%, over).
                continue
            last_block = max((i for i, g in enumerate(groups) if g[0] in blocks), default=None)
            keep_options = ([False, True] if last_block is not None and strategy != "grad-op"
                            and not (grouped and len(groups[last_block]) > 1) else [False])
            for keep_last in keep_options:
                reshard = [strategy != "grad-op" for _ in range(n)]
                if keep_last:
                    reshard[last_block] = False
                # Per path, the index where the least-memory variant first fits (None: not
                # yet searched; -1: it never fits). No prefetch beyond FSDP2's default needs
                # the least memory: every other variant needs at least as much checkpointing,
                # so its search starts there.
                starts: list[int | None] = [None] * len(paths)
                variants = ((0, 1), (0, 2), (1, 1), (1, 2)) if n > 1 else ((0, 1),)
                for fwp, bwp in variants:
                    label = f"hybrid {replicate}x{shard}" if strategy == "hybrid" else strategy
                    name = (f"{label} {layout_name}" + (" keep-last" if keep_last else "")
                            + f" fwp{fwp} bwp{bwp}")
                    at = partial(_evaluate_with_counts, evaluator, dict(
                        name=name, strategy=strategy, replicate=replicate, shard=shard,
                        groups=groups, reshard=list(reshard), root_reshard=False,
                        forward_prefetch=fwp, backward_prefetch=bwp))
                    found: list[Candidate] = []
                    for p, path in enumerate(paths):
                        if starts[p] == -1:
                            continue
                        best, fits_at = _fewest_checkpointed(at, path, starts[p])
                        found.append(best)
                        if starts[p] is None:
                            starts[p] = -1 if fits_at is None else fits_at
                    if not found:
                        break  # the least-memory variant cannot fit: the others cannot either
                    results.append(rank(found)[0])
    if settings.strategy in ("auto", "ddp"):  # DDP beside FSDP, on the same models and clock
        from fsdp_plan.search.ddp import ddp_candidates
        results.extend(ddp_candidates(evaluator.graph, evaluator.analysis, settings))
    return rank(results)


def rank(candidates: list[Candidate]) -> list[Candidate]:
    """Fitting candidates by step time (then fewer checkpointed blocks, lower peak), then the rest
    by peak."""
    return sorted(candidates, key=lambda c: (
        not c.fits, round(c.time.step_s, 9) if c.fits else c.memory.peak_bytes,
        len(c.checkpointed), c.memory.peak_bytes))


def choose(searched: list[Candidate], recipes: list[Candidate], strategy: str = "auto"
           ) -> list[Candidate]:
    """The search's ranking with any fitting recipe that beats it: never worse than a recipe.

    Recipes use full sharding, so they compete only when the user allowed it."""
    allowed = [r for r in recipes if r.fits and strategy in ("auto", r.strategy)]
    return rank(searched + allowed)


def _evaluate_with_counts(evaluator: Evaluator, config: dict, counts: tuple[int, int]
                         ) -> Candidate:
    """One configuration with its first ``n_full`` blocks fully and the next ``n_selective``
    selectively checkpointed (``counts``)."""
    n_full, n_sel = counts
    full, selective = mode_sets(n_full, n_sel)
    suffix = (f" ac{n_full}" if n_full else "") + (f" sac{n_sel}" if n_sel else "")
    return evaluator.evaluate(**{**config, "name": config["name"] + suffix}, checkpoint=full,
                              selective=selective)


def _fewest_checkpointed(at, ks: list, start: int | None) -> tuple[Candidate, int | None]:
    """The cheapest checkpointing along ``ks`` that fits (the peak falls along it).

    [Note: choosing checkpointing modes]
    Each block may take mode none, selective or full; selective saves part of what full saves
    for a fraction of its recompute time. For identical blocks with per-block savings
    ``S_sel < S_full`` and costs ``r_sel < r_full``, the cheapest set of modes saving a given
    amount is (as a knapsack with two items per block, up to one block's rounding) whole-block
    steps along none -> selective -> full when selective saves more per second than full
    (``S_sel / r_sel > S_full / r_full``), else along none -> full. So ``ks`` is one of two
    paths of ``(n_full, n_selective)`` counts, ``(0, 0) .. (0, n) .. (n, 0)`` or
    ``(0, 0) .. (n, 0)``, each ordered by recompute time with the peak falling, and
    ``Evaluator.checkpoint_options`` picks the one the measured savings and costs put on the
    hull (both only when blocks cannot mix modes). Full blocks come first in the stack.

    Binary search over ``ks``; with ``start`` (a lower bound from a variant needing less
    memory) it steps up from there instead, which is one or two evaluations in practice.
    Returns the candidate and the index in ``ks`` where it fits (None when nothing fits).
    """
    if start is not None:
        for i in range(start, len(ks)):
            cand = at(ks[i])
            if cand.fits:
                return cand, i
        return cand, None
    first = at(ks[0])
    if first.fits or len(ks) == 1:
        return first, 0 if first.fits else None
    last = at(ks[-1])
    if not last.fits:
        return last, None
    lo, hi = 0, len(ks) - 1  # ks[lo] does not fit, ks[hi] fits
    best = last
    while hi - lo > 1:
        mid = (lo + hi) // 2
        cand = at(ks[mid])
        if cand.fits:
            hi, best = mid, cand
        else:
            lo = mid
    return best, hi


def standard_recipes(evaluator: Evaluator) -> list[Candidate]:
    """torchtitan's one unit per block (without checkpointing, with its selective-op
    checkpointing of every block, with full checkpointing of every block), FSDP1's
    size-based default, and the root alone."""
    s = evaluator.settings
    graph = evaluator.graph
    out: list[Candidate] = []

    def own_units(groups: list[list[str]]) -> list[list[str]]:
        if not s.precision.lowers_precision:
            return groups
        return with_full_precision_units(graph, groups)
    common = dict(strategy="full", replicate=1, shard=s.world_size, root_reshard=False, k=0,
                  forward_prefetch=0, backward_prefetch=1)
    # Each recipe with batch norm as units of its own, as FSDP1's mixed precision wraps it
    # ([Note: batch norm in full precision]): without them a bf16 recipe would not run.
    if graph.blocks:
        blocks = [[b] for b in graph.blocks]
        groups = own_units(blocks)
        reshard = [True] * len(groups)
        reshard[groups.index(blocks[-1])] = False
        if check_tied(graph, groups):
            out.append(evaluator.evaluate(name="recipe: torchtitan (unit per block)",
                                          groups=groups, reshard=reshard, **common))
            out += _checkpointing_recipes(evaluator, groups, reshard, common)
    sized = own_units(size_based_units(graph))
    if check_tied(graph, sized):
        out.append(evaluator.evaluate(name="recipe: FSDP1 size_based (1e8)", groups=sized,
                                      reshard=[True] * len(sized), **common))
    alone = own_units([])
    out.append(evaluator.evaluate(name="recipe: root only", groups=alone,
                                  reshard=[True] * len(alone), **common))
    return out


def _checkpointing_recipes(evaluator: Evaluator, groups: list[list[str]], reshard: list[bool],
                           common: dict) -> list[Candidate]:
    """torchtitan's unit per block with every block selectively (its default ``op`` mode,
    when the blocks replay) and fully checkpointed."""
    c = evaluator.composer
    every = frozenset(range(c.max_checkpointed))
    if not every:
        return []
    out = []
    if c.has_selective:
        out.append(evaluator.evaluate(name="recipe: torchtitan selective-op AC", groups=groups,
                                      reshard=reshard, **{**common, "selective": every}))
    out.append(evaluator.evaluate(name="recipe: full AC every block", groups=groups,
                                  reshard=reshard, **{**common, "checkpoint": every}))
    return out
