"""FSDP and HSDP: the sharded strategy the search is handed, its layouts, meshes, checkpointing
walk and the standard recipes.

[Note: search space]
For each mesh (full sharding over the world, HSDP at every shard size ``hybrid_shard_sizes``
allows, grad-op, none; as ``--strategy`` admits), each unit layout (search/layouts.py: one unit
per repeated block with the other parameterised top-level modules as their own units or left
in the root, consecutive blocks grouped, size-based subtrees for models without blocks, the
root alone), the last block's ``reshard_after_forward``, forward prefetch depth 0-1 and backward
prefetch depth 1-2, the memory model is monotone in the number of checkpointed blocks, so a
binary search finds the fewest checkpointed blocks that fit; that is the fastest variant of the
configuration. DDP (search/ddp.py) is another strategy handed to the same search; CPU offload
(search/offload.py) a fallback when nothing fits. The winner is the fitting candidate with the
lowest simulated step time. Standard recipes (torchtitan's one unit per block, FSDP1's
size-based policy, root only) are evaluated with the same models for the report.

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
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

from fsdp_plan.common.records import with_fields
from fsdp_plan.cost.units import check_tied, with_full_precision_units
from fsdp_plan.facts.checkpointing import TORCHTITAN_MM_STRIDE, mode_sets
from fsdp_plan.search.candidate import Candidate, Layout, SearchSettings, rank
from fsdp_plan.search.evaluator import Evaluator
from fsdp_plan.search.framework import PREFETCH, FrameworkLimits
from fsdp_plan.search.layouts import block_layouts, size_based_units


def hybrid_shard_sizes(world_size: int, gpus_per_node: int) -> list[int]:
    """Shard-group sizes HSDP can use on ``world_size`` ranks: every proper divisor of the world
    size that is a whole number of nodes (1 node, 2 nodes, ...) or part of one node (when a
    node has more GPUs than the model needs to be sharded over)."""
    return [s for s in range(2, world_size) if world_size % s == 0
            and (s % gpus_per_node == 0 or gpus_per_node % s == 0)]


def meshes_for(settings: SearchSettings) -> list[tuple[str, int, int]]:
    """(strategy, replicate, shard) options for the user's ``--strategy``; HSDP at every shard
    size ``hybrid_shard_sizes`` allows, each with its own cross-node traffic."""
    w, gpn = settings.world_size, settings.gpus_per_node
    options: dict[str, list[tuple[str, int, int]]] = {
        "full": [("full", 1, w)],
        "grad-op": [("grad-op", 1, w)],
        "none": [("none", w, 1)],
        "hybrid": [("hybrid", w // s, s) for s in hybrid_shard_sizes(w, gpn)],
    }
    if settings.strategy == "auto":
        return [o for opts in options.values() for o in opts]
    if settings.strategy == "hybrid" and not options["hybrid"]:
        return [("hybrid", 1, w)]
    return options.get(settings.strategy, [])


class ShardedStrategy:
    """FSDP2 full sharding, grad-op, none and HSDP ([Note: search space]); with ``limits``,
    only what a framework's configuration says (search/framework.py)."""

    def __init__(self, limits: FrameworkLimits | None = None) -> None:
        self.limits = limits

    def candidates(self, evaluator: Evaluator) -> list[Candidate]:
        """Every configuration's fastest fitting variant (or its smallest peak), best first."""
        if self.limits is not None:
            return _framework_candidates(evaluator, self.limits)
        settings = evaluator.settings
        results: list[Candidate] = []
        layouts = block_layouts(evaluator.graph, settings.precision.lowers_precision, evaluator)
        paths = evaluator.checkpoint_options()
        blocks = set(evaluator.graph.blocks)
        for strategy, replicate, shard in meshes_for(settings):
            for layout_name, groups in layouts.items():
                n = len(groups)
                grouped = any(len(g) > 1 and g[0] in blocks for g in groups)
                if grouped and strategy == "grad-op":
                    # A grouped unit kept unsharded after forward measured 3.6% over its
                    # prediction (HF Llama, FSDPMemTracker); grouped units are planned only
                    # where they reshard after forward, where the model is checked (within
                    # 2.5%, over).
                    continue
                last_block = max((i for i, g in enumerate(groups) if g[0] in blocks),
                                 default=None)
                keep_options = ([False, True] if last_block is not None
                                and strategy != "grad-op"
                                and not (grouped and len(groups[last_block]) > 1) else [False])
                units = tuple(tuple(g) for g in groups)
                for keep_last in keep_options:
                    reshard = [strategy != "grad-op" for _ in range(n)]
                    if keep_last:
                        reshard[last_block] = False
                    base = Layout(strategy=strategy, mesh=(replicate, shard), groups=units,
                                  reshard=tuple(reshard))
                    label = f"hybrid {replicate}x{shard}" if strategy == "hybrid" else strategy
                    name = f"{label} {layout_name}" + (" keep-last" if keep_last else "")
                    results += _prefetch_variants(evaluator, base, name, paths, n)
        return rank(results)

    def recipes(self, evaluator: Evaluator) -> list[Candidate]:
        return standard_recipes(evaluator)


def _framework_candidates(evaluator: Evaluator, limits: FrameworkLimits) -> list[Candidate]:
    """The configurations ``limits`` can say: its one unit layout on each mesh it allows, its
    reshard choices, checkpointing of every block or none, FSDP2's implicit prefetch."""
    settings = evaluator.settings
    graph = evaluator.graph
    results: list[Candidate] = []
    for layout_name, groups in limits.unit_layouts(
            graph, settings.precision.lowers_precision).items():
        paths = limits.checkpoint_paths(graph, groups, evaluator.composer.max_checkpointed)
        for strategy, replicate, shard in meshes_for(settings):
            if strategy not in limits.strategies:
                continue
            for reshard in limits.reshard_options(graph, groups, strategy):
                base = Layout(strategy=strategy, mesh=(replicate, shard),
                              groups=tuple(tuple(g) for g in groups), reshard=reshard)
                label = f"hybrid {replicate}x{shard}" if strategy == "hybrid" else strategy
                kept = "" if all(reshard) or not any(reshard) else " keep-tail"
                own = "" if layout_name == limits.name else f" {layout_name}"
                results += _prefetch_variants(evaluator, base, f"{label} {limits.name}{own}"
                                              f"{kept}", paths, len(groups),
                                              variants=(PREFETCH,))
    return rank(results)


def _prefetch_variants(evaluator: Evaluator, base: Layout, name: str,
                       paths: list[list[tuple[int, int]]], n: int,
                       variants: tuple[tuple[int, int], ...] | None = None) -> list[Candidate]:
    """The best of each prefetch variant of ``base`` (fewest checkpointed blocks that fit);
    ``variants``: the (forward, backward) depths to try (default: 0-1 and 1-2)."""
    # Per path, the index where the least-memory variant first fits (None: not yet searched;
    # -1: it never fits). No prefetch beyond FSDP2's default needs the least memory: every
    # other variant needs at least as much checkpointing, so its search starts there.
    starts: list[int | None] = [None] * len(paths)
    # a frontier's budget copy knows what other budgets evaluated ([Note: evaluations across
    # budgets]); the planner's own search uses neither
    limit = evaluator.settings.limit_bytes if evaluator.serves_seen else None
    out: list[Candidate] = []
    if variants is None:
        variants = ((0, 1), (0, 2), (1, 1), (1, 2)) if n > 1 else ((0, 1),)
    prefetched = [(with_fields(base, forward_prefetch=fwp, backward_prefetch=bwp),
                   f"{name} fwp{fwp} bwp{bwp}") for fwp, bwp in variants]
    floors = [-math.inf] * len(prefetched)
    met: list[list[list[tuple[int, Candidate]]]] = []
    if limit is not None:  # [Note: bounded frontier searches]
        met = [_met_along(evaluator, layout, label, paths) for layout, label in prefetched]
        lowest = [_lowest_answer(along) for along in met[0]]
        floors = [_floor_s(along, lowest) for along in met]
        if all(f > evaluator.fastest_fitting_s for f in floors):
            return []
    for v, (layout, label) in enumerate(prefetched):
        if v and limit is not None:  # they start where the least-memory variant answered
            floors[v] = _floor_s(met[v], [s if s is not None and s >= 0 else 0 for s in starts])
            if floors[v] > evaluator.fastest_fitting_s:
                continue

        def at(counts: tuple[int, int], layout: Layout = layout, label: str = label
               ) -> Candidate:
            return _with_counts(evaluator, layout, label, counts)
        found: list[Candidate] = []
        for p, path in enumerate(paths):
            if starts[p] == -1:
                continue
            best, fits_at = fewest_checkpointed(at, path, starts[p],
                                                known=met[v][p] if limit is not None else None,
                                                limit_bytes=limit)
            found.append(best)
            if starts[p] is None:
                starts[p] = -1 if fits_at is None else fits_at
        if not found:
            break  # the least-memory variant cannot fit: the others cannot either
        out.append(rank(found)[0])
    return out


# [Note: bounded frontier searches]
# The frontier searches the same space at several budgets on one evaluator's budget copies,
# each knowing every point the others evaluated (``Evaluator.checkpointing_met``). Two rules
# make a later budget's search cheaper without changing its best plan:
# - Along a checkpointing path the step never falls (each point recomputes more; tests/
#   test_frontier_reuse.py checks it over every evaluation of a search), so a prefetch variant
#   cannot step faster than its last known point below where its search can answer: for the
#   least-memory variant one past its last known point that does not fit before the first that
#   does (``fewest_checkpointed`` starts between them), for the others where that variant
#   answered. A variant whose floor is slower than the fastest plan fitting this budget so far
#   (``Evaluator.fastest_fitting_s``, started at the fastest plan another budget's search
#   found that fits here: this search finds one at least as fast) is left out, and a layout
#   whose every variant is, with all of them. The least-memory variant otherwise always runs:
#   it sets where the others start, and starting them elsewhere could answer differently
#   where the peak does not fall monotonically (it rises from 79 to all 80 selective blocks of
#   Llama-70B's per-block+top layout).
# - ``fewest_checkpointed`` brackets its binary search with the known points and probes first
#   where the peak, as a straight line between the bracket's ends, meets the limit.
# What is left out is ranked nowhere: only the frontier, which reads each budget's best plan,
# searches so. The planner's own search (no budget copy) uses neither rule.


def _met_along(evaluator: Evaluator, layout: Layout, name: str,
               paths: list[list[tuple[int, int]]]) -> list[list[tuple[int, Candidate]]]:
    """Per path, ``(index, candidate)`` of each of its points another budget's search
    evaluated for ``layout``, ascending, ``fits`` judged at this budget."""
    met = evaluator.checkpointing_met.get((layout, name), {})
    out = []
    for path in paths:
        where = {counts: i for i, counts in enumerate(path)}
        out.append(sorted(((where[c], evaluator.judged(*entry)) for c, entry in met.items()
                           if c in where), key=lambda t: t[0]))
    return out


def _lowest_answer(along: list[tuple[int, Candidate]]) -> int:
    """The lowest index ``fewest_checkpointed`` (given ``known``) can answer on a path of the
    least-memory variant whose known points are ``along``: one past the last known point that
    does not fit before the first that does (0 when nothing is known or its first point fits).
    """
    missed, _ = _bracket(along)
    return missed[0] + 1 if missed is not None else 0


def _bracket(known: list[tuple[int, Candidate]]
             ) -> tuple[tuple[int, Candidate] | None, tuple[int, Candidate] | None]:
    """Of known path points (ascending), the last that does not fit before the first that
    does, and that first one (None where there is none): where a search between them starts."""
    fitted = next(((i, c) for i, c in known if c.fits), None)
    missed = [(i, c) for i, c in known if not c.fits and (fitted is None or i < fitted[0])]
    return (missed[-1] if missed else None), fitted


def _floor_s(along: list[list[tuple[int, Candidate]]], lowest: list[int]) -> float:
    """A variant's fastest possible step at this budget (rounded as ``rank`` rounds): on each
    path its answer is at ``lowest`` or beyond, where the step is at least that of its last
    known point up to there; ``-inf`` where nothing is known."""
    floors = []
    for points, low in zip(along, lowest):
        below = [c for i, c in points if i <= low]
        floors.append(round(below[-1].time.step_s, 9) if below else -math.inf)
    return min(floors, default=-math.inf)


def _with_counts(evaluator: Evaluator, layout: Layout, name: str, counts: tuple[int, int]
                 ) -> Candidate:
    """``layout`` with its first ``n_full`` blocks fully and the next ``n_selective``
    selectively checkpointed (``counts``), kept in ``Evaluator.checkpointing_met``."""
    met = evaluator.checkpointing_met.setdefault((layout, name), {})
    n_full, n_sel = counts
    full, selective = mode_sets(n_full, n_sel)
    suffix = (f" ac{n_full}" if n_full else "") + (f" sac{n_sel}" if n_sel else "")
    candidate = evaluator.evaluate(with_fields(layout, full=full, selective=selective - full),
                                   name + suffix)
    met.setdefault(counts, (candidate, evaluator.runs(candidate)))
    return candidate


def fewest_checkpointed(at: Callable[[tuple[int, int]], Candidate], ks: list[tuple[int, int]],
                        start: int | None,
                        known: list[tuple[int, Candidate]] | None = None,
                        limit_bytes: int | None = None) -> tuple[Candidate, int | None]:
    """The cheapest checkpointing along ``ks`` that fits (the peak falls along it).

    See [Note: choosing checkpointing modes].

    Binary search over ``ks``; with ``start`` (a lower bound from a variant needing less
    memory) it steps up from there instead, which is one or two evaluations in practice.

    The frontier's searches ([Note: evaluations across budgets]) pass ``known``, the points
    another budget's search evaluated (``(index, candidate)`` ascending, ``fits`` judged at
    this budget), and their ``limit_bytes``:
    the search starts between the last known point that does not fit and the first that does,
    and probes where the peak, interpolated between the two, meets the limit (the peak falls
    almost linearly along a path: two or three evaluations instead of seven). With the peak
    falling along ``ks`` the answer is the binary search's, the first point that fits; the
    planner's own search passes neither, so a plan never depends on it.
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
    best, worst = last, first
    if known:
        missed, fitted = _bracket([(i, c) for i, c in known if 0 < i < hi])
        if fitted is not None:
            hi, best = fitted
        if missed is not None:
            lo, worst = missed
    if limit_bytes is not None and hi - lo > 1:
        # where the straight line between the bracket's peaks meets the limit, and its
        # neighbour on the other side: the answer when the peak falls as a line
        drop = worst.memory.peak_bytes - best.memory.peak_bytes
        share = (worst.memory.peak_bytes - limit_bytes) / drop if drop > 0 else 0.5
        guess = min(hi - 1, max(lo + 1, lo + math.ceil(share * (hi - lo))))
        cand = at(ks[guess])
        if cand.fits:
            hi, best = guess, cand
            if hi - lo > 1:
                below = at(ks[hi - 1])
                if below.fits:
                    hi, best = hi - 1, below
                else:
                    lo = hi - 1
        else:
            lo = guess
            if hi - lo > 1:
                above = at(ks[lo + 1])
                if above.fits:
                    hi, best = lo + 1, above
                else:
                    lo += 1
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
    size-based default, and the root alone, each fully sharded over the world."""
    s = evaluator.settings
    graph = evaluator.graph
    out: list[Candidate] = []

    def recipe(groups: list[list[str]], reshard: list[bool], **modes: frozenset[int]) -> Layout:
        return Layout(strategy="full", mesh=(1, s.world_size),
                      groups=tuple(tuple(g) for g in groups), reshard=tuple(reshard), **modes)

    def own_units(groups: list[list[str]]) -> list[list[str]]:
        if not s.precision.lowers_precision:
            return groups
        return with_full_precision_units(graph, groups)
    # Each recipe with batch norm as units of its own, as FSDP1's mixed precision wraps it
    # ([Note: batch norm in full precision]): without them a bf16 recipe would not run.
    if graph.blocks:
        blocks = [[b] for b in graph.blocks]
        groups = own_units(blocks)
        reshard = [True] * len(groups)
        reshard[groups.index(blocks[-1])] = False
        if check_tied(graph, groups):
            out.append(evaluator.evaluate(recipe(groups, reshard),
                                          "recipe: torchtitan (unit per block)"))
            every = frozenset(range(evaluator.composer.max_checkpointed))
            if every and evaluator.composer.has_selective:
                # torchtitan's op policy saves every second matmul; facts without that pass
                # (written before it existed) give the row at the analysed stride, named so
                strided = evaluator.with_mm_stride(TORCHTITAN_MM_STRIDE)
                stride = (TORCHTITAN_MM_STRIDE if strided is not None
                          and strided.composer.has_selective
                          else evaluator.analysis.selective_mm_stride)
                name = "recipe: torchtitan selective-op AC" + (
                    "" if stride == TORCHTITAN_MM_STRIDE else " (saving every matmul)"
                    if stride == 1 else f" (saving every {stride}th matmul)")
                out.append(evaluator.evaluate(dataclasses.replace(
                    recipe(groups, reshard, selective=every), selective_mm_stride=stride), name))
            if every:
                out.append(evaluator.evaluate(recipe(groups, reshard, full=every),
                                              "recipe: full AC every block"))
    sized = own_units(size_based_units(graph))
    if check_tied(graph, sized):
        out.append(evaluator.evaluate(recipe(sized, [True] * len(sized)),
                                      "recipe: FSDP1 size_based (1e8)"))
    alone = own_units([])
    out.append(evaluator.evaluate(recipe(alone, [True] * len(alone)), "recipe: root only"))
    return out
