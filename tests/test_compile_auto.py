"""``--compile auto`` (issue 22): eager and compiled planned on one analysis, the better kept,
and the report says what compile buys."""

from __future__ import annotations

import json
import os

from fsdp_plan.cli.main import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA = os.path.join(ROOT, "examples", "llama.py")
ARGS = ["--model-arg", "size=tiny", "--seq-len", "256", "--batch-size", "2", "--mem", "1GB",
        "--world-size", "8", "--format", "json"]


def _run(capsys, *extra: str) -> dict:
    assert main([LLAMA, *ARGS, *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_compile_auto_keeps_the_faster_of_eager_and_compiled(capsys):
    eager = _run(capsys)["plan"]
    compiled = _run(capsys, "--compile")["plan"]
    auto = _run(capsys, "--compile", "auto")
    step = {"eager": eager["predicted"]["step_time_s"],
            "compiled": compiled["predicted"]["step_time_s"]}
    assert step["eager"] != step["compiled"]
    faster = min(step, key=step.get)
    why = auto["reasons"][0]
    assert why.startswith("compile: compiled blocks step ") and why.endswith(f"kept {faster}")
    assert f"{step['eager']:.4g} s" in why and f"{step['compiled']:.4g} s" in why
    assert auto["plan"]["predicted"]["step_time_s"] == step[faster]
    assert (auto["plan"].get("compile") is not None) == (faster == "compiled")


def test_compile_before_the_model_file_is_still_the_flag(capsys):
    """A bare ``--compile`` followed by MODEL reads as before ``auto`` existed."""
    assert main(["--compile", LLAMA, *ARGS]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["compile"]["blocks"] is True
    assert main([LLAMA, "--compile", "sometimes", *ARGS]) == 2
    assert "--compile auto" in capsys.readouterr().err
