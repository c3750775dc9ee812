"""``fsdp-plan trace`` on the trace ``fsdp-plan bench`` wrote: one definition of every figure
(bench's comm and phase figures are the trace verb's, to the last digit), and ``trace
--refit HW.yaml --plan P.yaml`` then ``predict --hardware HW.yaml`` predicts the measured
step closer than the plan did. A real planned tiny Llama on two gloo ranks."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
from test_measure_helpers import ROOT

from fsdp_plan.cli.main import main

FAST = ["--nproc", "2", "--steps", "3", "--warmup", "1"]


@pytest.fixture(scope="module")
def benched(tmp_path_factory):
    """(plan path, bench result, the trace file bench wrote) of one real run."""
    folder = tmp_path_factory.mktemp("trace_bench")
    plan = str(folder / "plan.yaml")
    assert main([os.path.join(ROOT, "examples", "llama.py"), "--model-arg", "size=tiny",
                 "--seq-len", "64", "--batch-size", "2", "--mem", "1GB", "--world-size", "2",
                 "--strategy", "full", "--plan", plan, "-o", str(folder / "policy.py")]) == 0
    out = str(folder / "results")
    done = subprocess.run([sys.executable, "-m", "fsdp_plan.cli.main", "bench", plan, *FAST,
                           "--out", out, "--timeout", "300"], check=False, capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    (path,) = [f for f in glob.glob(os.path.join(out, "*.json"))
               if not f.endswith(".trace.json")]
    with open(path) as f:
        result = json.load(f)
    return plan, result, os.path.join(out, result["trace"])


def _trace_doc(capsys, *args) -> dict:
    code = main(["trace", *map(str, args), "--format", "json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


BENCH_NAMES = {"step_s": "step_s", "comm_s": "comm_s", "hidden_s": "hidden_comm_s",
               "exposed_s": "exposed_comm_s", "tail_exposed_s": "comm_tail_s",
               "overlap_slowdown_s": "overlap_slowdown_s",
               "exposed_delaying_compute_s": "exposed_delaying_compute_s"}
PHASE_NAMES = {"forward": "forward_s", "backward": "backward_s", "optimizer": "optimizer_s",
               "tail": "comm_tail_s", "idle": "idle_s", "step_s": "step_s"}


@pytest.mark.slow
def test_bench_and_trace_report_the_same_figures(benched, capsys):
    _, result, trace = benched
    doc = _trace_doc(capsys, trace)
    (rank,) = doc["ranks"]
    assert rank["rank"] == 0 and rank["world_size"] == 2 and rank["device"] == "cpu"
    assert [s["step"] for s in rank["steps"]] == [2, 3]  # 3 profiled: the first dropped
    comm = result["comm"]["rank0"]
    step = next(s for s in rank["steps"] if s["step"] == comm["step"])
    assert {k: comm[k] for k in BENCH_NAMES} == {k: step[v] for k, v in BENCH_NAMES.items()}
    profiled = result["step_time"]["phases"]["profiled"]
    assert profiled["step"] == comm["step"]
    assert {k: profiled[k] for k in PHASE_NAMES} == {k: step[v] for k, v in PHASE_NAMES.items()}
    assert comm["exposed_s"] > 0 and profiled["forward"] > 0 and profiled["backward"] > 0
    # the phases tile the step, and bench's shares of the median step keep their proportions
    assert sum(profiled[k] for k in ("forward", "backward", "optimizer", "tail", "idle")) == \
        pytest.approx(profiled["step_s"], abs=1e-8)
    measured = result["step_time"]["phases"]["measured"]
    assert sum(measured.values()) == pytest.approx(result["step_time"]["median_s"], rel=1e-6)
    # the plan's 1 all-gather and 1 reduce-scatter per step, counted in the trace's median step
    assert comm["num_comm_events"] == 2 == sum(result["collectives"]["measured"].values())


def _predicted(capsys, plan: str, *hardware: str) -> dict:
    code = main(["predict", plan, *hardware, "--format", "json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)["predicted"]


@pytest.mark.slow
def test_refit_then_hardware_moves_the_prediction_to_the_measurement(benched, capsys,
                                                                     tmp_path):
    """[Note: compute refit from a trace] (bench/trace_refit.py): the plan was predicted for
    an H100; the CPU run's trace refits its compute, optimizer and collectives."""
    plan, result, trace = benched
    rank = _trace_doc(capsys, trace)["ranks"][0]
    measured = rank["step_s_p50"]
    median = next(s for s in rank["steps"] if s["step"] == result["comm"]["rank0"]["step"])
    before = _predicted(capsys, plan)
    hw = tmp_path / "hw.yaml"
    code = main(["trace", trace, "--refit", str(hw), "--plan", plan])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"wrote {hw}" in out
    after = _predicted(capsys, plan, "--hardware", str(hw))
    compute = median["step_s"] - median["exposed_comm_s"] - median["optimizer_s"]
    print(f"measured stable-step median {measured * 1e3:.2f} ms (bench's unprofiled median "
          f"{result['step_time']['median_s'] * 1e3:.2f} ms), compute {compute * 1e3:.2f} ms, "
          f"comm {median['comm_s'] * 1e3:.2f} ms, optimizer {median['optimizer_s'] * 1e3:.2f} "
          f"ms; predicted step {before['step_time_s'] * 1e3:.3f} ms before the refit, "
          f"{after['step_time_s'] * 1e3:.3f} ms after; compute {before['compute_s'] * 1e3:.3f}"
          f" -> {after['compute_s'] * 1e3:.3f} ms; comm {before['total_comm_s'] * 1e3:.3f} -> "
          f"{after['total_comm_s'] * 1e3:.3f} ms; optimizer "
          f"{before['phases_s']['optimizer'] * 1e3:.3f} -> "
          f"{after['phases_s']['optimizer'] * 1e3:.3f} ms")
    def error(p: dict) -> float:
        return abs(p["step_time_s"] - measured)
    assert error(after) < error(before) and error(after) < 0.5 * measured
    # each figure the refit changes moved toward its measurement
    for name, target in (("compute_s", compute), ("total_comm_s", median["comm_s"]),
                         ("optimizer", median["optimizer_s"])):
        was, now = ((p["phases_s"][name] if name == "optimizer" else p[name])
                    for p in (before, after))
        assert abs(now - target) < abs(was - target), name
    # the compute side is matched: rescaled until the plan predicted on the file computes as
    # long as the trace did
    assert after["compute_s"] == pytest.approx(compute, rel=0.03)
    assert after["phases_s"]["optimizer"] == pytest.approx(median["optimizer_s"], rel=0.03)
    from fsdp_plan.cost.hardware import hardware_for, read_hardware_file
    refit = hardware_for("h100", read_hardware_file(str(hw)))
    assert "compute x" in refit.source and "all_gather over 2 ranks" in refit.source
    assert "round(s) of predicting the plan" in refit.source
