"""Unit layouts the search tries: one unit per repeated block (with the other top-level
parameter holders as units of their own or left in the root), consecutive blocks grouped
(``search/grouping.py``), size-based subtrees for models without repeated blocks, and the root
alone.
"""

from __future__ import annotations

from fsdp_plan.cost.step_time import ranks_per_node_in
from fsdp_plan.cost.units import check_tied, with_full_precision_units
from fsdp_plan.facts.types import ModuleGraph
from fsdp_plan.search.evaluator import Evaluator
from fsdp_plan.search.grouping import ALLOWANCE_MULTIPLES, CommSetup, grouped_block_layouts

FSDP1_DEFAULT_MIN_PARAMS = 100_000_000


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
    over the whole world (the search evaluates them under every strategy), cut once per
    evaluator and its budget copies."""
    s = evaluator.settings
    if s.hardware is None or s.world_size <= 1:
        return {}
    setup = CommSetup(hardware=s.hardware, shard=s.world_size,
                      ranks_per_node=ranks_per_node_in(s.world_size, 1, s.gpus_per_node),
                      param_bytes=s.precision.param_bytes, reduce_bytes=s.precision.reduce_bytes)
    found = evaluator.grouped_cuts.get(ALLOWANCE_MULTIPLES)
    if found is None:
        found = evaluator.grouped_cuts[ALLOWANCE_MULTIPLES] = grouped_block_layouts(
            evaluator.graph, evaluator.analysis, setup, ALLOWANCE_MULTIPLES)
    return found


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
