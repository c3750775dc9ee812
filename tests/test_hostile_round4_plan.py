"""Issue 31 (round 4): plan-validation defects, each replayed from its reproduction.

- S4-06: plans record ``gpus_per_node`` (SPEC 8); predict and export read it from the plan.
- S4-10: unknown keys are refused at every level, the closest known key named (one
  declaration of the plan's fields, plan/schema.py).
- S4-20: every verb reads a plan through the same validation; messages name the plan field.
- S4-05: what planning writes from a hardware file always reads back.
- S4-16: a Python ``PlanRequest`` is bounded as the plan it writes is.

Refusals keep the failure contract: exit 2, one paragraph, no traceback, nothing written.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from test_measure_helpers import LLAMA, run_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [LLAMA, "--model-arg", "size=tiny", "--seq-len", "32"]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def refused(argv: list[str], *words: str) -> str:
    """Run ``fsdp-plan ARGV``: exit 2, one paragraph naming ``words``, no traceback."""
    code, out, err = run_cli(argv)
    assert code == 2, (code, out, err)
    text = err.strip()
    assert "Traceback" not in err and "\n\n" not in text, err
    for word in words:
        assert word in text, (word, text)
    return text


@pytest.fixture(scope="module")
def hsdp_plan(tmp_path_factory) -> Path:
    """The tiny Llama planned for 2 nodes of 4 GPUs (HSDP 2 x 4)."""
    path = tmp_path_factory.mktemp("hsdp") / "plan.yaml"
    code, _, err = run_cli([*TINY, "--mem", "1GB", "--world-size", "8", "--gpus-per-node", "4",
                            "--strategy", "hybrid", "--plan", str(path), "--format", "json"])
    assert code == 0, err
    return path


# --- S4-06: plans record gpus_per_node --------------------------------------------------------

def test_s4_06_the_plan_records_gpus_per_node_and_predict_reads_it(hsdp_plan):
    import json

    doc = yaml.safe_load(hsdp_plan.read_text())
    assert doc["gpus_per_node"] == 4 and doc["mesh"] == {"replicate": 2, "shard": 4}
    assert list(doc).index("gpus_per_node") == list(doc).index("world_size") + 1
    code, out, err = run_cli(["predict", str(hsdp_plan), "--format", "json"])
    assert code == 0, err
    again = json.loads(out)["predicted"]
    # with no flag the plan is predicted for the nodes it was planned for: as planning said
    for key in ("peak_bytes", "step_time_s", "total_comm_s", "exposed_comm_s"):
        assert again[key] == doc["predicted"][key], key
    code, out, err = run_cli(["predict", str(hsdp_plan), "--format", "json",
                              "--gpus-per-node", "8"])
    assert code == 0, err  # the flag still overrides: one node, no traffic across nodes
    assert json.loads(out)["predicted"]["total_comm_s"] < doc["predicted"]["total_comm_s"]


def test_s4_06_export_lays_out_the_nodes_the_plan_was_made_for(hsdp_plan, tmp_path):
    code, _, err = run_cli(["export", str(hsdp_plan), "--to", "accelerate", "-o",
                            str(tmp_path / "acc")])
    assert code == 0, err
    config = yaml.safe_load((tmp_path / "acc" / "accelerate_config.yaml").read_text())
    assert (config["num_machines"], config["num_processes"]) == (2, 8)
    code, _, err = run_cli(["export", str(hsdp_plan), "--to", "lightning", "-o",
                            str(tmp_path / "light")])
    assert code == 0, err
    trainer = yaml.safe_load((tmp_path / "light" / "lightning_config.yaml").read_text())
    assert (trainer["trainer"]["num_nodes"], trainer["trainer"]["devices"]) == (2, 4)


def test_s4_06_a_plan_without_gpus_per_node_reads_as_before(hsdp_plan, tmp_path):
    from fsdp_plan.plan.document import Plan

    doc = yaml.safe_load(hsdp_plan.read_text())
    del doc["gpus_per_node"]
    assert Plan.from_dict(doc).node_gpus == 8
    doc["predicted"]["gpus_per_node"] = 4  # where predict looked before (issue 21, S3-04)
    assert Plan.from_dict(doc).node_gpus == 4


@pytest.mark.parametrize("value, words", [(0, ["gpus_per_node", "outside 1..1024"]),
                                          (3, ["gpus_per_node", "does not divide world_size 8"]),
                                          ("4", ["gpus_per_node", "whole number"])])
def test_s4_06_a_bad_gpus_per_node_is_refused_naming_the_field(hsdp_plan, tmp_path, value,
                                                               words):
    doc = yaml.safe_load(hsdp_plan.read_text())
    doc["gpus_per_node"] = value
    given = tmp_path / "plan.yaml"
    given.write_text(yaml.safe_dump(doc, sort_keys=False))
    before = snapshot(tmp_path)
    text = refused(["predict", str(given)], *words)
    assert "--gpus-per-node" not in text
    assert snapshot(tmp_path) == before
