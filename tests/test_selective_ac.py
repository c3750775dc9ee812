"""Per-block activation checkpointing in three modes (none, selective per-op, full).

The tiny Llama (examples/llama.py) is planned, predicted, measured with FSDPMemTracker and run
on gloo with selectively and mixed checkpointed blocks; the plan's version-2 form round-trips;
the standard recipes include torchtitan's selective-op recipe and full checkpointing of every
block; a Hugging Face Llama (default ``use_cache=True``) replays under the policy's selective
wrapper (marked ``hf``).
"""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch
from test_measure_helpers import LLAMA, plan_file, run_cli, tiny_llama_plan

from fsdp_plan.api import PlanRequest, analyze_model, plan_from_facts
from fsdp_plan.facts.checkpointing import DEFAULT_SELECTIVE_OPS
from fsdp_plan.model.source import ModelSource
from fsdp_plan.plan.document import Plan, plan_to_yaml, read_plan
from fsdp_plan.search.evaluator import Evaluator
from fsdp_plan.search.fsdp import standard_recipes

BF16 = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}

# its plans and predictions of the same small models share their analyses (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("facts_cache_per_file")


def _with_modes(plan: Plan, modes: dict[str, str]) -> Plan:
    return dataclasses.replace(plan, fsdp_plan_version=2, activation_checkpointing=modes,
                               selective_ops=list(DEFAULT_SELECTIVE_OPS))


def _predicted(tmp_path, plan: Plan) -> Plan:
    """The plan with ``predicted`` filled in by ``fsdp-plan predict``."""
    code, out, err = run_cli(["predict", plan_file(tmp_path, plan, "unpredicted.yaml"),
                              "--format", "json"])
    assert code == 0, err
    return dataclasses.replace(plan, predicted=json.loads(out)["predicted"])


@pytest.fixture(scope="module")
def tiny_facts():
    source = ModelSource(source=LLAMA, args={"size": "tiny"}, batch_size=2, seq_len=32)
    # as planning analyses: with torchtitan's stride-2 selective pass for its recipe row
    return analyze_model(source, param_dtype="bfloat16", selective_strides=(2,)).facts


def test_the_selective_pass_saves_part_of_what_full_saves(tiny_facts):
    a = tiny_facts.analysis
    assert a.selective_timeline is not None and not a.selective_unavailable
    assert a.selective_ops == DEFAULT_SELECTIVE_OPS

    def top(timeline):
        return max(e.peak for e in timeline.events)
    assert top(a.checkpointed_timeline) < top(a.selective_timeline) < top(a.timeline)
    evaluator = Evaluator(tiny_facts.graph, a, PlanRequest(
        source=ModelSource(source=LLAMA), budget_bytes=10**9, world_size=2).settings())
    for costs in evaluator.block_cost.values():
        full, sel = costs["full"], costs["selective"]
        assert 0 < sel.saved_bytes < full.saved_bytes
        assert 0 < sel.recompute_s < full.recompute_s


@pytest.mark.parametrize("modes", [
    {f"layers.{i}": "selective" for i in range(4)},
    {"layers.0": "full", "layers.1": "selective", "layers.3": "selective"},
], ids=["all selective", "mixed"])
def test_verify_measures_what_predict_says(tmp_path, modes):
    """FSDPMemTracker on the fake process group (world 4) against the prediction."""
    plan = _predicted(tmp_path, _with_modes(tiny_llama_plan(world=4, mixed_precision=BF16),
                                            modes))
    assert plan.predicted["activation_checkpointing"]["selective"] == sum(
        m == "selective" for m in modes.values())
    code, out, err = run_cli(["verify", plan_file(tmp_path, plan), "--format", "json",
                              "--tolerance", "0.03"])
    assert code == 0, err
    data = json.loads(out)
    assert data["ok"] and abs(data["relative_error"]) <= 0.03, data
    assert "Traceback" not in err


def test_selective_blocks_lower_the_predicted_peak(tmp_path):
    base = tiny_llama_plan(world=4, mixed_precision=BF16, batch_size=4, seq_len=64)
    peaks = {}
    for name, mode in (("none", None), ("selective", "selective"), ("full", "full")):
        modes = {f"layers.{i}": mode for i in range(4)} if mode else {}
        plan = _with_modes(base, modes) if mode else base
        peaks[name] = _predicted(tmp_path, plan).predicted["peak_bytes"]
    assert peaks["full"] < peaks["selective"] < peaks["none"]


def test_plan_round_trip_keeps_modes_and_ops(tmp_path):
    modes = {"layers.0": "full", "layers.2": "selective"}
    plan = _with_modes(tiny_llama_plan(world=2), modes)
    doc = plan.to_dict()
    assert doc["fsdp_plan_version"] == 2 and doc["activation_checkpointing"] == modes
    assert doc["selective_ops"] == DEFAULT_SELECTIVE_OPS
    again = read_plan(plan_file(tmp_path, plan))
    assert again.activation_checkpointing == modes
    assert again.selective_ops == DEFAULT_SELECTIVE_OPS
    assert plan_to_yaml(again) == plan_to_yaml(plan)
    # Without a selective block the plan keeps version 1's list and writes no ops.
    plain = tiny_llama_plan(world=2, ac=["layers.0"]).to_dict()
    assert plain["activation_checkpointing"] == ["layers.0"] and "selective_ops" not in plain


def test_policy_module_wraps_each_mode():
    from fsdp_plan.plan.emit import load_policy_module, render_policy_module

    plan = _with_modes(tiny_llama_plan(world=2), {"layers.0": "full", "layers.1": "selective"})
    policy = load_policy_module(render_policy_module(plan))
    model = policy.apply_activation_checkpointing(_real_tiny_llama())
    kinds = [type(layer).__name__ for layer in model.layers]
    assert kinds[:3] == ["CheckpointWrapper", "CheckpointWrapper", "TransformerBlock"], kinds
    # Only the selective block saves ops: its wrapper has a context function.
    assert model.layers[1].checkpoint_fn.keywords.get("context_fn") is not None
    assert model.layers[0].checkpoint_fn.keywords.get("context_fn") is None
    model(torch.randint(0, 512, (2, 16))).float().sum().backward()
    assert all(p.grad is not None for p in model.layers[1].parameters())


def _real_tiny_llama():
    import importlib.util
    spec = importlib.util.spec_from_file_location("tiny_llama_example", LLAMA)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # its dataclasses look their module up
    spec.loader.exec_module(module)
    torch.manual_seed(0)
    return module.build_model(size="tiny")


def test_selective_gradients_equal_no_checkpointing():
    from fsdp_plan.policy_runtime import checkpoint_module, resolve_ops

    torch.manual_seed(0)
    plain = _real_tiny_llama()
    selective = _real_tiny_llama()
    selective.load_state_dict(plain.state_dict())
    ops = resolve_ops(DEFAULT_SELECTIVE_OPS)
    for i in range(len(selective.layers)):
        selective.layers[i] = checkpoint_module(selective.layers[i], ops)
    tokens = torch.randint(0, 512, (2, 16))
    for model in (plain, selective):
        model(tokens).float().pow(2).mean().backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), selective.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def test_recipes_include_torchtitan_selective_and_full_ac(tiny_facts):
    settings = PlanRequest(source=ModelSource(source=LLAMA), budget_bytes=10**9,
                           world_size=2).settings()
    recipes = {c.name: c for c in standard_recipes(Evaluator(tiny_facts.graph,
                                                             tiny_facts.analysis, settings))}
    sel = recipes["recipe: torchtitan selective-op AC"]
    full = recipes["recipe: full AC every block"]
    blocks = tiny_facts.graph.blocks
    assert sel.selective == blocks and sel.checkpointed == blocks
    assert sel.selective_mm_stride == 2  # torchtitan's op policy: every second matmul
    assert full.checkpointed == blocks and not full.selective
    assert full.memory.peak_bytes < sel.memory.peak_bytes
    assert sel.recompute_s < full.recompute_s


def test_chosen_plan_is_never_slower_than_a_fitting_recipe(tiny_facts):
    request = PlanRequest(source=ModelSource(source=LLAMA, args={"size": "tiny"}, batch_size=2,
                                             seq_len=32), budget_bytes=10**9, world_size=2)
    result = plan_from_facts(tiny_facts, request)
    for recipe in result.recipes:
        if recipe.fits:
            assert result.best.time.step_s <= recipe.time.step_s + 1e-12, recipe.name


def test_without_a_selective_pass_only_full_is_searched(tiny_facts):
    analysis = dataclasses.replace(tiny_facts.analysis, selective_timeline=None,
                                   selective_unavailable="selective checkpointing of X blocks "
                                   "does not replay in backward")
    settings = PlanRequest(source=ModelSource(source=LLAMA), budget_bytes=10**9,
                           world_size=2).settings()
    evaluator = Evaluator(tiny_facts.graph, analysis, settings)
    assert all(n_sel == 0 for path in evaluator.checkpoint_options() for _, n_sel in path)
    names = [c.name for c in standard_recipes(evaluator)]
    assert "recipe: torchtitan selective-op AC" not in names
    from fsdp_plan.plan.report import format_checkpointing
    text = format_checkpointing(standard_recipes(evaluator)[0], analysis.selective_unavailable)
    assert text.splitlines()[0].startswith("note: selective checkpointing of X blocks")


@pytest.mark.slow
def test_an_emitted_selective_plan_steps_on_gloo(tmp_path):
    """FSDP2 and FSDP1 through the emitted policy, 2 gloo ranks, with the plan's collectives."""
    from fsdp_plan.measure.collectives import count_collectives_many

    plan = _predicted(tmp_path, _with_modes(
        tiny_llama_plan(world=2, mixed_precision=BF16),
        {"layers.0": "full", "layers.1": "selective", "layers.2": "selective"}))
    document = plan.to_dict()
    source = ModelSource(source=LLAMA, args={"size": "tiny", "n_layers": 4}, batch_size=2,
                         seq_len=32)
    jobs = [{"plan": document, "fsdp_version": v, "source": source} for v in (2, 1)]
    results = count_collectives_many(source, jobs, nproc=2, timeout_s=600)
    fsdp2, fsdp1 = results
    assert fsdp2[0] == fsdp2[1] == plan.predicted["collectives_per_step"]
    assert fsdp1[0] == fsdp1[1] == plan.predicted["collectives_per_step_fsdp1"]


@pytest.mark.hf
def test_hugging_face_llama_replays_under_the_selective_wrapper():
    """[Note: selective checkpointing and KV caches]: with the config's default use_cache=True
    a selectively checkpointed LlamaDecoderLayer fails in backward unless the wrapper drops
    the cache while training, as the policy's does."""
    transformers = pytest.importorskip("transformers")
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        checkpoint_wrapper,
    )
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    from fsdp_plan.policy_runtime import checkpoint_module, resolve_ops, selective_policy

    def build():
        torch.manual_seed(0)
        config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, vocab_size=128)
        return transformers.LlamaForCausalLM(config)
    ops = resolve_ops(DEFAULT_SELECTIVE_OPS)
    tokens = torch.randint(0, 128, (2, 16))
    bare = build()
    policy = selective_policy(ops)
    for i, layer in enumerate(bare.model.layers):
        bare.model.layers[i] = checkpoint_wrapper(
            layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT,
            context_fn=lambda: create_selective_checkpoint_contexts(policy))
    with pytest.raises(RuntimeError, match="not found in storage"):
        bare(input_ids=tokens, labels=tokens).loss.backward()
    wrapped = build()
    for i, layer in enumerate(wrapped.model.layers):
        wrapped.model.layers[i] = checkpoint_module(layer, ops)
    wrapped(input_ids=tokens, labels=tokens).loss.backward()
    assert all(p.grad is not None for p in wrapped.model.layers[0].parameters())


@pytest.mark.slow
def test_llama_8b_between_selective_and_no_checkpointing_beats_both_recipes():
    """Issue 10's acceptance: Llama 3 8B, world 8, batch 2 x 8192, a budget between the
    selective-everywhere peak and the no-checkpointing peak (planned in about 10 s)."""
    source = ModelSource(source=LLAMA, args={"size": "8b"}, batch_size=2, seq_len=8192)
    facts = analyze_model(source, selective_strides=(2,)).facts  # as planning analyses
    result = plan_from_facts(facts, PlanRequest(source=source, budget_bytes=120 * 10**9,
                                                world_size=8))
    recipes = {c.name: c for c in result.recipes}
    selective = recipes["recipe: torchtitan selective-op AC"]
    full = recipes["recipe: full AC every block"]
    none = recipes["recipe: torchtitan (unit per block)"]
    assert selective.memory.peak_bytes < 108 * 10**9 < none.memory.peak_bytes
    best = result.best
    assert best.fits and selective.fits and full.fits
    assert best.time.step_s < selective.time.step_s < full.time.step_s
    assert len(best.checkpointed) < len(facts.graph.blocks) or 0 < len(best.selective) < len(
        best.checkpointed)
    assert best.selective  # selective blocks save more per recompute second than full ones


def test_a_block_that_does_not_replay_is_planned_with_full_checkpointing_only():
    """tests/fixtures/replay_mismatch.py takes a slice only when replayed: full checkpointing
    replays it, selective does not; the plan says so in one line and never goes selective."""
    from pathlib import Path

    model = str(Path(__file__).parent / "fixtures" / "replay_mismatch.py")
    args = [model, "--batch-size", "64", "--seq-len", "256", "--world-size", "2"]
    code, out, err = run_cli([*args, "--mem", "25MB"])
    assert code == 0, err
    note = [line for line in out.splitlines() if line.startswith("note: selective")]
    expected = ("note: selective checkpointing of Block blocks does not replay in backward "
                "(RuntimeError: aten.alias.default encountered during backward but not found in "
                "storage); full checkpointing only")
    assert note == [expected]
    assert "full" in out.split("checkpointed blocks")[1].splitlines()[2]
    code, out, err = run_cli([*args, "--mem", "25MB", "--format", "json"])
    data = json.loads(out)
    assert not isinstance(data["plan"]["activation_checkpointing"], dict)
    assert all(c["selective_blocks"] == 0 for c in data["candidates"])
    assert "recipe: torchtitan selective-op AC" not in {c["name"] for c in data["candidates"]}
