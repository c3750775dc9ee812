"""The collective-count rule for units whose module runs twice per forward, against gloo runs."""

from __future__ import annotations

import os

import pytest
import torch
from layouts import evaluate

from fsdp_plan.cost.hardware import hardware_for
from fsdp_plan.facts.analysis import analyze
from fsdp_plan.facts.graph import build_module_graph
from fsdp_plan.measure.collectives import count_collectives_many
from fsdp_plan.model.load import ModelSource, load_model
from fsdp_plan.plan.document import Mesh, Plan, Unit
from fsdp_plan.search.candidate import SearchSettings
from fsdp_plan.search.evaluator import Evaluator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIXED = os.path.join(ROOT, "examples", "mixed.py")


@pytest.mark.slow
def test_shared_module_unit_counts_match_gloo():
    source = ModelSource(source=MIXED, batch_size=1, seq_len=32)
    loaded = load_model(source)
    graph = build_module_graph(loaded.model)
    analysis = analyze(loaded, param_dtype=torch.bfloat16, blocks=graph.blocks)
    ev = Evaluator(graph, analysis, SearchSettings(budget_bytes=10**9, headroom_bytes=0, world_size=2,
                                                   gpus_per_node=8, hardware=hardware_for("h100")))
    jobs, expected = [], []
    for reshard in (True, False):
        cand = evaluate(ev, name="x", strategy="full", replicate=1, shard=2,
                           groups=[["shared_proj"], ["branches.wide"]], reshard=[reshard, True],
                           root_reshard=False, k=0, forward_prefetch=0, backward_prefetch=1)
        plan = Plan(model={"source": MIXED, "entry": "build_model", "args": {}, "batch_size": 1,
                           "seq_len": 32}, budget_bytes=10**9, world_size=2,
                    mesh=Mesh(replicate=1, shard=2),
                    units=[Unit(modules=u.modules, reshard_after_forward=u.reshard_after_forward)
                           for u in cand.units],
                    mixed_precision={"param_dtype": "bfloat16", "reduce_dtype": "float32"})
        for version, counts in ((2, cand.collectives), (1, cand.collectives_fsdp1)):
            jobs.append({"plan": plan.to_dict(), "fsdp_version": version, "mesh": (1, 2)})
            expected.append({k: v for k, v in counts.items() if v})
    measured = count_collectives_many(source, jobs, nproc=2)
    for ranks, want in zip(measured, expected):
        assert {k: v for k, v in ranks[0].items() if v} == want
