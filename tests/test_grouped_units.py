"""Grouped units (one ``fully_shard`` call over several consecutive blocks): measurement,
memory model, where to cut a stack (grouping.py), and the layouts the search tries."""

from __future__ import annotations

import os

import pytest
from layouts import evaluate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VIT = os.path.join(ROOT, "examples", "vit.py")


def _grouped_plan(src, facts, groups, world=4, checkpoint=()):
    from fsdp_plan.api import predict
    from fsdp_plan.plan.document import Mesh, Plan, Unit
    units = [Unit(modules=g) for g in groups] + [Unit(modules=[""], reshard_after_forward=False)]
    plan = Plan(model=src.to_plan_dict(), budget_bytes=10**12, world_size=world,
                mesh=Mesh(replicate=1, shard=world), units=units,
                activation_checkpointing=list(checkpoint),
                mixed_precision={"param_dtype": "bfloat16", "reduce_dtype": "float32"})
    plan.predicted = predict(plan, facts).predicted
    return plan


@pytest.mark.slow
def test_grouped_unit_measured_as_fsdp2_runs_it_and_predicted_within_3_percent():
    """FSDPMemTracker replaces a group's hooks with per-module ones (the group reshards after
    each module) and breaks the next tracker; the group-aware tracker measures what FSDP2 runs,
    and the memory model matches it."""
    from fsdp_plan.api import analyze_model
    from fsdp_plan.measure.memory import measure_peak
    from fsdp_plan.model.source import ModelSource
    from fsdp_plan.plan.emit import load_policy_module, render_policy_module

    src = ModelSource(source=VIT, args={"size": "base", "depth": 4}, batch_size=2, seq_len=1)
    analyzed = analyze_model(src)
    blocks = analyzed.facts.graph.blocks
    for groups, ckpt in (([blocks[:2], blocks[2:]], ()), ([blocks[:3], blocks[3:]], blocks[:2])):
        plan = _grouped_plan(src, analyzed.facts, groups, checkpoint=ckpt)
        measured = measure_peak(analyzed.loaded, plan,
                                load_policy_module(render_policy_module(plan)))
        predicted = plan.predicted["peak_bytes"]
        assert abs(predicted - measured.peak_bytes) <= 0.03 * measured.peak_bytes, (
            groups, predicted, measured.peak_bytes)
        # a whole group is unsharded at once: more than one block's parameters
        assert measured.breakdown["Unsharded Param"] + measured.breakdown["All Gather"] > 0


def _costs(n, compute_s, gather_bytes):
    from fsdp_plan.search.grouping import BlockCost
    return [BlockCost(fqn=f"layers.{i}", compute_s=compute_s, gather_bytes=gather_bytes,
                      reduce_bytes=2 * gather_bytes) for i in range(n)]


def _setup(**kw):
    from fsdp_plan.cost.hardware import hardware_for
    from fsdp_plan.search.grouping import CommSetup
    return CommSetup(hardware=hardware_for("h100"), shard=8, **kw)


def test_latency_bound_blocks_are_grouped_up_to_the_allowance():
    """Tiny blocks: each collective is mostly latency, so fewer units are faster; no group
    gathers more than the allowance."""
    from fsdp_plan.search.grouping import cut_stack
    costs = _costs(12, compute_s=1e-6, gather_bytes=10_000)
    groups = cut_stack(costs, _setup(), allowance_bytes=40_000)
    assert [b for g in groups for b in g] == [c.fqn for c in costs]  # consecutive, all blocks
    assert all(len(g) <= 4 for g in groups)
    assert len(groups) < 12
    assert len(cut_stack(costs, _setup(), allowance_bytes=10**12)) < len(groups)


def test_compute_bound_blocks_stay_one_unit_each():
    """When compute hides every collective, grouping only delays the first all-gather and the
    last reduce-scatter and holds more memory: one block per unit."""
    from fsdp_plan.search.grouping import cut_stack
    costs = _costs(8, compute_s=1.0, gather_bytes=10**8)
    assert cut_stack(costs, _setup(), allowance_bytes=10**12) == [[c.fqn] for c in costs]


def test_weight_is_the_slower_stream_plus_exposed_ends():
    from fsdp_plan.cost.step_time import collective_time
    from fsdp_plan.search.grouping import unit_seconds
    setup = _setup()
    hw = setup.hardware
    group = _costs(2, compute_s=1e-3, gather_bytes=10**6)
    ag = collective_time(hw, 2 * 10**6, 8)
    rs = collective_time(hw, 4 * 10**6, 8, "reduce_scatter")
    middle = unit_seconds(group, setup, first=False, last=False)
    assert middle == pytest.approx(max(2e-3, 2 * ag + rs), rel=1e-6)
    assert unit_seconds(group, setup, first=True, last=True) == pytest.approx(
        middle + ag + rs, rel=1e-6)


def test_stacks_group_siblings_only():
    """Blocks of two containers (an encoder and a decoder) are cut separately."""
    from fsdp_plan.facts.types import ModuleGraph, ModuleInfo
    from fsdp_plan.search.grouping import stacks
    blocks = ["enc.0", "enc.1", "dec.0", "dec.1"]
    mods = {"": ModuleInfo(fqn="", class_name="M", parent=None, children=[], direct_numel=0,
                           subtree_numel=0)}
    graph = ModuleGraph(modules=mods, tied_groups=[], blocks=blocks, total_numel=0,
                        total_param_bytes=0, total_buffer_bytes=0)
    assert stacks(graph) == [["enc.0", "enc.1"], ["dec.0", "dec.1"]]


def test_search_evaluates_grouped_layouts_with_the_exact_models():
    """On the tiny Llama fixture at a large world the search tries grouped layouts; each
    grouped candidate's units hold consecutive blocks and its collectives count one set per
    group (FSDP2) and one per module (FSDP1)."""
    from fsdp_plan.cost.hardware import hardware_for
    from fsdp_plan.facts.types import ModelFacts
    from fsdp_plan.search.candidate import SearchSettings
    from fsdp_plan.search.evaluator import Evaluator
    from fsdp_plan.search.fsdp import ShardedStrategy
    from fsdp_plan.search.layouts import block_layouts
    with open(os.path.join(ROOT, "tests", "fixtures", "tiny_llama_facts.json")) as f:
        facts = ModelFacts.from_json(f.read())
    settings = SearchSettings(budget_bytes=10**10, headroom_bytes=0, world_size=64,
                              gpus_per_node=8, strategy="full", hardware=hardware_for("h100"))
    ev = Evaluator(facts.graph, facts.analysis, settings)
    layouts = block_layouts(facts.graph, True, ev)
    grouped = {k: v for k, v in layouts.items() if k.startswith("grouped/")}
    assert grouped, layouts.keys()
    ranked = ShardedStrategy().candidates(ev)
    cands = [c for c in ranked if " grouped/" in c.name]
    assert cands
    for c in cands:
        multi = [u for u in c.units if len(u.modules) > 1]
        assert multi
        ran = [u for u in c.units if u.numel]
        assert c.collectives["reduce_scatter"] == len(ran)
        assert c.collectives_fsdp1["reduce_scatter"] == sum(len(u.modules) for u in ran)


@pytest.mark.slow
@pytest.mark.parametrize("mesh", [(1, 2), (2, 2)], ids=["world2", "hsdp2x2"])
def test_grouped_unit_collectives_match_gloo(mesh):
    """Predicted FSDP2 and FSDP1 counts of grouped plans equal a real gloo step's."""
    import torch

    from fsdp_plan.cost.hardware import hardware_for
    from fsdp_plan.facts.analysis import analyze
    from fsdp_plan.facts.graph import build_module_graph
    from fsdp_plan.measure.collectives import count_collectives_many
    from fsdp_plan.model.load import load_model
    from fsdp_plan.model.source import ModelSource
    from fsdp_plan.plan.document import Mesh, Plan, Unit
    from fsdp_plan.search.candidate import SearchSettings
    from fsdp_plan.search.evaluator import Evaluator
    replicate, shard = mesh
    world = replicate * shard
    source = ModelSource(source=VIT, args={"size": "tiny"}, batch_size=2, seq_len=1)
    loaded = load_model(source)
    graph = build_module_graph(loaded.model)
    analysis = analyze(loaded, param_dtype=torch.bfloat16, blocks=graph.blocks)
    ev = Evaluator(graph, analysis, SearchSettings(budget_bytes=10**9, headroom_bytes=0,
                                                   world_size=world, gpus_per_node=2,
                                                   hardware=hardware_for("h100")))
    b = graph.blocks
    strategy = "hybrid" if replicate > 1 else "full"
    jobs, expected = [], []
    for groups, reshard in (([b[:2], b[2:]], [True, True]), ([b[:3], b[3:]], [True, False]),
                            ([["patch_embed"], b[:4]], [True, True])):
        cand = evaluate(ev, name="x", strategy=strategy, replicate=replicate, shard=shard,
                           groups=groups, reshard=reshard, root_reshard=False, k=0,
                           forward_prefetch=0, backward_prefetch=1)
        plan = Plan(model={"source": VIT, "entry": "build_model", "args": {"size": "tiny"},
                           "batch_size": 2, "seq_len": 1}, budget_bytes=10**9, world_size=world,
                    mesh=Mesh(replicate=replicate, shard=shard), strategy=strategy,
                    units=[Unit(modules=u.modules, reshard_after_forward=u.reshard_after_forward)
                           for u in cand.units],
                    mixed_precision={"param_dtype": "bfloat16", "reduce_dtype": "float32"})
        for version, counts in ((2, cand.collectives), (1, cand.collectives_fsdp1)):
            jobs.append({"plan": plan.to_dict(), "fsdp_version": version, "mesh": mesh})
            expected.append({k: v for k, v in counts.items() if v})
    measured = count_collectives_many(source, jobs, nproc=world)
    for job, ranks, want in zip(jobs, measured, expected):
        assert {k: v for k, v in ranks[0].items() if v} == want, (job["fsdp_version"],
                                                                 job["plan"]["units"])


def test_shortest_cut_answers_as_networkx_shortest_path_ties_included():
    """``shortest_cut`` is networkx's bidirectional Dijkstra written out (no networkx import on
    every plan): on cut graphs of identical blocks (many paths of equal weight) and on random
    weighted DAGs it returns networkx's path, node for node."""
    import random

    import networkx as nx

    from fsdp_plan.search.grouping import shortest_cut, unit_seconds

    def both(succ, n):
        pred = {j: {} for j in range(n + 1)}
        dag = nx.DiGraph()
        dag.add_nodes_from(range(n + 1))
        for i in range(n + 1):
            for j, w in succ[i].items():
                pred[j][i] = w
                dag.add_edge(i, j, weight=w)
        return shortest_cut(succ, pred, 0, n), nx.shortest_path(dag, 0, n, weight="weight")

    setup = _setup()
    for n, allowance in ((12, 4), (80, 8), (7, 3)):  # identical blocks: ties everywhere
        costs = _costs(n, compute_s=1e-6, gather_bytes=10_000)
        succ = {i: {j: unit_seconds(costs[i:j], setup, first=i == 0, last=j == n)
                    for j in range(i + 1, min(n, i + allowance) + 1)} for i in range(n + 1)}
        mine, theirs = both(succ, n)
        assert mine == theirs
    rng = random.Random(7)
    for trial in range(300):
        n = rng.randint(1, 25)
        succ = {i: {j: float(rng.choice([1, 2, 3, rng.random()]))
                    for j in range(i + 1, min(n, i + rng.randint(1, 6)) + 1)}
                for i in range(n + 1)}
        mine, theirs = both(succ, n)
        assert mine == theirs, (trial, mine, theirs)
