"""``fsdp-plan emit PLAN.yaml -o POLICY.py`` (SPEC section 7): the policy of any valid plan
file, byte-identical to what planning writes for the same plan."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from fsdp_plan.cli.main import main
from fsdp_plan.plan.emit import load_policy_module

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ROOT / "policies"


@pytest.mark.parametrize("name", ["llama8b_h100x8", "vit_huge_h100x16"])
def test_emit_of_a_bundled_plan_is_the_bundled_policy_byte_for_byte(name: str, tmp_path: Path
                                                                     ) -> None:
    out = tmp_path / "policy.py"
    assert main(["emit", str(POLICIES / f"{name}.yaml"), "-o", str(out)]) == 0
    assert out.read_bytes() == (POLICIES / f"{name}.py").read_bytes()
    assert load_policy_module(str(out)).PLAN == yaml.safe_load(
        (POLICIES / f"{name}.yaml").read_text())


def test_a_hand_edited_plan_becomes_its_policy(tmp_path: Path) -> None:
    """Edit the plan as a user would (checkpoint two blocks): the policy holds the edit."""
    doc = yaml.safe_load((POLICIES / "llama8b_h100x8.yaml").read_text())
    assert doc["activation_checkpointing"] == []
    doc["activation_checkpointing"] = ["layers.0", "layers.1"]
    plan = tmp_path / "edited.yaml"
    plan.write_text(yaml.safe_dump(doc, sort_keys=False))
    out = tmp_path / "edited.py"
    assert main(["emit", str(plan), "-o", str(out)]) == 0
    policy = load_policy_module(str(out))
    assert policy.PLAN == doc
    assert policy.checkpoint_modes() == {"layers.0": "full", "layers.1": "full"}


def test_an_invalid_plan_exits_2_and_writes_nothing(tmp_path: Path, capsys) -> None:
    doc = yaml.safe_load((POLICIES / "llama8b_h100x8.yaml").read_text())
    doc["units"][0]["modules"] = []
    plan = tmp_path / "bad.yaml"
    plan.write_text(yaml.safe_dump(doc, sort_keys=False))
    out = tmp_path / "policy.py"
    out.write_text("# the user's earlier policy\n")
    assert main(["emit", str(plan), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "bad.yaml" in err
    assert out.read_text() == "# the user's earlier policy\n"
    assert sorted(os.listdir(tmp_path)) == ["bad.yaml", "policy.py"]


def test_the_output_may_not_be_the_plan(tmp_path: Path, capsys) -> None:
    plan = tmp_path / "p.yaml"
    plan.write_bytes((POLICIES / "llama8b_h100x8.yaml").read_bytes())
    assert main(["emit", str(plan), "-o", str(plan)]) == 2
    assert "replace an input" in capsys.readouterr().err
    assert plan.read_bytes() == (POLICIES / "llama8b_h100x8.yaml").read_bytes()
