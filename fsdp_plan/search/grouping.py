"""Where to cut a stack of repeated blocks into grouped units (one ``fully_shard`` per group).

[Note: grouped units]
Every unit pays one all-gather before forward, another before backward when it reshards, and
one reduce-scatter after backward, each with a fixed launch and latency cost. Small blocks
(BERT, ViT, GPT-2 small) on many GPUs spend more on those fixed costs than on the bytes, so
fewer, larger units are faster; but a larger unit starts later (its first all-gather and its
last reduce-scatter are exposed) and keeps more parameters unsharded at once.

Choosing the cuts is a shortest path over block boundaries: nodes ``0..n``; an edge
``i -> j`` is one unit holding blocks ``i..j-1``, present only when the group's unsharded
parameters fit a memory allowance, and weighted by the time the unit adds to a pipelined step:
``max(compute, communication)`` (its collectives overlap the neighbouring units' compute, so the
slower stream sets the pace), plus its all-gather when it is the first unit (nothing to hide it
behind) and its reduce-scatter when it is the last (the tail after backward). Collective times
come from ``cost.collective_time`` (latency and bandwidth). The edges go forward only, so the
graph is a DAG and Dijkstra finds the best cut exactly for this weight (``shortest_cut``:
networkx's bidirectional Dijkstra, which ``networkx.shortest_path`` runs, written out over this
graph's adjacency, so its answer, ties included, is networkx's without the 0.15-0.3 s import on
every plan). The search then evaluates each resulting layout with the exact memory and step-time
models (search/evaluator.py), so the weight only has to rank cuts, not predict the step.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from heapq import heappop, heappush

from fsdp_plan.cost.hardware import Hardware
from fsdp_plan.cost.step_time import collective_time
from fsdp_plan.facts.types import Analysis, ModuleGraph

ALLOWANCE_MULTIPLES = (2, 4, 8)
"""Memory allowances tried, in units of the largest block's unsharded parameters."""
MIN_GAIN = 0.01
"""A grouped cut is offered only when its path weight is this share below one unit per block:
smaller gains are within the step-time model's error and would only cost search time."""
_TIE_BREAK_S = 1e-9
"""Among cuts of equal time, prefer smaller units (less memory): 1 ns per block beyond the first
of a unit, far below any collective's latency."""


@dataclass(kw_only=True, frozen=True)
class BlockCost:
    """What one block contributes to a unit: its compute and its gathered and reduced bytes."""

    fqn: str
    compute_s: float
    """Forward plus backward compute time."""
    gather_bytes: int
    """Unsharded (padded) parameters in the plan's ``param_dtype``."""
    reduce_bytes: int
    """Unsharded (padded) gradients in the plan's ``reduce_dtype``."""


@dataclass(kw_only=True, frozen=True)
class CommSetup:
    """The collectives' shape: shard group size, its ranks per node, dtypes."""

    hardware: Hardware
    shard: int
    ranks_per_node: int | None = None
    """Shard-group ranks on each node it spans; ``None``: the group sits in one node
    ([Note: bandwidth across nodes])."""
    param_bytes: int = 2
    reduce_bytes: int = 4
    regather: bool = True


def padded_numels(graph: ModuleGraph, shard: int) -> dict[str, int]:
    """Parameters under each module as FSDP2 gathers them (dim 0 padded to a multiple of
    ``shard``), summed children first in one pass: per block over all modules was quadratic
    (10 s of 70 on a model of 10,000 modules)."""
    total: dict[str, int] = {}
    for name in reversed(list(graph.modules)):
        info = graph.modules[name]
        own = 0
        for shape in info.param_shapes:
            numel = math.prod(shape) if shape else 1
            dim0 = shape[0] if shape else 1
            own += math.ceil(dim0 / shard) * shard * (numel // max(dim0, 1))
        total[name] = own + sum(total[c] for c in info.children)
    return total



def block_costs(graph: ModuleGraph, analysis: Analysis, stack: list[str], setup: CommSetup
                ) -> list[BlockCost]:
    """``BlockCost`` of each block of one stack, compute at the hardware's achieved FLOP rate."""
    hw = setup.hardware
    rate = max(hw.peak_flops * hw.efficiency, 1.0)
    out = []
    padded = padded_numels(graph, setup.shard)
    for fqn in stack:
        comp = analysis.modules.get(fqn)
        flops = (comp.fw_flops + comp.bw_flops) if comp else 0.0
        numel = padded[fqn]
        out.append(BlockCost(fqn=fqn, compute_s=flops / rate,
                             gather_bytes=numel * setup.param_bytes,
                             reduce_bytes=numel * setup.reduce_bytes))
    return out


def unit_seconds(group: list[BlockCost], setup: CommSetup, *, first: bool, last: bool) -> float:
    """The edge weight of one unit holding ``group`` (see [Note: grouped units])."""
    return _edge_seconds(sum(c.gather_bytes for c in group), sum(c.reduce_bytes for c in group),
                         sum(c.compute_s for c in group), len(group), setup, first=first,
                         last=last)


def _edge_seconds(gather: int, reduce: int, compute_s: float, blocks: int, setup: CommSetup, *,
                  first: bool, last: bool,
                  collectives: dict[tuple[int, int], tuple[float, float]] | None = None
                  ) -> float:
    """``unit_seconds`` of a group of ``blocks`` blocks from its sums (``cut_stack_weighted``
    extends a group one block at a time and keeps them running: the same left-to-right sums).
    ``collectives``: the all-gather and reduce-scatter seconds by their bytes, kept by the
    caller across edges (a stack of equal blocks moves the same bytes on most of them)."""
    found = collectives.get((gather, reduce)) if collectives is not None else None
    if found is None:
        hw = setup.hardware
        found = (collective_time(hw, gather, setup.shard, ranks_per_node=setup.ranks_per_node),
                 collective_time(hw, reduce, setup.shard, "reduce_scatter",
                                 ranks_per_node=setup.ranks_per_node))
        if collectives is not None:
            collectives[(gather, reduce)] = found
    all_gather, reduce_scatter = found
    comm = all_gather * (2 if setup.regather else 1) + reduce_scatter
    seconds = max(compute_s, comm)
    if first:
        seconds += all_gather
    if last:
        seconds += reduce_scatter
    return seconds + _TIE_BREAK_S * (blocks - 1)


def cut_stack(costs: list[BlockCost], setup: CommSetup, allowance_bytes: float
              ) -> list[list[str]]:
    """The fastest cut of one stack into consecutive groups whose gathered parameters each fit
    ``allowance_bytes`` (a single block always may: it is a unit either way)."""
    return cut_stack_weighted(costs, setup, allowance_bytes)[0]


def cut_stack_weighted(costs: list[BlockCost], setup: CommSetup, allowance_bytes: float
                       ) -> tuple[list[list[str]], float, float]:
    """``cut_stack``'s groups, their path weight, and the weight of one unit per block."""
    n = len(costs)
    if n == 0:
        return [], 0.0, 0.0
    succ: dict[int, dict[int, float]] = {i: {} for i in range(n + 1)}
    pred: dict[int, dict[int, float]] = {i: {} for i in range(n + 1)}
    collectives: dict[tuple[int, int], tuple[float, float]] = {}
    for i in range(n):
        gathered = reduced = 0
        compute_s = 0.0
        for j in range(i + 1, n + 1):
            block = costs[j - 1]
            gathered += block.gather_bytes
            if j > i + 1 and gathered > allowance_bytes:
                break
            reduced += block.reduce_bytes
            compute_s += block.compute_s
            succ[i][j] = pred[j][i] = _edge_seconds(gathered, reduced, compute_s, j - i, setup,
                                                    first=i == 0, last=j == n,
                                                    collectives=collectives)
    path = shortest_cut(succ, pred, 0, n)
    weight = sum(succ[a][b] for a, b in itertools.pairwise(path))
    per_block = sum(succ[i][i + 1] for i in range(n))
    return [[c.fqn for c in costs[a:b]] for a, b in itertools.pairwise(path)], weight, per_block


def shortest_cut(succ: dict[int, dict[int, float]], pred: dict[int, dict[int, float]],
                 source: int, target: int) -> list[int]:
    """The nodes of a shortest ``source`` -> ``target`` path over non-negative edge weights
    (``succ[a][b] == pred[b][a]``: the weight of edge ``a -> b``; each dict in the order the
    edges were added).

    networkx's ``bidirectional_dijkstra`` (networkx 3.x, BSD-3-Clause), step for step: the same
    alternating expansion, heap order and first-strictly-shorter relaxation, so among paths of
    equal float weight it returns the one ``networkx.shortest_path`` did (tests/
    test_grouped_units.py compares the two on ties and random graphs).
    """
    if source == target:
        return [source]
    dists: list[dict[int, float]] = [{}, {}]
    preds: list[dict[int, int | None]] = [{source: None}, {target: None}]
    seen: list[dict[int, float]] = [{source: 0}, {target: 0}]
    fringe: list[list[tuple[float, int, int]]] = [[], []]
    order = itertools.count()
    heappush(fringe[0], (0, next(order), source))
    heappush(fringe[1], (0, next(order), target))
    neighbours = [succ, pred]
    final: float | None = None
    meet = source
    direction = 1
    while fringe[0] and fringe[1]:
        direction = 1 - direction
        dist, _, v = heappop(fringe[direction])
        if v in dists[direction]:
            continue
        dists[direction][v] = dist
        if v in dists[1 - direction]:
            return _walk(preds[0], meet)[::-1] + _walk(preds[1], preds[1][meet])
        for w, cost in neighbours[direction][v].items():
            length = dist + cost
            if w in dists[direction]:
                continue
            if w not in seen[direction] or length < seen[direction][w]:
                seen[direction][w] = length
                heappush(fringe[direction], (length, next(order), w))
                preds[direction][w] = v
                if w in seen[1 - direction]:
                    through = length + seen[1 - direction][w]
                    if final is None or final > through:
                        final, meet = through, w
    raise ValueError(f"no cut of the stack reaches block boundary {target}")


def _walk(preds: dict[int, int | None], node: int | None) -> list[int]:
    """``node`` and its predecessors in ``preds`` up to the search's start."""
    out = []
    while node is not None:
        out.append(node)
        node = preds[node]
    return out


def stacks(graph: ModuleGraph) -> list[list[str]]:
    """The repeated blocks by container (a unit may group siblings only), in model order."""
    by_parent: dict[str, list[str]] = {}
    for fqn in graph.blocks:
        by_parent.setdefault(fqn.rpartition(".")[0], []).append(fqn)
    return list(by_parent.values())


def grouped_block_layouts(graph: ModuleGraph, analysis: Analysis, setup: CommSetup,
                          multiples: tuple[int, ...] = ALLOWANCE_MULTIPLES
                          ) -> dict[int, list[list[str]]]:
    """Block groups chosen by the shortest path for each allowance (``multiple`` x the largest
    block's gathered bytes), keyed by the multiple; layouts equal to one unit per block or to
    a smaller allowance's, or less than ``MIN_GAIN`` faster by the path weight, are left out."""
    all_costs = [block_costs(graph, analysis, stack, setup) for stack in stacks(graph)]
    largest = max((c.gather_bytes for costs in all_costs for c in costs), default=0)
    if largest == 0:
        return {}
    seen = [[[b] for b in graph.blocks]]
    out: dict[int, list[list[str]]] = {}
    for multiple in multiples:
        cuts = [cut_stack_weighted(costs, setup, multiple * largest) for costs in all_costs]
        groups = [g for cut, _, _ in cuts for g in cut]
        weight, per_block = sum(c[1] for c in cuts), sum(c[2] for c in cuts)
        if weight > (1 - MIN_GAIN) * per_block:
            continue  # not worth a layout: see MIN_GAIN
        if groups not in seen:
            seen.append(groups)
            out[multiple] = groups
    return out
