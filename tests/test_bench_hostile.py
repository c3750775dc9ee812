"""``fsdp-plan bench`` under hostile input and signals (issue 9 items 3, 5, 6, 11, 16).

Every input is checked before a worker starts: a refused run exits 2 with one paragraph,
starts no worker, creates no folder and leaves no temporary file. Signals end the workers
and remove the temporaries. The fast tests replace ``launch`` (the only thing that starts
workers) with a stand-in; the slow ones send real signals to a real ``fsdp-plan bench``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest
from test_measure_helpers import ROOT, plan_file, run_cli, tiny_llama_plan

import fsdp_plan.cli.bench as bench_cli
from fsdp_plan.bench import results
from fsdp_plan.measure.launch import Terminated, stop_on_signals

PREDICTED = {"collectives_per_step": {"all_gather": 9, "reduce_scatter": 5, "all_reduce": 0},
             "peak_bytes": 4_000_000, "step_time_s": 0.05, "exposed_comm_s": 0.001}
COUNTS = PREDICTED["collectives_per_step"]


def complete_result() -> dict:
    """The smallest result document ``--compare`` accepts."""
    return {"fsdp_plan_bench_version": 1, "plan": {"hash": "0123456789abcdef"}, "run": {},
            "collectives": {"measured": dict(COUNTS)},
            "step_time": {"median_s": 0.01, "p99_s": 0.01},
            "memory": {"peak_bytes": 1000}, "comm": {"rank0": {"exposed_s": 0.0}}}


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> str:
    return plan_file(tmp_path_factory.mktemp("plan"), tiny_llama_plan(world=2,
                                                                      predicted=PREDICTED))


@pytest.fixture
def private_tmp(tmp_path, monkeypatch) -> Path:
    """The folder ``tempfile`` uses in this test: it must be empty when bench returns."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


class FakeLaunch:
    """Stands in for ``launch``: records the call and answers like two healthy ranks."""

    def __init__(self, out: str | None = None, action=None) -> None:
        self.calls = 0
        self.out = out
        self.action = action
        self.out_existed_at_launch: bool | None = None

    def __call__(self, target, payload, *, nproc, timeout_s, on_progress=None):
        self.calls += 1
        if self.out is not None:
            self.out_existed_at_launch = os.path.exists(self.out)
        if self.action is not None:
            self.action()
        trace = os.path.join(payload["trace_dir"], "rank0.trace.json")
        Path(trace).write_text(json.dumps({"traceEvents": [
            {"name": "fsdp_plan.step", "ph": "X", "pid": 1, "tid": 1, "ts": 100.0, "dur": 50.0}]}))
        ranks = [{"rank": r, "counts": dict(COUNTS), "step_times_s": [0.01, 0.01],
                  "peak_bytes": 1000, "comm": {"exposed_s": 0.0}, "trace": trace,
                  "device": "cpu"} for r in range(nproc)]
        return [{"ranks": ranks}] + [{"rank": r} for r in range(1, nproc)]


def refused(monkeypatch, argv: list[str], *needles: str) -> str:
    """Run ``fsdp-plan bench ARGV``: exit 2, every needle in the one-paragraph message, no
    traceback, and no worker launched."""
    fake = FakeLaunch()
    monkeypatch.setattr(bench_cli, "launch", fake)
    code, out, err = run_cli(["bench", *argv])
    assert code == 2, err
    assert "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    assert fake.calls == 0
    assert out == ""
    return err


# --- numbers (issue 9.11) -------------------------------------------------------------------

@pytest.mark.parametrize("flags, needle", [
    (["--timeout", "nan"], "--timeout"), (["--timeout", "inf"], "--timeout"),
    (["--timeout", "-inf"], "--timeout"), (["--timeout", "-1"], "--timeout"),
    (["--timeout", "0"], "--timeout"),
    (["--steps", "0"], "--steps"), (["--steps", "-3"], "--steps"),
    (["--steps", "100001"], "--steps"), (["--warmup", "-1"], "--warmup"),
    (["--nproc", "0"], "--nproc"), (["--nproc", "-2"], "--nproc"),
    (["--nproc", "100000"], "--nproc"),
    (["--threshold", "nan"], "--threshold"), (["--threshold", "inf"], "--threshold"),
    (["--threshold", "0"], "--threshold"), (["--threshold", "-0.1"], "--threshold"),
])
def test_out_of_range_numbers_are_refused_before_anything(plan, tmp_path, private_tmp,
                                                           monkeypatch, flags, needle):
    out = tmp_path / "new" / "results"
    refused(monkeypatch, [plan, "--out", str(out), *flags], needle)
    assert not (tmp_path / "new").exists()
    assert list(private_tmp.iterdir()) == []


# --- --predicted-trace (issue 9.5) ----------------------------------------------------------

@pytest.mark.parametrize("content, needle", [
    ("not json {", "not a readable JSON trace"),
    (b"\xff\xfe\x00garbage", "not a readable JSON trace"),
    ("[]", "not a Chrome trace"),
    ('{"traceEvents": 3}', "not a Chrome trace"),
    ('{"traceEvents": [1, 2]}', "not a Chrome trace"),
    (None, "does not exist"),
    ("<dir>", "is not a file"),
])
def test_a_bad_predicted_trace_is_refused_before_the_run(plan, tmp_path, private_tmp,
                                                         monkeypatch, content, needle):
    trace = tmp_path / "predicted.json"
    if content == "<dir>":
        trace.mkdir()
    elif isinstance(content, bytes):
        trace.write_bytes(content)
    elif content is not None:
        trace.write_text(content)
    out = tmp_path / "results"
    refused(monkeypatch, [plan, "--nproc", "2", "--out", str(out), "--predicted-trace",
                          str(trace)], "--predicted-trace", needle)
    assert not out.exists()
    assert list(private_tmp.iterdir()) == []


# --- --compare (issue 9.16) -----------------------------------------------------------------

def _without(dotted: str) -> dict:
    doc = complete_result()
    *parents, last = dotted.split(".")
    node = doc
    for part in parents:
        node = node[part]
    del node[last]
    return doc


def _with(dotted: str, value) -> dict:
    doc = complete_result()
    *parents, last = dotted.split(".")
    node = doc
    for part in parents:
        node = node[part]
    node[last] = value
    return doc


@pytest.mark.parametrize("doc, needles", [
    ({"fsdp_plan_bench_version": 1}, ["lacks the field plan.hash"]),
    (_without("collectives.measured"), ["lacks the field collectives.measured"]),
    (_without("step_time.p99_s"), ["lacks the field step_time.p99_s"]),
    (_without("comm"), ["lacks the field comm.rank0"]),
    (_with("step_time.median_s", "fast"), ["step_time.median_s is 'fast'", "seconds"]),
    (_with("collectives.measured", {"all_gather": -1}), ["collectives.measured"]),
    (_with("collectives.measured", {"all_gather": True}), ["collectives.measured"]),
    (_with("memory.peak_bytes", 1.5), ["memory.peak_bytes is 1.5"]),
    (_with("fsdp_plan_bench_version", 2), ["not an fsdp-plan bench result"]),
    ([], ["not an fsdp-plan bench result"]),
])
def test_an_incomplete_compare_file_is_refused_naming_the_field(plan, tmp_path, private_tmp,
                                                                monkeypatch, doc, needles):
    old = tmp_path / "old.json"
    old.write_text(json.dumps(doc))
    out = tmp_path / "results"
    refused(monkeypatch, [plan, "--nproc", "2", "--out", str(out), "--compare", str(old)],
            "--compare", *needles)
    assert not out.exists()


def test_a_compare_file_that_is_not_json_is_refused(plan, tmp_path, monkeypatch):
    old = tmp_path / "old.json"
    old.write_text("{oops")
    refused(monkeypatch, [plan, "--nproc", "2", "--out", str(tmp_path / "r"), "--compare",
                          str(old)], "not a readable JSON result")


def test_a_complete_compare_file_is_read_and_compared(plan, tmp_path, private_tmp,
                                                      monkeypatch):
    old = tmp_path / "old.json"
    old.write_text(json.dumps(complete_result()))
    monkeypatch.setattr(bench_cli, "launch", FakeLaunch())
    code, stdout, err = run_cli(["bench", plan, "--nproc", "2", "--out", str(tmp_path / "r"),
                                 "--compare", str(old)])
    assert code == 0, err
    assert "step time median" in stdout and "REGRESSED" not in stdout
    assert list(private_tmp.iterdir()) == []


# --- --out (issues 9.6 and 9.16) ------------------------------------------------------------

def test_out_naming_a_regular_file_is_refused_and_the_file_kept(plan, tmp_path, monkeypatch):
    target = tmp_path / "results"
    target.write_text("mine\n")
    refused(monkeypatch, [plan, "--nproc", "2", "--out", str(target)], "is a file, not a folder")
    assert target.read_text() == "mine\n"


def test_out_under_a_regular_file_is_refused(plan, tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("x")
    refused(monkeypatch, [plan, "--nproc", "2", "--out", str(tmp_path / "afile" / "deep")],
            "is a file, not a folder")


def test_a_refused_plan_creates_no_out_folders(tmp_path, private_tmp, monkeypatch):
    bad = tmp_path / "bad.yaml"
    bad.write_text("fsdp_plan_version: 1\nmodel: {}\n")
    refused(monkeypatch, [str(bad), "--nproc", "2", "--out", str(tmp_path / "new" / "deep" /
                                                                  "dir")], "plan")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml", "tmp"]
    assert list(private_tmp.iterdir()) == []


def test_the_default_out_folder_is_not_created_for_a_refused_run(plan, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bad = tmp_path / "bad.yaml"
    bad.write_text("not: [a plan\n")
    refused(monkeypatch, [str(bad), "--nproc", "2"], "plan")
    refused(monkeypatch, [plan, "--nproc", "2", "--timeout", "nan"], "--timeout")
    (tmp_path / "old.json").write_text("{}")
    refused(monkeypatch, [plan, "--nproc", "2", "--compare", "old.json"], "--compare")
    assert not (tmp_path / "benchmarks").exists()


def test_out_is_created_only_after_the_run_and_the_result_names_plan_and_torch(
        plan, tmp_path, private_tmp, monkeypatch):
    out = tmp_path / "new" / "deep" / "results"
    predicted = tmp_path / "predicted.json"
    predicted.write_text(json.dumps({"traceEvents": [
        {"name": "FW layers.0", "ph": "X", "pid": 0, "tid": 1, "ts": 0.0, "dur": 5.0}]}))
    fake = FakeLaunch(out=str(out))
    monkeypatch.setattr(bench_cli, "launch", fake)
    code, _, err = run_cli(["bench", plan, "--nproc", "2", "--out", str(out),
                            "--predicted-trace", str(predicted)])
    assert code == 0, err
    assert fake.calls == 1 and fake.out_existed_at_launch is False
    names = sorted(os.listdir(out))
    assert len(names) == 3 and sum(n.endswith(".side-by-side.trace.json") for n in names) == 1
    result_path = next(out / n for n in names if not n.endswith(".trace.json"))
    result = json.loads(result_path.read_text())
    import torch
    assert result["plan"]["path"] == plan and result["plan"]["abspath"] == os.path.abspath(plan)
    assert len(result["plan"]["hash"]) == 16 and result["run"]["torch"] == torch.__version__
    assert list(private_tmp.iterdir()) == []  # the workers' trace folder is gone


def test_a_failed_result_write_prints_the_figures_and_leaves_nothing(plan, tmp_path,
                                                                     private_tmp, monkeypatch):
    from fsdp_plan.common.errors import BadInput

    def full_disk(files):
        raise BadInput(f"writing {files[0][0]!r} failed (the disk is full); nothing was written.")

    monkeypatch.setattr(results, "atomic_write_all", full_disk)
    monkeypatch.setattr(bench_cli, "launch", FakeLaunch())
    code, stdout, err = run_cli(["bench", plan, "--nproc", "2", "--out", str(tmp_path / "r")])
    assert code == 2 and "Traceback" not in err
    assert "the disk is full" in err and "measured but not saved" in err
    assert "all_gather" in stdout  # the figures were shown
    assert list(private_tmp.iterdir()) == []
    assert [p.name for p in (tmp_path / "r").iterdir()] == []


# --- signals (issue 9.3) --------------------------------------------------------------------

def test_stop_on_signals_turns_sigterm_into_terminated_and_restores_handlers():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Terminated) as info, stop_on_signals():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    assert info.value.exit_code == 143 and info.value.name == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_during_the_run_removes_the_temporaries(plan, tmp_path, private_tmp,
                                                         monkeypatch, signum):
    out = tmp_path / "results"

    def signalled() -> None:
        os.kill(os.getpid(), signum)
        time.sleep(5)
        raise AssertionError("the signal did not stop the run")

    monkeypatch.setattr(bench_cli, "launch", FakeLaunch(action=signalled))
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP,
                                                        signal.SIGINT)}
    code, stdout, err = run_cli(["bench", plan, "--nproc", "2", "--out", str(out)])
    assert code == 128 + signum, err
    assert f"stopped by {signal.Signals(signum).name}" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and stdout == ""
    assert not out.exists()
    assert list(private_tmp.iterdir()) == []
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers  # restored


def _marked_pids(marker: str) -> list[int]:
    """Live processes whose environment holds ``marker`` (the bench and every worker)."""
    needle = f"FSDP_PLAN_TEST_MARKER={marker}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in environ.split(b"\0") and state != "Z":
            pids.append(int(entry.name))
    return pids


def _as_from_a_terminal() -> None:
    """The bench starts with SIGINT at its default, as from a terminal. A shell's background
    job (``CMD &`` without job control, as a CI script may start the suite) inherits SIGINT
    ignored, and Python then never turns it into KeyboardInterrupt: the SIGINT case waited out
    its 60 s in such a run while the bench trained on, as a background job should."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_bench(plan: str, tmp_path: Path, private: Path
                 ) -> tuple[subprocess.Popen, str, Path, Path, list]:
    """A real bench on two gloo workers, its TMPDIR ``private`` (``short_tmp``)."""
    marker = uuid.uuid4().hex
    out = tmp_path / "results"
    env = {**os.environ, "FSDP_PLAN_TEST_MARKER": marker, "TMPDIR": str(private),
           "PYTHONUNBUFFERED": "1"}
    env.pop("FSDP_PLAN_BENCH_FAULT", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "fsdp_plan.cli.main", "bench", plan, "--nproc", "2",
         "--steps", "100000", "--warmup", "0", "--timeout", "120", "--out", str(out)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=_as_from_a_terminal)
    lines: list[str] = []

    def drain() -> None:
        lines.extend(proc.stderr)

    threading.Thread(target=drain, daemon=True).start()
    deadline = time.monotonic() + 240
    # progress is polled, so a step's line may be skipped: wait for step 3 or later
    while not any(int(m.group(1)) >= 3 for line in lines
                  for m in [re.search(r"step (\d+)/", line)] if m):
        assert proc.poll() is None, "".join(lines)
        assert time.monotonic() < deadline, "".join(lines)
        time.sleep(0.2)
    assert any("worker(s) started" in line for line in lines)
    return proc, marker, private, out, lines


def _wait_gone(marker: str, seconds: float = 30) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := _marked_pids(marker)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("signum, said", [(signal.SIGTERM, "stopped by SIGTERM"),
                                           (signal.SIGHUP, "stopped by SIGHUP"),
                                           (signal.SIGINT, "interrupted")],
                         ids=["SIGTERM", "SIGHUP", "SIGINT"])
def test_a_signalled_bench_ends_its_workers_and_removes_its_temporaries(plan, tmp_path, signum,
                                                                        said, short_tmp):
    proc, marker, private, out, lines = _start_bench(plan, tmp_path, short_tmp)
    assert len(_marked_pids(marker)) >= 3  # the bench and its two training workers
    proc.send_signal(signum)
    assert proc.wait(timeout=60) == 128 + signum, "".join(lines)
    time.sleep(0.5)  # the stderr reader catches up
    tail = [line for line in lines if not line.startswith(("bench: ", "USDT:"))]
    assert [line for line in tail if said in line] and "Traceback" not in "".join(tail), tail
    assert _wait_gone(marker) == [], "workers still running after the bench exited"
    assert list(private.iterdir()) == []  # worker folder and trace folder removed
    assert not out.exists()


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc, PR_SET_PDEATHSIG")
def test_workers_die_with_a_killed_bench(plan, tmp_path, short_tmp):
    """SIGKILL cannot be handled: the kernel ends the workers (PR_SET_PDEATHSIG)."""
    proc, marker, _, _, _ = _start_bench(plan, tmp_path, short_tmp)
    proc.kill()
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert _wait_gone(marker) == [], "workers outlived a killed bench"
