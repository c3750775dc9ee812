"""A sharded layout's step time from its ``fully_shard`` units.

Each unit is timed per op ([Note: per-op compute time] in cost/step_time.py): the forward and
backward of the modules it owns (a compiled block's graphs in place of its eager ops, [Note:
compiled block time]), its all-gather and reduce-scatter over the shard axis, its all-reduce
over the replicate axis, and the recompute of the checkpointed blocks it owns inside its
backward (search/evaluator.py [Note: recompute time]). The units then run on the two streams
(``simulate_step``), with the optimizer step after them; with accumulation, the earlier
micro-batches (which reduce nothing under ``gradient_sync: last``) come before the last. The
clock keeps no spans: a step time's are made when first read ([Note: spans when read] in
cost/streams.py).

``UnitClock`` holds what every layout of one model on one setup shares, and caches each
unit's times without recompute: the search times the same units under many prefetch,
strategy and checkpointing choices. ``unit_step_time`` times one layout's units on it.

Pure over the facts: no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping
from dataclasses import dataclass

from fsdp_plan.common.records import with_fields
from fsdp_plan.cost.compiled_time import CompiledTimes, without_inside
from fsdp_plan.cost.hardware import Hardware
from fsdp_plan.cost.precision import Precision
from fsdp_plan.cost.step_time import (
    ForwardCache,
    Rates,
    StepTime,
    UnitCost,
    accumulated_step,
    add_ops,
    collective_time,
    exclusive_ops,
    forward_reads,
    fsdp_copy_time,
    optimizer_time,
    pass_time,
    ranks_per_node_in,
    simulate_step,
)
from fsdp_plan.cost.units import UnitSpec
from fsdp_plan.facts.types import ModuleCompute


@dataclass(frozen=True, kw_only=True)
class StepSetup:
    """What a step's clock holds fixed beside its units: the hardware, the precision and the
    training setup."""

    hardware: Hardware
    param_dtype: str
    """The dtype the model computes in (its rates: ``Rates.of``)."""
    precision: Precision
    optimizer: str
    gpus_per_node: int
    grad_accum_steps: int = 1
    gradient_sync: str = "every"
    """Reduce gradients after ``every`` micro-batch or only the ``last``."""


class UnitClock:
    """The per-unit cost model of one model on one ``StepSetup``, with its caches.

    ``module_names`` are the graph's modules, ``blocks`` its repeated blocks (the only modules
    checkpointed: recompute is theirs), ``modules`` the analysis' per-module compute (their
    own op counters, [Note: FLOP attribution]), ``fw_flops``/``bw_flops`` each module's
    own FLOPs (the root ``""`` takes the rest), ``compiled`` the compiled blocks' graph times
    (None for eager blocks) and ``param_tensors`` the model's parameter tensors (the
    optimizer's per-tensor cost)."""

    def __init__(self, setup: StepSetup, *, module_names: frozenset[str], blocks: frozenset[str],
                 modules: Mapping[str, ModuleCompute], fw_flops: Mapping[str, float],
                 bw_flops: Mapping[str, float], compiled: CompiledTimes | None,
                 param_tensors: int) -> None:
        self.setup = setup
        self.module_names = module_names
        self.blocks = blocks
        self.modules = modules
        self.fw_flops = fw_flops
        self.bw_flops = bw_flops
        self.compiled = compiled
        self.param_tensors = param_tensors
        self._own_ops: tuple[dict, dict] | None = None
        """Each module's own op counters, computed at the first timing."""
        self._owned: dict[tuple[tuple[str, ...], int], _OwnedTimes] = {}
        """What a unit's times read of the modules it owns, by those modules and its parameter
        count (``_owned_times``)."""
        self._cost_cache: dict[tuple, UnitCost] = {}
        """A unit's times without recompute, by what it owns, its bytes and the mesh."""
        self._replayed: dict[tuple[int, tuple[tuple[float, float], ...]], UnitCost] = {}
        """A unit's times with its checkpointed blocks' recompute, by the cost without it
        (its ``id``: every such cost lives in ``_cost_cache``) and the recompute."""
        self.forwards: ForwardCache = {}
        """The forward passes simulated on this clock (``simulate_step``)."""
        self._ordered: dict[tuple, tuple[list[UnitCost], tuple]] = {}
        """Layouts' costs in forward order by layout key and recompute (``ordered_costs``)."""
        self._bases: dict[tuple, _Bases] = {}
        """Layouts' unit costs without recompute, with the blocks each unit owns, by layout
        key and mesh (``ordered_costs``)."""
        self.rates = Rates.of(setup.hardware, setup.param_dtype)
        """The compute dtype's rates on the hardware."""
        self._collectives: dict[tuple[str, int, int, int], float] = {}
        """A collective's seconds by kind, bytes, group and ranks per node (``_collective_s``)."""

    def flops(self, unit: UnitSpec) -> tuple[float, float, frozenset[str]]:
        """Forward and backward FLOPs of the modules a unit owns, and those modules (kept
        per module set by ``_owned_times``)."""
        return (sum(self.fw_flops.get(m, 0.0) for m in unit.owned_modules),
                sum(self.bw_flops.get(m, 0.0) for m in unit.owned_modules),
                frozenset(unit.owned_modules))

    def ops(self, unit: UnitSpec) -> tuple[dict[str, float], dict[str, float]]:
        """The op counters of the modules a unit owns (kept per module set by
        ``_owned_times``)."""
        if self._own_ops is None:
            self._own_ops = tuple(without_inside(o, self.compiled) for o in exclusive_ops(
                set(self.module_names), self.modules))
        own_fw, own_bw = self._own_ops
        fw_ops: dict[str, float] = {}
        bw_ops: dict[str, float] = {}
        for m in unit.owned_modules:
            add_ops(fw_ops, own_fw.get(m))
            add_ops(bw_ops, own_bw.get(m))
        return fw_ops, bw_ops

    def replayed(self, base: UnitCost, replays: tuple[tuple[float, float], ...]) -> UnitCost:
        """``base`` (from ``unit_cost``) with ``replays``' recompute ``(seconds, host
        seconds)`` in its backward, cached."""
        key = (id(base), replays)
        found = self._replayed.get(key)
        if found is None:
            found = self._replayed[key] = with_fields(
                base, bw_compute_s=base.bw_compute_s + sum(r[0] for r in replays),
                bw_host_s=base.bw_host_s + sum(r[1] for r in replays))
        return found

    def _owned_times(self, unit: UnitSpec) -> _OwnedTimes:
        """What ``unit``'s times read of the modules it owns, cached by those modules (and its
        parameter count, theirs): its compute and host seconds per pass and the blocks among
        them. The search meets the same modules in one unit under many meshes, reshard choices
        and layouts (some 28,000 unit costs for 6,000 module sets on the 10,006-module
        model)."""
        key = (tuple(unit.owned_modules), unit.num_params)
        found = self._owned.get(key)
        if found is None:
            fw, bw, owned = self.flops(unit)
            fw_ops, bw_ops = self.ops(unit)
            n = unit.num_params
            (fw_s, fw_host), (bw_s, bw_host) = (pass_time(self.rates, fw_ops, fw, n),
                                                pass_time(self.rates, bw_ops, bw, n))
            compiled = self.compiled
            found = self._owned[key] = _OwnedTimes(
                owned=owned, blocks=tuple(m for m in unit.owned_modules if m in self.blocks),
                fw_compute_s=fw_s + (compiled.forward_s(owned) if compiled else 0.0),
                bw_compute_s=bw_s + (compiled.backward_s(owned) if compiled else 0.0),
                fw_host_s=fw_host, bw_host_s=bw_host)
        return found

    def unit_cost(self, unit: UnitSpec, *, shard: int, replicate: int) -> UnitCost:
        """``unit``'s times without recompute on a ``(replicate, shard)`` mesh, cached: they
        depend only on what it owns, its bytes and the mesh."""
        return self._unit_cost(unit, self._owned_times(unit), shard, replicate)

    def _unit_cost(self, unit: UnitSpec, times: _OwnedTimes, shard: int, replicate: int
                   ) -> UnitCost:
        """``unit_cost`` with ``unit``'s ``_owned_times`` at hand."""
        s = self.setup
        p = s.precision
        param_bytes = p.unit_param_bytes(unit)
        key = (times.owned, unit.key, unit.numel, unit.shard_numel, param_bytes,
               unit.reshard_after_forward, shard, replicate)
        base = self._cost_cache.get(key)
        if base is not None:
            return base
        shard_local = ranks_per_node_in(shard, 1, s.gpus_per_node)
        replicate_local = ranks_per_node_in(replicate, shard, s.gpus_per_node)
        unsharded = unit.unsharded_numel(shard)
        ag_bytes = unsharded * param_bytes
        rs_bytes = unsharded * p.reduce_bytes
        base = self._cost_cache[key] = UnitCost(
            key=unit.key or "<root>",
            fw_compute_s=times.fw_compute_s, bw_compute_s=times.bw_compute_s,
            fw_host_s=times.fw_host_s, bw_host_s=times.bw_host_s,
            all_gather_s=self._collective_s("all_gather", ag_bytes, shard, shard_local)
            if unit.numel else 0.0,
            reduce_scatter_s=self._collective_s("reduce_scatter", rs_bytes, shard, shard_local)
            if unit.numel else 0.0,
            all_reduce_s=self._collective_s("all_reduce", unit.shard_numel * p.reduce_bytes,
                                            replicate, replicate_local)
            if replicate > 1 and unit.numel else 0.0,
            regather=unit.reshard_after_forward,
        )
        return base

    def _collective_s(self, kind: str, nbytes: int, group: int, ranks_per_node: int) -> float:
        """Seconds of one of a unit's collectives: ``collective_time``, with FSDP's copy-in or
        copy-out for an all-gather or reduce-scatter; cached by its arguments (units of the
        same size move the same bytes: thousands per search of a deep model)."""
        key = (kind, nbytes, group, ranks_per_node)
        found = self._collectives.get(key)
        if found is None:
            hw = self.setup.hardware
            found = collective_time(hw, nbytes, group, kind, ranks_per_node=ranks_per_node)
            if kind != "all_reduce":
                found += fsdp_copy_time(hw, self.rates, nbytes, kind)
            self._collectives[key] = found
        return found

    def ordered_costs(self, units: list[UnitSpec], *, shard: int, replicate: int,
                      recompute: Mapping[str, tuple[float, float]], optimizer_overlap: bool,
                      layout_key: Hashable | None) -> tuple[list[UnitCost], tuple]:
        """``units``' costs in forward order (the root first, then the units as they run)
        with their checkpointed blocks' recompute and, with ``optimizer_overlap``, their
        optimizer step; and what forward reads of them (``simulate_step``'s
        ``forward_key``). Cached by ``layout_key`` (None: not cached): the search times one
        layout under many prefetch and checkpointing choices."""
        mesh_key = (layout_key, shard, replicate)
        key = (mesh_key, optimizer_overlap, tuple(recompute.items()))
        cached = layout_key is not None
        if cached and key in self._ordered:
            return self._ordered[key]
        s = self.setup
        hw, rates = s.hardware, self.rates
        bases = self._bases.get(mesh_key) if cached else None
        if bases is None:
            owned = [self._owned_times(u) for u in units]
            bases = _Bases.of([self._unit_cost(u, t, shard, replicate)
                               for u, t in zip(units, owned)], [t.blocks for t in owned])
            if cached:
                self._bases[mesh_key] = bases
        costs: list[UnitCost] = []
        for u, base, blocks in zip(units, bases.costs, bases.blocks):
            # A checkpointed block's forward (or, selective, its unsaved ops) runs again
            # inside its unit's backward: [Note: recompute time] in search/evaluator.py.
            # Summed in module order: a set's order follows the names' hashes, which change
            # from one process to the next, and so did the last bits of a step whose unit
            # owns several checkpointed blocks (a root-only plan's).
            if not recompute or not blocks:
                replays: tuple[tuple[float, float], ...] = ()
            elif len(blocks) == 1:  # a block's own unit, most of a layout's: no generator
                replay = recompute.get(blocks[0])
                replays = () if replay is None else (replay,)
            else:
                replays = tuple(recompute[b] for b in blocks if b in recompute)
            cost = self.replayed(base, replays) if replays else base
            if optimizer_overlap and u.numel:  # [Note: optimizer overlap in the models]
                cost = with_fields(cost, optimizer_s=optimizer_time(
                    hw, rates, s.optimizer, u.shard_numel, s.precision.orig_bytes,
                    u.num_params))
            costs.append(cost)
        found = ([costs[i] for i in bases.order], bases.forward_key)
        if cached:
            self._ordered[key] = found
        return found


@dataclass(frozen=True, slots=True)
class _Bases:
    """A layout's unit costs without recompute on one mesh (``UnitClock.unit_cost``), with
    what every checkpointing mix and optimizer choice of it shares (``ordered_costs``)."""

    costs: list[UnitCost]
    blocks: list[tuple[str, ...]]
    """The checkpointable blocks each unit owns, in module order."""
    order: list[int]
    """Forward order: the root gathers first, then the units as they run."""
    forward_key: tuple
    """What forward reads of the units in that order (``forward_reads``): recompute and the
    optimizer's steps are backward's, so every mix and choice of the layout has it."""

    @classmethod
    def of(cls, costs: list[UnitCost], blocks: list[tuple[str, ...]]) -> _Bases:
        root = [i for i, c in enumerate(costs) if c.key == "<root>"]
        order = root + [i for i, c in enumerate(costs) if c.key != "<root>"]
        return cls(costs=costs, blocks=blocks, order=order,
                   forward_key=forward_reads([costs[i] for i in order]))


@dataclass(frozen=True, slots=True)
class _OwnedTimes:
    """What a unit's times read of the modules it owns, whatever its mesh, bytes and reshard
    (``UnitClock._owned_times``)."""

    owned: frozenset[str]
    blocks: tuple[str, ...]
    """The checkpointable blocks among them, in module order."""
    fw_compute_s: float
    """The forward's compute seconds (``pass_time``, with a compiled block's graph time)."""
    bw_compute_s: float
    fw_host_s: float
    bw_host_s: float


def unit_step_time(clock: UnitClock, units: list[UnitSpec], *, shard: int, replicate: int,
                   recompute: Mapping[str, tuple[float, float]], forward_prefetch: int,
                   backward_prefetch: int, optimizer_overlap: bool = False,
                   layout_key: Hashable | None = None) -> StepTime:
    """The step time of ``units`` (children first, the root last) on a ``(replicate, shard)``
    mesh: per-op unit times, then the two streams. ``recompute`` maps each checkpointed block
    to its recompute ``(seconds, host seconds)`` in its mode. ``optimizer_overlap``: each
    unit's parameters step after its reduce-scatter, in backward (cost/optimizer_overlap.py;
    never with accumulation). ``layout_key``: a key that always names these same units (the
    search's layout), so their costs are assembled once per key and recompute
    (``UnitClock.ordered_costs``); None assembles them afresh."""
    s = clock.setup
    hw = s.hardware
    rates = clock.rates
    ordered, forward_key = clock.ordered_costs(units, shard=shard, replicate=replicate,
                                               recompute=recompute,
                                               optimizer_overlap=optimizer_overlap,
                                               layout_key=layout_key)
    if optimizer_overlap:  # its steps run in backward, and it never accumulates
        return simulate_step(ordered, hw, forward_prefetch=forward_prefetch,
                             backward_prefetch=backward_prefetch, forwards=clock.forwards,
                             forward_key=forward_key, record_spans=False)
    total_shard = sum(u.shard_numel for u in units)
    optimizer_s = optimizer_time(hw, rates, s.optimizer, total_shard, s.precision.orig_bytes,
                                 clock.param_tensors)
    step = simulate_step(ordered, hw, forward_prefetch=forward_prefetch,
                         backward_prefetch=backward_prefetch, optimizer_s=optimizer_s,
                         forwards=clock.forwards, forward_key=forward_key,
                         record_spans=False)
    if s.grad_accum_steps == 1:
        return step
    earlier = step
    if s.gradient_sync == "last":  # micro-batches before the last reduce nothing
        quiet = [dataclasses.replace(c, reduce_scatter_s=0.0, all_reduce_s=0.0)
                 for c in ordered]
        earlier = simulate_step(quiet, hw, forward_prefetch=forward_prefetch,
                                backward_prefetch=backward_prefetch, optimizer_s=optimizer_s,
                                forwards=clock.forwards, forward_key=forward_key,
                                record_spans=False)
    return accumulated_step(step, earlier, s.grad_accum_steps)
