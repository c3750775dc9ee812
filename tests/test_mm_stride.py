"""Selective checkpointing as torchtitan writes it: ``selective_mm_stride`` (SPEC 7).

torchtitan's "op" policy is written out below exactly as torchtitan writes it (a ``meta``
counter per checkpointed call, forward and recompute counted apart, every second ``aten.mm``
recomputed). The policy module's own policy must decide as it does; the planner's torchtitan
recipe row (stride 2) must be within 3% of ``FSDPMemTracker`` running torchtitan's policy;
plans carry the stride through validation, prediction and the emitted policy.
"""

from __future__ import annotations

import dataclasses
import types
from collections import defaultdict

import pytest
import torch
from fixtures.torchtitan_op_policy import _get_custom_policy, _save_list, torchtitan_policy_module
from test_measure_helpers import LLAMA, plan_file, run_cli, tiny_llama_plan
from test_selective_ac import _real_tiny_llama
from torch.utils.checkpoint import CheckpointPolicy

from fsdp_plan.api import PlanRequest, analyze_model, plan_from_facts, predict, to_plan
from fsdp_plan.common.errors import BadInput
from fsdp_plan.facts.checkpointing import DEFAULT_SELECTIVE_OPS
from fsdp_plan.measure.memory import measure_peak
from fsdp_plan.model.load import load_model
from fsdp_plan.model.source import ModelSource
from fsdp_plan.plan.document import Plan, read_plan
from fsdp_plan.plan.emit import load_policy_module, render_policy_module
from fsdp_plan.policy_runtime import resolve_ops, selective_policy

aten = torch.ops.aten

# --- the policy decides as torchtitan's does ---------------------------------------------------

def _decisions(policy, calls):
    return [policy(types.SimpleNamespace(is_recompute=r), op) for r, op in calls]


def test_stride_two_decides_exactly_as_torchtitans_op_policy():
    ops = [aten.mm.default, aten.mm.default, aten.max.default, aten.mm.default, aten.add.Tensor,
           aten._scaled_dot_product_flash_attention_for_cpu.default, aten.mm.default,
           aten.mm.default]
    # a forward, then its recompute with one more forward call in the middle: the two passes
    # count apart
    calls = [(False, op) for op in ops] + [(True, op) for op in ops[:4]] + [
        (False, aten.mm.default), (True, aten.mm.default)] + [(True, op) for op in ops[4:]]
    ours = _decisions(selective_policy(resolve_ops(sorted(str(op) for op in _save_list)), 2),
                      calls)
    theirs = _decisions(_get_custom_policy(defaultdict(int)), calls)
    assert ours == theirs
    saved = [op for (r, op), d in zip(calls, ours) if not r and op == aten.mm.default
             and d == CheckpointPolicy.MUST_SAVE]
    assert len(saved) == 3  # forward mm calls 1, 3 and 5 (the 6th is recomputed)


def test_stride_k_saves_the_first_and_every_kth_matmul_after_it():
    policy = selective_policy([aten.mm.default], 3)
    got = _decisions(policy, [(False, aten.mm.default)] * 7)
    assert [d == CheckpointPolicy.MUST_SAVE for d in got] == [True, False, False, True, False,
                                                            False, True]


def test_stride_two_gradients_equal_no_checkpointing():
    from fsdp_plan.policy_runtime import checkpoint_module

    plain = _real_tiny_llama()
    strided = _real_tiny_llama()
    strided.load_state_dict(plain.state_dict())
    ops = resolve_ops(DEFAULT_SELECTIVE_OPS)
    for i in range(len(strided.layers)):
        strided.layers[i] = checkpoint_module(strided.layers[i], ops, 2)
    tokens = torch.randint(0, 512, (2, 16))
    for model in (plain, strided):
        model(tokens).float().pow(2).mean().backward()
    for (name, a), (_, b) in zip(plain.named_parameters(), strided.named_parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


# --- the recipe against FSDPMemTracker running torchtitan's policy ---------------------------

SMALL = ModelSource(source=LLAMA, args={"size": "small"}, batch_size=2, seq_len=128)


@pytest.fixture(scope="module")
def small_result():
    facts = analyze_model(SMALL, selective_strides=(2,)).facts
    request = PlanRequest(source=SMALL, budget_bytes=10**12, world_size=4)
    return facts, request, plan_from_facts(facts, request)


def test_torchtitan_recipe_is_within_3_percent_of_torchtitans_policy_measured(small_result):
    facts, request, result = small_result
    recipes = {c.name: c for c in result.recipes}
    recipe = recipes["recipe: torchtitan selective-op AC"]
    assert recipe.selective_mm_stride == 2
    plan = to_plan(recipe, request, facts)
    assert plan.selective_mm_stride == 2 and plan.to_dict()["selective_mm_stride"] == 2
    # the plan's units without its checkpointing, and torchtitan's own AC applied first
    measured = measure_peak(load_model(SMALL), plan, torchtitan_policy_module(plan))
    predicted = recipe.memory.peak_bytes
    assert abs(predicted - measured.peak_bytes) <= 0.03 * measured.peak_bytes, (
        predicted, measured.peak_bytes)
    # saving every second matmul keeps more than full AC and less than no checkpointing
    assert (recipes["recipe: full AC every block"].memory.peak_bytes < predicted
            < recipes["recipe: torchtitan (unit per block)"].memory.peak_bytes)
    assert recipe.recompute_s > 0


def test_stride_one_and_two_passes_differ_in_what_they_keep(small_result):
    facts, _, _ = small_result
    one = facts.analysis
    two = one.with_selective_stride(2)
    assert two is not None and two.selective_mm_stride == 2
    assert two.selective_timeline is not one.selective_timeline
    peak = lambda a: max(e.level for e in a.selective_timeline.events)
    assert peak(two) < peak(one)
    assert sum(two.selective_recompute_flops.values()) > sum(
        one.selective_recompute_flops.values())
    assert one.with_selective_stride(3) is None


# --- the plan file ----------------------------------------------------------------------------

def _strided(plan: Plan, stride: int, version: int = 2) -> Plan:
    return dataclasses.replace(plan, fsdp_plan_version=version,
                               activation_checkpointing={"layers.0": "selective"},
                               selective_ops=list(DEFAULT_SELECTIVE_OPS),
                               selective_mm_stride=stride)


def test_stride_round_trips_and_is_written_only_when_not_one(tmp_path):
    plan = _strided(tiny_llama_plan(world=2), 2)
    again = read_plan(plan_file(tmp_path, plan))
    assert again.selective_mm_stride == 2
    keys = list(again.to_dict())
    assert keys.index("selective_mm_stride") == keys.index("selective_ops") + 1
    assert "selective_mm_stride" not in _strided(tiny_llama_plan(world=2), 1).to_dict()
    policy = load_policy_module(render_policy_module(plan))
    assert policy.PLAN["selective_mm_stride"] == 2


@pytest.mark.parametrize(("value", "version", "words"), [
    (0, 2, "outside 1..1024"), ("2", 2, "whole number"), (True, 2, "whole number"),
    (2, 1, "needs fsdp_plan_version: 2")])
def test_a_bad_stride_is_refused_with_the_field_named(tmp_path, value, version, words):
    raw = _strided(tiny_llama_plan(world=2), 2, version).to_dict()
    raw["selective_mm_stride"] = value
    if version == 1:  # to_dict writes the version its fields need: a version-1 file by hand
        raw["activation_checkpointing"] = ["layers.0"]
        raw["fsdp_plan_version"] = 1
    with pytest.raises(BadInput, match=f"selective_mm_stride.*{words}"):
        Plan.from_dict(raw)


def test_predict_needs_the_pass_at_the_plans_stride(small_result):
    facts, _, _ = small_result
    plan = dataclasses.replace(
        _strided(tiny_llama_plan(world=4), 3),
        model=dataclasses.replace(tiny_llama_plan().model, args={"size": "small"}))
    with pytest.raises(BadInput, match="selective_mm_stride"):
        predict(plan, facts)


def test_predict_command_analyses_at_the_plans_stride(tmp_path):
    import json
    base = _strided(tiny_llama_plan(world=2), 1)
    modes = {f"layers.{i}": "selective" for i in range(4)}
    peaks = {}
    for stride in (1, 2):
        plan = dataclasses.replace(base, activation_checkpointing=modes,
                                   selective_mm_stride=stride)
        code, out, err = run_cli(["predict", plan_file(tmp_path, plan, f"s{stride}.yaml"),
                                  "--format", "json"])
        assert code == 0, err
        peaks[stride] = json.loads(out)["predicted"]["peak_bytes"]
    assert peaks[2] < peaks[1]
