"""The plan command's outputs: report, JSON, trace, policy module and plan file agree."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import yaml

from fsdp_plan.cli.main import main
from fsdp_plan.plan.emit import load_policy_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA = os.path.join(ROOT, "examples", "llama.py")
ARGS = [LLAMA, "--model-arg", "size=tiny", "--seq-len", "64", "--batch-size", "2", "--mem", "3MB",
        "--world-size", "8"]


def test_table_report_shows_totals_choice_and_timeline(capsys):
    assert main(ARGS) == 0
    out = capsys.readouterr().out
    assert "262,720" in out  # exact parameter count
    assert "MB (" in out and "MiB)" in out  # decimal and binary units
    assert "recipe: torchtitan" in out and "chosen:" in out
    assert "compute |" in out and "comm    |" in out


def test_json_trace_policy_and_plan_agree(tmp_path, capsys):
    trace, plan_path, policy = tmp_path / "t.json", tmp_path / "p.yaml", tmp_path / "p.py"
    assert main([*ARGS, "--format", "json", "--trace", str(trace), "--plan", str(plan_path),
                 "-o", str(policy)]) == 0
    report = json.loads(capsys.readouterr().out)
    plan = yaml.safe_load(plan_path.read_text())
    assert report["plan"] == plan
    assert load_policy_module(str(policy)).PLAN == plan
    assert plan["model"]["params"] == 262720
    assert plan["units"][-1]["modules"] == [""]
    events = json.loads(trace.read_text())["traceEvents"]
    lanes = {e["tid"] for e in events if e["ph"] == "X"}
    # compute, communication, waits when any, and the host issuing the device's work (a GPU's
    # host runs ahead on its own timeline: [Note: the host floor] in cost/streams.py)
    assert {1, 2} <= lanes <= {1, 2, 3, 4}
    assert any(e["tid"] == 4 and e["name"].startswith("issue ") for e in events)
    assert any(e["name"].startswith("AG ") for e in events)
    assert report["candidates"][0]["peak_bytes"] == plan["predicted"]["peak_bytes"]


def test_help_exits_zero(capsys):
    assert main(["--help"]) == 0
    assert "--mem" in capsys.readouterr().out


def test_verify_flag_measures_before_writing(tmp_path, capsys):
    plan_path = tmp_path / "p.yaml"
    assert main([*ARGS, "--verify", "--plan", str(plan_path)]) == 0
    assert "FSDPMemTracker measured" in capsys.readouterr().err
    plan = yaml.safe_load(plan_path.read_text())
    measured, predicted = plan["predicted"]["measured_peak_bytes"], plan["predicted"]["peak_bytes"]
    assert abs(predicted - measured) / measured <= 0.05


def test_a_failed_write_leaves_no_output_and_no_traceback(tmp_path, capsys, monkeypatch):
    """Disk full while writing the second output: nothing is renamed into place, the existing
    plan file is untouched, no temporary is left, and the message has no traceback."""
    import fsdp_plan.common.files as plan_module
    plan_path, policy = tmp_path / "p.yaml", tmp_path / "p.py"
    plan_path.write_text("keep me\n")
    real_fsync = plan_module.os.fsync
    calls = []

    def failing_fsync(fd):
        calls.append(fd)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(plan_module.os, "fsync", failing_fsync)
    code = main([*ARGS, "--plan", str(plan_path), "-o", str(policy)])
    assert code == 2
    err = capsys.readouterr().err
    assert "disk is full" in err and str(plan_path) in err and "Traceback" not in err
    assert plan_path.read_text() == "keep me\n"
    assert [p.name for p in tmp_path.iterdir()] == ["p.yaml"]


_WALKED = """
import gc, json, sys
walked = []
def count(phase, info):  # the objects each collection of the young generations walks
    if phase == "start" and info["generation"] == 1:
        walked.append(len(gc.get_objects(0)) + len(gc.get_objects(1)))
gc.callbacks.append(count)
from fsdp_plan.facts.analyze import analyze_model
from fsdp_plan.model.source import ModelSource
analyze_model(ModelSource(source=sys.argv[1], args={"size": "tiny"}, seq_len=64))
gc.callbacks.remove(count)
print(json.dumps({"walked": max(walked), "tracked": len(gc.get_objects()),
                  "frozen": gc.get_freeze_count()}))
"""


def test_tracing_collects_only_what_its_passes_made():
    """[Note: pausing the cycle collector]: in a process that imports torch to trace,
    ``analyze_model`` freezes what is alive once torch is imported, so the one collection at
    the end of its pause walks the passes' objects, not every torch module (0.31 s of the 70B
    shape's make_plan), and nothing stays frozen. (Before: 542,000 objects walked of 305,000
    left; now about 95,000 of 465,000.)"""
    done = subprocess.run([sys.executable, "-c", _WALKED, LLAMA], capture_output=True,
                          text=True, check=True, env={**os.environ, "FSDP_PLAN_NO_CACHE": "1"})
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["frozen"] == 0
    assert seen["walked"] < seen["tracked"] / 3, seen


def test_the_plan_verb_leaves_the_collector_off_only_where_the_process_ends(monkeypatch,
                                                                           capsys):
    """[Note: ending the process]: in the console script's process (``entry``), which ends
    with ``os._exit`` once the command returns, the plan verb leaves the cycle collector off
    (on again, its first collection walked everything the run made: 0.4 s of README's first
    command); a command run in process (``main()``) turns it on again, as it was."""
    import gc

    from fsdp_plan.cli import process

    argv = [LLAMA, "--model-arg", "size=tiny", "--seq-len", "64", "--mem", "3MB",
            "--world-size", "4", "--format", "json"]
    assert gc.isenabled()
    assert main(argv) == 0
    assert gc.isenabled()
    monkeypatch.setattr(process, "_ENDS_AFTER_COMMAND", [True])
    try:
        assert main(argv) == 0
        assert not gc.isenabled()
    finally:
        gc.enable()
    capsys.readouterr()
