"""``fsdp-plan bench`` on CPU: real gloo workers, result files, faults and ``--compare``."""

from __future__ import annotations

import argparse
import copy
import glob
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from cli_checks import refused
from test_measure_helpers import ROOT, plan_file, run_cli, tiny_llama_plan

from fsdp_plan.bench import results, session
from fsdp_plan.cli.bench import add_run_arguments, bench_request
from fsdp_plan.common.errors import CheckFailed

PREDICTED = {"collectives_per_step": {"all_gather": 9, "reduce_scatter": 5, "all_reduce": 0},
             "peak_bytes": 4_000_000, "step_time_s": 0.05, "exposed_comm_s": 0.001}
FAST = ["--nproc", "2", "--steps", "3", "--warmup", "1"]


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    """One real run on two gloo workers: (exit code, stdout, stderr, out folder, plan path)."""
    folder = tmp_path_factory.mktemp("bench")
    plan = plan_file(folder, tiny_llama_plan(world=2, predicted=PREDICTED))
    out = str(folder / "results")
    private_tmp = folder / "tmp"
    private_tmp.mkdir()
    # A real process, so that what workers write to file descriptors 1 and 2 is seen too.
    done = subprocess.run([sys.executable, "-m", "fsdp_plan.cli.main", "bench", plan, *FAST,
                           "--out", out, "--timeout", "120"], check=False, capture_output=True,
                          text=True, timeout=600, cwd=ROOT,
                          env={**os.environ, "TMPDIR": str(private_tmp)})
    assert list(private_tmp.iterdir()) == []  # worker and trace folders removed
    return done.returncode, done.stdout, done.stderr, out, plan


def _only_result(out: str) -> str:
    files = [f for f in glob.glob(os.path.join(out, "*.json")) if not f.endswith(".trace.json")]
    assert len(files) == 1, files
    return files[0]


@pytest.mark.slow
def test_bench_on_two_cpu_ranks_writes_a_result_matching_the_plan(bench_run):
    code, stdout, stderr, out, _ = bench_run
    assert code == 0, stderr
    assert "step 6/6 (profile)" in stderr  # progress: 1 warm-up + count + 3 timed + profile
    assert "USDT" not in stderr and "Traceback" not in stderr, stderr  # no profiler chatter
    assert "Failed to initialize NumPy" not in stderr
    with open(_only_result(out)) as f:
        result = json.load(f)
    assert result["collectives"]["measured"] == PREDICTED["collectives_per_step"]
    assert result["collectives"]["ranks_agree"]
    assert result["run"]["nproc"] == 2 and result["run"]["torch"] and result["run"]["device_name"]
    assert len(result["plan"]["hash"]) == 16 and "commit" in result["run"]["git"]
    assert [len(r["steps_s"]) for r in result["step_time"]["per_rank"]] == [3, 3]
    assert result["step_time"]["median_s"] > 0 and result["step_time"]["slowest_rank"] in (0, 1)
    assert result["memory"]["peak_bytes"] > 0 and "FSDPMemTracker" in result["memory"]["source"]
    # Every gloo collective of the profiled step is one gloo:* event: 9 + 5.
    assert result["comm"]["rank0"]["num_comm_events"] == 14
    comm = result["comm"]["rank0"]
    assert comm["hidden_s"] + comm["exposed_s"] == pytest.approx(comm["comm_s"])
    with open(os.path.join(out, result["trace"])) as f:
        assert json.load(f)["traceEvents"]
    assert "all_gather" in stdout and "exposed" in stdout


def _file_state(path: str) -> tuple[str, float]:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest(), os.path.getmtime(path)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["crash", "hang"])
def test_a_failing_worker_is_named_and_earlier_results_survive(tmp_path, monkeypatch, fault):
    out = tmp_path / "results"
    out.mkdir()
    earlier = out / "earlier.json"
    earlier.write_text('{"fsdp_plan_bench_version": 1, "kept": true}\n')
    before = _file_state(str(earlier))
    monkeypatch.setenv("FSDP_PLAN_BENCH_FAULT", f"{fault}:rank=1:step=3")
    plan = plan_file(tmp_path, tiny_llama_plan(world=2, predicted=PREDICTED))
    started = time.monotonic()
    code, _, err = run_cli(["bench", plan, *FAST, "--out", str(out), "--timeout", "12"])
    assert code == 1
    if fault == "crash":
        assert "rank 1 failed (last progress: count 2/6)" in err
        assert "RuntimeError: injected fault: rank 1 crashed at step 3" in err
    else:
        assert "rank 1 hung: no progress for 12 s" in err and "maybe_inject_fault" in err
        assert time.monotonic() - started < 90
    assert "All workers were killed" in err
    assert _file_state(str(earlier)) == before
    assert sorted(os.listdir(out)) == ["earlier.json"]


def _slower(result: dict, factor: float) -> dict:
    new = copy.deepcopy(result)
    for key in ("median_s", "p99_s"):
        new["step_time"][key] *= factor
    return new


def test_compare_flags_a_slower_step_and_changed_counts(bench_run):
    old = results.read_result(_only_result(bench_run[3]))
    table, problems = results.compare(old, _slower(old, 1.5), threshold=0.10)
    # the real run's few steps give no quartiles: each run's spread counts as 10%
    assert problems == ["step time median regressed +50.0% (threshold 10%, noise ±20%)"]
    assert "REGRESSED" in table and "step time median" in table
    changed = copy.deepcopy(old)
    changed["collectives"]["measured"]["all_gather"] += 1
    table, problems = results.compare(old, changed, threshold=0.10)
    assert problems == ["all_gather per step changed from 9 to 10"] and "CHANGED" in table
    assert results.compare(old, _slower(old, 1.05), threshold=0.10)[1] == []


def test_bench_exits_non_zero_when_compare_finds_a_regression(bench_run, tmp_path, capsys,
                                                              request):
    """The session's last stage on the real run's figures, against an older, faster result."""
    _, _, _, out, plan = bench_run
    with open(_only_result(out)) as f:
        real = json.load(f)
    ranks = [{"rank": r["rank"], "counts": real["collectives"]["measured"],
              "step_times_s": r["steps_s"], "peak_bytes": real["memory"]["peak_bytes"],
              "comm": real["comm"]["rank0"], "trace": None, "device": "cpu"}
             for r in real["step_time"]["per_rank"]]
    old_path = tmp_path / "old.json"
    old_path.write_text(json.dumps(_slower(real, 1 / 1.5)))
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    args = parser.parse_args([plan, "--out", str(tmp_path / "new"), "--compare", str(old_path)])
    prepared = session.prepare(bench_request(args), nproc=2)
    request.addfinalizer(lambda: shutil.rmtree(prepared.payload["trace_dir"]))
    with pytest.raises(CheckFailed, match=r"step time median regressed \+50\.0%"):
        session.finish(prepared, ranks)
    assert "REGRESSED" in capsys.readouterr().out
    assert len(glob.glob(str(tmp_path / "new" / "*.json"))) == 1  # the run is still recorded
    old_path.write_text(json.dumps(real))
    again = session.prepare(bench_request(args), nproc=2)
    request.addfinalizer(lambda: shutil.rmtree(again.payload["trace_dir"]))
    assert session.finish(again, ranks) == 0


def test_side_by_side_trace_starts_both_timelines_at_zero():
    predicted = {"traceEvents": [{"name": "FW layers.0", "ph": "X", "pid": 0, "tid": 1,
                                  "ts": 0.0, "dur": 5.0}]}
    measured = {"traceEvents": [
        {"name": "aten::mm", "ph": "X", "pid": 42, "tid": 1, "ts": 1000.0, "dur": 3.0},
        {"name": "fsdp_plan.step", "ph": "X", "pid": 42, "tid": 1, "ts": 990.0, "dur": 20.0}]}
    merged = results.side_by_side_trace(predicted, measured)["traceEvents"]
    spans = {(e["pid"], e["name"]): e["ts"] for e in merged if e["ph"] == "X"}
    assert spans == {("predicted", "FW layers.0"): 0.0, ("measured 42", "aten::mm"): 10.0,
                     ("measured 42", "fsdp_plan.step"): 0.0}
    assert any(e["ph"] == "M" and e["pid"] == "predicted" for e in merged)


@pytest.mark.slow
def test_bench_runs_a_compiled_plan_with_exact_counts(tmp_path):
    """A plan with compiled blocks (issue 22) is benched with its blocks compiled by inductor
    on two gloo ranks: the collective counts equal the plan's prediction and the result says
    how many compiled graphs the steps ran."""
    from fsdp_plan.cli.main import main
    plan = str(tmp_path / "plan.yaml")
    assert main([os.path.join(ROOT, "examples", "llama.py"), "--model-arg", "size=tiny",
                 "--seq-len", "64", "--batch-size", "2", "--mem", "1GB", "--world-size", "2",
                 "--strategy", "full", "--compile", "--plan", plan]) == 0
    out = str(tmp_path / "results")
    done = subprocess.run([sys.executable, "-m", "fsdp_plan.cli.main", "bench", plan, *FAST,
                           "--out", out, "--timeout", "400"], check=False, capture_output=True,
                          text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    with open(_only_result(out)) as f:
        result = json.load(f)
    assert result["collectives"]["measured"] == result["collectives"]["predicted"]
    assert result["collectives"]["measured"]["all_gather"] > 0
    assert result["compiled_graphs"] >= 1  # one AOTAutograd compilation per block class
    assert "compiled blocks:" in done.stdout


def test_bench_fsdp1_refuses_a_compiled_plan(tmp_path, capsys):
    """``bench --fsdp1`` on a plan made with ``--compile`` is refused before any worker starts
    (exit 2, one paragraph saying what to run instead, nothing written), instead of silently
    benching the plan's blocks eager under FSDP1."""
    from fsdp_plan.cli.main import main
    plan = str(tmp_path / "plan.yaml")
    assert main([os.path.join(ROOT, "examples", "llama.py"), "--model-arg", "size=tiny",
                 "--seq-len", "64", "--batch-size", "2", "--mem", "1GB", "--world-size", "2",
                 "--strategy", "full", "--compile", "--plan", plan, "--format", "json"]) == 0
    capsys.readouterr()
    out = tmp_path / "results"
    refused(capsys, ["bench", plan, "--fsdp1", *FAST, "--out", str(out)],
            "planned with --compile", "without --fsdp1", "without --compile")
    assert not out.exists() or not os.listdir(out)
