"""``fsdp-plan verify``: exit 0 when the measured peak matches the prediction and fits, 1 when not."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from test_measure_helpers import plan_file, run_cli, tiny_llama_plan

from fsdp_plan.measure import runtime
from fsdp_plan.measure.memory import measure_peak
from fsdp_plan.plan.document import Mesh, Plan, Unit


@pytest.fixture(scope="module")
def measured_peak() -> int:
    plan = tiny_llama_plan(world=4)
    loaded = runtime.load_planned_model(plan)
    return measure_peak(loaded, plan, runtime.load_policy(runtime.policy_source(plan))).peak_bytes


def test_prediction_equal_to_the_measurement_passes(tmp_path, measured_peak):
    plan = tiny_llama_plan(world=4, predicted={
        "peak_bytes": measured_peak,
        "breakdown": {"sharded_params": 262_720, "activations": 1},
        "units": [{"key": "layers.0", "param_bytes": 197_120}]})
    plan.model = replace(plan.model, params=262_720)
    code, out, err = run_cli(["verify", plan_file(tmp_path, plan), "--format", "json"])
    assert code == 0, err
    data = json.loads(out)
    assert data["ok"] and data["measured_peak_bytes"] == measured_peak
    assert data["relative_error"] == 0
    components = {c["component"]: c for c in data["components"]}
    assert components["sharded_params"]["measured_bytes"] == 262_720
    assert components["sharded_params"]["predicted_bytes"] == 262_720
    assert data["units"][0]["predicted"] == {"param_bytes": 197_120}


def test_prediction_off_by_more_than_the_tolerance_fails(tmp_path, measured_peak):
    plan = tiny_llama_plan(world=4, predicted={"peak_bytes": int(measured_peak * 0.9)})
    code, out, err = run_cli(["verify", plan_file(tmp_path, plan)])
    assert code == 1
    assert "differs from the predicted" in err and "11.1%" not in err  # |m - p| / m = 10.0%
    assert "10.0%" in err
    assert "sharded_params" in out and "GiB" in out and "layers.3" in out
    # The same plan passes with a looser tolerance.
    code, _, err = run_cli(["verify", plan_file(tmp_path, plan), "--tolerance", "0.11"])
    assert code == 0, err


def test_measured_peak_over_budget_fails(tmp_path, measured_peak):
    plan = tiny_llama_plan(world=4, predicted={"peak_bytes": measured_peak})
    plan.budget_bytes, plan.headroom_bytes = measured_peak + 1000, 1001
    code, _, err = run_cli(["verify", plan_file(tmp_path, plan)])
    assert code == 1 and "exceeds budget - headroom" in err


def test_a_different_model_is_refused_before_measuring(tmp_path):
    plan = tiny_llama_plan(world=4)
    plan.model = replace(plan.model, params=12345)
    code, _, err = run_cli(["verify", plan_file(tmp_path, plan)])
    assert code == 2 and "262,720 parameters" in err and "12,345" in err


MISMATCHED_MODEL = """
import torch
from torch import nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.register_buffer("offset", torch.zeros(16))   # float32, never cast
        self.shared_proj = nn.Linear(16, 16)

    def forward(self, tokens):
        return self.shared_proj(self.embed(tokens) + self.offset)


def build_model():
    return Model()
"""


def test_a_dtype_mismatch_that_only_a_real_device_refuses_fails_the_dry_run(tmp_path):
    """A model adds a float32 buffer to its activations; under bfloat16 mixed precision nothing
    casts them back, and a real run stops in shared_proj's addmm. Fake kernels accept it."""
    model_file = tmp_path / "mismatched.py"
    model_file.write_text(MISMATCHED_MODEL)
    plan = Plan(model={"source": str(model_file), "entry": "build_model", "args": {},
                       "batch_size": 2, "seq_len": 16, "kind": "file"},
                budget_bytes=10**9, world_size=2, mesh=Mesh(replicate=1, shard=2),
                units=[Unit(modules=[""], reshard_after_forward=False)],
                mixed_precision={"param_dtype": "bfloat16", "reduce_dtype": "float32"})
    code, _, err = run_cli(["verify", plan_file(tmp_path, plan)])
    assert code == 1
    assert "a real device would refuse this step: aten::addmm got bfloat16 and float32 in " \
           "'shared_proj'" in err
