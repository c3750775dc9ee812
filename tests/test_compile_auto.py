"""``--compile auto`` (issue 22): eager and compiled planned on one analysis, the better kept,
and the report says what compile buys."""

from __future__ import annotations

import json
import os

from cli_checks import refused

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


def test_compile_auto_frontier_weighs_eager_and_compiled_at_every_budget():
    """The frontier of a ``--compile auto`` plan (the report's "more memory" line, the HTML
    page) takes at each budget the faster of the eager and the compiled best, as the plan
    itself did, and says which; before, it searched compiled blocks only."""
    from fsdp_plan.api import make_plan
    from fsdp_plan.cli.plan import plan_frontier
    from fsdp_plan.model.source import ModelSource
    from fsdp_plan.search.request import PlanRequest, SearchOptions

    def planned(**compile_args):
        request = PlanRequest(source=ModelSource(source=LLAMA, args={"size": "tiny"},
                                                 batch_size=2, seq_len=256),
                              budget_bytes=10**9, world_size=8, **compile_args)
        result = make_plan(request)
        return result, plan_frontier(result, request, above_only=False)

    auto, auto_frontier = planned(compile_blocks=True, search=SearchOptions(compile_auto=True))
    _, eager = planned()
    _, compiled = planned(compile_blocks=True)
    here = auto_frontier.at_user_budget
    assert here.compiled == (auto.plan.compile is not None)
    assert here.step_s == auto.best.time.step_s
    steps = {name: {p.budget_bytes: p for p in f.points if p.fits}
             for name, f in (("eager", eager), ("compiled", compiled))}
    assert {p.compiled for p in compiled.points if p.fits} == {True}
    assert {p.compiled for p in eager.points if p.fits} == {False}
    compared = 0
    for point in auto_frontier.points:
        if point.budget_bytes in steps["eager"] and point.budget_bytes in steps["compiled"]:
            e, c = steps["eager"][point.budget_bytes], steps["compiled"][point.budget_bytes]
            assert point.step_s == min(e.step_s, c.step_s)
            assert point.compiled == (c.tokens_per_s > e.tokens_per_s)
            compared += 1
    assert compared >= 2


def test_compile_auto_with_a_framework(capsys):
    """``--compile auto --framework``: Lightning's configuration says no unit (the policy
    applies the plan), so both are weighed and the report says which was kept; a framework
    whose configuration cannot say compiled blocks is refused with what to do instead."""
    out = _run(capsys, "--compile", "auto", "--framework", "lightning")
    assert out["reasons"][0].startswith("compile: compiled blocks step ")
    refused(capsys, [LLAMA, *ARGS, "--compile", "auto", "--framework", "torchtitan"],
            "cannot say compiled blocks", "without --compile")
