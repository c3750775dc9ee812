"""HSDP at every shard size (issue 11): the options, their cross-node traffic, and whole-step
counts on gloo for a 2x2 and a 4x1 mesh."""

from __future__ import annotations

import os

import pytest
from layouts import evaluate

from fsdp_plan.api import PlanRequest, plan_from_facts
from fsdp_plan.cost.collectives import cross_node_bytes
from fsdp_plan.cost.precision import Precision
from fsdp_plan.facts.types import ModelFacts
from fsdp_plan.measure.collectives import count_collectives_many
from fsdp_plan.model.load import ModelSource
from fsdp_plan.plan.build import to_plan
from fsdp_plan.plan.report import gather_mesh_rows
from fsdp_plan.search.evaluator import Evaluator
from fsdp_plan.search.fsdp import hybrid_shard_sizes

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "tiny_llama_facts.json")
SOURCE = ModelSource(source=os.path.join(ROOT, "examples", "llama.py"), args={"size": "tiny"},
                     batch_size=2, seq_len=64)


def test_shard_sizes_are_whole_nodes_or_part_of_one():
    assert hybrid_shard_sizes(64, 8) == [2, 4, 8, 16, 32]
    assert hybrid_shard_sizes(8, 8) == [2, 4]
    assert hybrid_shard_sizes(48, 8) == [2, 4, 8, 16, 24]
    assert hybrid_shard_sizes(1, 8) == []


def test_the_report_compares_every_shard_size_with_its_cross_node_traffic():
    facts = ModelFacts.from_json(open(FIXTURE).read())
    result = plan_from_facts(facts, PlanRequest(source=SOURCE, budget_bytes=10**9,
                                                world_size=64, gpus_per_node=8))
    rows = {r["mesh"]: r for r in gather_mesh_rows(result.ranked)}
    assert {"1x64", "2x32", "4x16", "8x8", "16x4", "32x2", "64x1"} <= set(rows)
    # Inside a node a shard group sends nothing across nodes; only the replicas' all-reduce
    # does, and it shrinks as the shard group grows to span nodes.
    assert rows["8x8"]["cross_node_bytes"] < rows["1x64"]["cross_node_bytes"]
    assert rows["16x4"]["cross_node_bytes"] > rows["8x8"]["cross_node_bytes"]


def test_cross_node_bytes_by_hand():
    facts = ModelFacts.from_json(open(FIXTURE).read())
    p = Precision(orig_bytes=4, param_bytes=2, reduce_bytes=4)
    result = plan_from_facts(facts, PlanRequest(source=SOURCE, budget_bytes=10**9,
                                                world_size=16, gpus_per_node=8,
                                                strategy="full"))
    units = result.best.units
    got = cross_node_bytes(units, replicate=1, shard=16, world_size=16, gpus_per_node=8,
                           precision=p)
    want = sum(15 / 16 * u.unsharded_numel(16) * ((2 if u.reshard_after_forward else 1) * 2 + 4)
               for u in units if u.numel)
    assert got == int(want)
    assert cross_node_bytes(units, replicate=2, shard=8, world_size=16, gpus_per_node=8,
                            precision=p) == int(sum(u.shard_numel * 4 for u in units if u.numel))


@pytest.mark.slow
def test_hsdp_2x2_and_replicated_4x1_counts_match_gloo():
    facts = ModelFacts.from_json(open(FIXTURE).read())
    jobs, expected = [], []
    for strategy, mesh in (("hybrid", (2, 2)), ("none", (4, 1))):
        request = PlanRequest(source=SOURCE, budget_bytes=10**9, world_size=4,
                              strategy=strategy)
        settings = request.settings()
        ev = Evaluator(facts.graph, facts.analysis, settings)
        blocks = facts.graph.blocks
        cand = evaluate(ev, name="t", strategy=strategy, replicate=mesh[0], shard=mesh[1],
                           groups=[[b] for b in blocks], reshard=[mesh[1] > 1] * len(blocks),
                           root_reshard=False, forward_prefetch=0, backward_prefetch=1)
        plan = to_plan(cand, request, facts)
        jobs.append({"plan": plan.to_dict(), "mesh": mesh})
        expected.append({k: v for k, v in cand.collectives.items() if v})
    measured = count_collectives_many(SOURCE, jobs, nproc=4)
    for ranks, want in zip(measured, expected):
        assert all(r == ranks[0] for r in ranks)
        assert {k: v for k, v in ranks[0].items() if v} == want
