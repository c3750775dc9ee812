"""Collective counts per steady step (forward + backward), SPEC section 5: the rule, written once.

FSDP2 (``fully_shard``): each unit that runs and holds parameters issues one all-gather
before its forward, another before its backward when it resharded after forward, and one
reduce-scatter after its backward; HSDP adds one all-reduce of the reduced shard across the
replicate axis. FSDP1 wraps every module of a grouped unit separately (``FSDP1_UNITS`` in the
emitted policy), never reshards the root after forward, and with ``NO_SHARD`` only all-reduces.

A unit whose module runs ``c`` times in one forward (a shared projection) is gathered for every
call when it reshards after forward, and again for every call's backward; without resharding
it is gathered once in forward, and ``c - 1`` times in backward (its post-backward after the
last call's gradient reshards it before the earlier calls' backward). It still reduce-scatters
once. FSDP1 gathers such a module for every forward call and once for backward when it
reshards (``FULL_SHARD``/``HYBRID_SHARD``), else once. (Measured with gloo on torch 2.13.)
"""

from __future__ import annotations

from fsdp_plan.cost.precision import Precision
from fsdp_plan.cost.units import UnitSpec


def _gathers(u: UnitSpec, calls: int, regather: bool) -> int:
    """All-gathers of one unit over forward and backward (see the module docstring)."""
    if u.modules == [""]:
        calls = 1
    return 2 * calls if regather else 1 + (calls - 1)


def count_fsdp2(units: list[UnitSpec], *, replicate: int, shard: int,
                ran: list[bool] | None = None, calls: list[int] | None = None) -> dict[str, int]:
    """All-gather, reduce-scatter and all-reduce calls of one FSDP2 step."""
    counts = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    for i, u in enumerate(units):
        if u.numel == 0 or (ran is not None and not ran[i]):
            continue
        if shard > 1:  # a one-rank shard group (pure replication) gathers nothing
            counts["all_gather"] += _gathers(u, calls[i] if calls else 1, u.reshard_after_forward)
            counts["reduce_scatter"] += 1
        if replicate > 1:
            counts["all_reduce"] += 1
    return counts


def count_fsdp1(units: list[UnitSpec], *, strategy: str, replicate: int,
                ran: list[bool] | None = None, calls: list[int] | None = None) -> dict[str, int]:
    """The same step under FSDP1 ``FullyShardedDataParallel`` with the emitted auto-wrap policy."""
    counts = {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 0}
    for i, u in enumerate(units):
        if u.numel == 0 or (ran is not None and not ran[i]):
            continue
        instances = len(u.modules)
        is_root = u.modules == [""]
        if strategy == "none":
            counts["all_reduce"] += instances
            continue
        regather = strategy in ("full", "hybrid") and not is_root
        n_calls = 1 if is_root else (calls[i] if calls else 1)
        counts["all_gather"] += instances * (n_calls + 1 if regather else 1)
        counts["reduce_scatter"] += instances
        if strategy == "hybrid" and replicate > 1:
            counts["all_reduce"] += instances
    return counts


def per_step(counts: dict[str, int], grad_accum_steps: int, gradient_sync: str
             ) -> dict[str, int]:
    """One micro-batch's counts over a whole optimizer step: every micro-batch all-gathers;
    with ``gradient_sync: last`` only the last reduce-scatters and all-reduces (FSDP2's
    ``set_requires_gradient_sync(False)`` skips both)."""
    reduces = 1 if gradient_sync == "last" else grad_accum_steps
    return {"all_gather": counts["all_gather"] * grad_accum_steps,
            "reduce_scatter": counts["reduce_scatter"] * reduces,
            "all_reduce": counts["all_reduce"] * reduces}


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
