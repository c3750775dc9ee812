"""The evaluator's caches change no answer (issue 29 item 3).

The search and the frontier evaluate one layout under many checkpointing, prefetch and
strategy choices, and the evaluator keeps what they share: a layout's units, forward calls,
collectives and cross-node bytes (search/evaluator.py), its unit costs in forward order
(cost/unit_time.py ``UnitClock.ordered_costs``), the units' byte rates across profiles
(cost/memory.py ``_rates_of``), DDP's host issue times. A candidate evaluated after many
others must equal, field for field, the same layout evaluated first on a fresh evaluator: a
cache key that leaves out something its value reads fails here. Fixture-level (the tiny
Llama facts), no torch model.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from layouts import layout

from fsdp_plan.cost.ddp_buckets import DDPConfig
from fsdp_plan.cost.hardware import hardware_for
from fsdp_plan.cost.memory import _rates_of, _unit_rates
from fsdp_plan.cost.precision import Precision
from fsdp_plan.cost.units import build_units
from fsdp_plan.facts.types import ModelFacts
from fsdp_plan.search.candidate import Layout, SearchSettings
from fsdp_plan.search.evaluator import Evaluator

FIXTURE = Path(__file__).parent / "fixtures" / "tiny_llama_facts.json"


@pytest.fixture(scope="module")
def facts() -> ModelFacts:
    with open(FIXTURE) as f:
        return ModelFacts.from_dict(json.load(f))


def _settings(**overrides) -> SearchSettings:
    return SearchSettings(budget_bytes=10**9, headroom_bytes=0, world_size=8, gpus_per_node=4,
                          hardware=hardware_for("h100"), **overrides)


def _layouts(blocks: list[str]) -> list[Layout]:
    """Layouts that share units, meshes and checkpointing in every combination the caches
    tell apart: the same groups, reshard choices and mesh under two strategies (FSDP1's
    counts read the strategy), every prefetch depth, checkpointing counts both ways."""
    groupings = [[[b] for b in blocks], [blocks[:2], blocks[2:]],
                 [["tok_embeddings"], *[[b] for b in blocks], ["output"]]]
    out = []
    for groups in groupings:
        for strategy, replicate, shard, reshard in (("full", 1, 8, True), ("full", 1, 8, False),
                                                    ("grad-op", 1, 8, False),
                                                    ("hybrid", 2, 4, True)):
            for k in (0, 2, len(blocks), 1):
                for fwp, bwp in ((0, 1), (1, 2), (0, 2)):
                    out.append(layout(strategy=strategy, replicate=replicate, shard=shard,
                                      groups=groups, reshard=[reshard] * len(groups),
                                      root_reshard=reshard and strategy != "grad-op", k=k,
                                      forward_prefetch=fwp, backward_prefetch=bwp))
    return out


def _timed(candidate):
    assert candidate.time.step_s > 0
    return candidate


@pytest.mark.parametrize("overrides", [
    {},
    {"optimizer_overlap": True},
    {"precision": Precision.of("bfloat16", "bfloat16"), "grad_accum_steps": 2,
     "gradient_sync": "last"},
], ids=["plain", "optimizer-overlap", "bf16-accumulation"])
def test_a_warm_evaluator_answers_as_a_fresh_one(facts, overrides):
    settings = _settings(**overrides)
    layouts = _layouts(facts.graph.blocks)
    warm = Evaluator(facts.graph, facts.analysis, settings)
    # each step time read as it is evaluated, so the clock's caches fill in this order too
    # ([Note: step times when asked]: unread, it would be computed at the comparison)
    answers = [_timed(warm.evaluate(lay, f"c{i}")) for i, lay in enumerate(layouts)]
    backwards = Evaluator(facts.graph, facts.analysis, settings)
    reversed_answers = [_timed(backwards.evaluate(lay, f"c{i}"))
                        for i, lay in reversed(list(enumerate(layouts)))][::-1]
    for i, lay in enumerate(layouts):
        fresh = Evaluator(facts.graph, facts.analysis, settings).evaluate(lay, f"c{i}")
        assert repr(answers[i]) == repr(fresh), lay
        assert repr(reversed_answers[i]) == repr(fresh), lay
    # the grouping and strategy pairs really differ where the caches must tell them apart
    full = next(a for a in answers if a.layout.strategy == "full" and not a.layout.reshard[0])
    grad_op = next(a for a in answers if a.layout.strategy == "grad-op"
                   and a.layout.groups == full.layout.groups)
    assert full.collectives_fsdp1 != grad_op.collectives_fsdp1


def test_ddp_layouts_answer_as_on_a_fresh_evaluator(facts):
    settings = _settings(precision=Precision.of("float32", "float32"))
    configs = [DDPConfig(bucket_cap_mb=cap, first_bucket_mb=first)
               for cap, first in ((1, 1), (0.05, 0.01), (0.01, 0.01))]
    layouts = [Layout(strategy="ddp", mesh=(8, 1), ddp=c) for c in configs]
    warm = Evaluator(facts.graph, facts.analysis, settings)
    answers = [warm.evaluate(lay, f"d{i}") for i, lay in enumerate(layouts)]
    for i, lay in enumerate(layouts):
        fresh = Evaluator(facts.graph, facts.analysis, settings).evaluate(lay, f"d{i}")
        assert repr(answers[i]) == repr(fresh)
    assert len({len(a.detail.buckets) for a in answers}) > 1


def test_unit_rates_are_kept_by_everything_they_read(facts):
    blocks = facts.graph.blocks
    precisions = [Precision.of("bfloat16", "float32"), Precision.of("bfloat16", "bfloat16"),
                  Precision.of("float32", "float32")]
    cases = [(build_units(facts.graph, [[b] for b in blocks], [True] * len(blocks), shard), p,
              shard) for shard in (1, 2, 8) for p in precisions]
    cases.append((build_units(facts.graph, [blocks[:2], blocks[2:]], [True, True], 8),
                  precisions[0], 8))
    for units, p, shard in cases + cases[::-1]:
        rates = _rates_of(units, p, shard)
        assert np.array_equal(rates, _unit_rates(units, p, shard))
        assert not rates.flags.writeable


def _reference_units(graph, groups: list[list[str]], shard_size: int) -> list[tuple]:
    """``build_units`` as one walk over every module per layout and shard size (as it read
    before the unit tables were split into ownership and shards, cost/units.py)."""
    import math

    from fsdp_plan.cost.units import owner_unit

    groups = [list(g) for g in groups] + [[""]]
    units = [{"modules": g, "numel": 0, "shard": 0, "params": 0, "owned": [],
              "param_modules": [], "largest": 0,
              "full": all(graph.modules[m].keeps_full_precision for m in g)} for g in groups]
    unit_of_module = {m: i for i, g in enumerate(groups) for m in g}
    for fqn, info in graph.modules.items():
        unit = units[owner_unit(fqn, unit_of_module)]
        unit["owned"].append(fqn)
        if info.direct_numel:
            unit["param_modules"].append((fqn, info.direct_numel))
        for shape in info.param_shapes:
            numel = math.prod(shape) if shape else 1
            dim0 = shape[0] if shape else 1
            shard = math.ceil(dim0 / shard_size) * (numel // max(dim0, 1))
            unit["numel"] += numel
            unit["shard"] += shard
            unit["largest"] = max(unit["largest"], shard)
            unit["params"] += 1
    return [(u["modules"], u["numel"], u["shard"], u["params"], u["owned"], u["param_modules"],
             u["full"], u["largest"]) for u in units]


def test_unit_tables_are_the_walk_over_every_module():
    """A layout's units at every shard size, kept as what the layout owns plus each shard
    size's padded shards, are what a walk over every parameter gives, odd dims and scalar
    parameters included."""
    with open(FIXTURE) as f:
        graph = ModelFacts.from_dict(json.load(f)).graph  # its own: its shapes change below
    blocks = graph.blocks
    odd = next(m for m, info in graph.modules.items() if info.param_shapes)
    graph.modules[odd].param_shapes = [*graph.modules[odd].param_shapes, [], [7, 3], [5]]
    layouts = [[[b] for b in blocks], [blocks[:2], blocks[2:]],
               [["tok_embeddings"], *[[b] for b in blocks], ["output"]], []]
    for shard_size in (1, 3, 8, 64, 1000):
        for groups in layouts:
            units = build_units(graph, groups, [True] * len(groups), shard_size)
            assert [(u.modules, u.numel, u.shard_numel, u.num_params, u.owned_modules,
                     u.param_modules, u.full_precision, u.largest_shard_numel)
                    for u in units] == _reference_units(graph, groups, shard_size)


def test_a_units_recompute_is_summed_in_module_order(facts):
    """A unit that owns several checkpointed blocks (the root alone) adds their recompute in
    module order, whatever the process's string hashes: the owned modules as a set summed in
    hash order, and a root-only plan's step changed in its last bits from one run to the
    next. Values whose sum depends on the order show it."""
    evaluator = Evaluator(facts.graph, facts.analysis, _settings())
    blocks = facts.graph.blocks
    units = build_units(facts.graph, [], [], 8)
    values = [1e16, 1.0, -1e16, 3.0, 0.5, -7.0][:len(blocks)]
    recompute = {b: (v, 0.0) for b, v in reversed(list(zip(blocks, values)))}
    ordered, _ = evaluator.clock.ordered_costs(units, shard=8, replicate=1, recompute=recompute,
                                               optimizer_overlap=False, layout_key=None)
    base = evaluator.clock.unit_cost(units[-1], shard=8, replicate=1)
    owned = [m for m in units[-1].owned_modules if m in recompute]
    assert owned == blocks
    assert ordered[0].bw_compute_s == base.bw_compute_s + sum(recompute[b][0] for b in owned)


def test_a_units_owned_times_are_shared_across_meshes_and_equal_a_fresh_clocks(facts):
    """``UnitClock._owned_times``: the pass times of a unit's owned modules are worked out
    once per module set and parameter count, whatever the layout, mesh or reshard, and every
    unit cost built on them equals the one a fresh clock builds for that unit alone."""
    blocks = facts.graph.blocks
    layouts = [[[b] for b in blocks], [blocks[:2], blocks[2:]], []]
    shared = Evaluator(facts.graph, facts.analysis, _settings()).clock
    seen = {}
    for groups in layouts:
        for reshard in (True, False):
            for shard, replicate in ((8, 1), (4, 2), (2, 4), (1, 8)):
                units = build_units(facts.graph, groups, [reshard] * len(groups), shard)
                for u in units:
                    fresh = Evaluator(facts.graph, facts.analysis, _settings()).clock
                    assert (shared.unit_cost(u, shard=shard, replicate=replicate)
                            == fresh.unit_cost(u, shard=shard, replicate=replicate))
                    times = shared._owned_times(u)
                    assert seen.setdefault((tuple(u.owned_modules), u.num_params),
                                           times) is times
                    assert times.blocks == tuple(m for m in u.owned_modules if m in blocks)
    assert len(shared._owned) == len(seen) < sum(len(g) + 1 for g in layouts) * 2 * 4
