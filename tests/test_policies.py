"""The bundled policies in policies/ are what the planner writes today, and they load."""

from __future__ import annotations

import os
import subprocess
import sys

import yaml

from fsdp_plan.plan.emit import load_policy_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bundled_policies_are_current():
    result = subprocess.run([sys.executable, os.path.join(ROOT, "policies", "regenerate.py"), "--check"],
                            capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr


def test_bundled_policies_load_and_match_their_plan_files():
    folder = os.path.join(ROOT, "policies")
    names = [f[:-5] for f in os.listdir(folder) if f.endswith(".yaml")]
    assert names
    for name in names:
        module = load_policy_module(os.path.join(folder, f"{name}.py"))
        with open(os.path.join(folder, f"{name}.yaml")) as f:
            assert module.PLAN == yaml.safe_load(f)
        plan = module.PLAN
        assert plan["predicted"]["peak_bytes"] <= plan["budget_bytes"] - plan["headroom_bytes"]
