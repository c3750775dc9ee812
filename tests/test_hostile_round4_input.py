"""Hostile input, round 4 (issue 31): bench results, pipes and devices, the model's exceptions,
its print()s and umask, signals while workers start, the Python API and ``--autocast ""``.

Each refusal is checked as SPEC 2 says: the exit code, a one-paragraph message naming the
field or argument, no traceback, nothing on stdout and nothing written. The bench cases stand
``launch`` in with ``FakeLaunch`` (test_bench_hostile.py) unless the case is about workers.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import cli_checks
import pytest
from test_bench_hostile import FakeLaunch, complete_result
from test_measure_helpers import plan_file, run_cli, tiny_llama_plan

import fsdp_plan
import fsdp_plan.cli.bench as bench_cli
from fsdp_plan.bench import result_check, results
from fsdp_plan.bench.tune import relative_spread
from fsdp_plan.common.errors import BadInput
from fsdp_plan.measure import launch as launch_module
from fsdp_plan.measure.launch import Terminated, stop_on_signals

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
PREDICTED = {"collectives_per_step": {"all_gather": 9, "reduce_scatter": 5, "all_reduce": 0},
             "peak_bytes": 4_000_000, "step_time_s": 0.05, "exposed_comm_s": 0.001}

TINY = """\
import torch
from torch import nn

class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 16)
        self.out = nn.Linear(16, 16)

    def forward(self, x):
        {forward}
        return self.out(self.emb(x))

def build_model():
    return Tiny()
"""
TINY_ARGS = ["--mem", "1GB", "--world-size", "2", "--seq-len", "8"]


def tiny_model(folder: Path, name: str = "tiny.py", forward: str = "pass",
               head: str = "") -> str:
    path = folder / name
    path.write_text(head + TINY.replace("{forward}", forward))
    return str(path)


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> str:
    return plan_file(tmp_path_factory.mktemp("plan"), tiny_llama_plan(world=2,
                                                                      predicted=PREDICTED))


def bench_refused(monkeypatch, argv: list[str], *needles: str) -> str:
    """``fsdp-plan bench ARGV`` in-process: exit 2, one paragraph holding every needle, no
    traceback, nothing on stdout, and no worker launched."""
    fake = FakeLaunch()
    monkeypatch.setattr(bench_cli, "launch", fake)
    code, out, err = run_cli(["bench", *argv])
    assert code == 2, err
    assert "Traceback" not in err, err
    assert err.count("\n") == 1, err  # one paragraph
    assert out == "", out
    for needle in needles:
        assert needle in err, err
    assert fake.calls == 0
    return err


def with_field(dotted: str, value) -> dict:
    doc = complete_result()
    *parents, last = dotted.split(".")
    node = doc
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value
    return doc


# --- S4-03 and S4-04: an old result is validated as a plan is, before the run --------------

@pytest.mark.parametrize("doc, needles", [
    # S4-03: "internal error" after the whole run, the new result not written
    (with_field("step_time.per_rank", [{"rank": 0, "steps_s": [0.0, 0.0, 0.0, 0.0]}]),
     ["step_time.per_rank", "positive"]),
    (with_field("step_time.per_rank", 7), ["step_time.per_rank is 7", "a list of objects"]),
    (with_field("step_time.per_rank", [{"rank": 0}]), ["step_time.per_rank", "steps_s"]),
    (with_field("step_time.per_rank", []), ["step_time.per_rank is []"]),
    # S4-04: a +10,450,492% regression was "within noise (±inf%)", exit 0
    (with_field("step_time.per_rank", [{"rank": 0, "steps_s": [0.01, float("inf"), 0.01,
                                                               0.01]}]),
     ["step_time.per_rank", "positive, finite"]),
    (with_field("step_time.median_s", 0), ["step_time.median_s is 0", "positive"]),
    (with_field("step_time.median_s", float("inf")), ["step_time.median_s is inf"]),
    (with_field("step_time.p99_s", float("nan")), ["step_time.p99_s is nan"]),
    (with_field("comm.rank0.comm_s", float("inf")), ["comm.rank0.comm_s is inf",
                                                     "not a finite number"]),
    (with_field("run.extra", [1.0, float("-inf")]), ["run.extra[1] is -inf"]),
])
def test_an_old_result_with_impossible_figures_is_refused_before_the_run(
        plan, tmp_path, monkeypatch, doc, needles):
    old = tmp_path / "old.json"
    old.write_text(json.dumps(doc))  # json writes inf and nan as Infinity and NaN
    out = tmp_path / "results"
    bench_refused(monkeypatch, [plan, "--nproc", "2", "--out", str(out), "--compare", str(old)],
                  "--compare", *needles)
    assert not out.exists()


def test_a_valid_old_result_with_per_rank_steps_is_compared(plan, tmp_path, monkeypatch):
    doc = with_field("step_time.per_rank", [{"rank": r, "steps_s": [0.01, 0.011, 0.01, 0.012]}
                                            for r in range(2)])
    old = tmp_path / "old.json"
    old.write_text(json.dumps(doc))
    monkeypatch.setattr(bench_cli, "launch", FakeLaunch())
    code, out, err = run_cli(["bench", plan, "--nproc", "2", "--out", str(tmp_path / "r"),
                              "--compare", str(old)])
    assert code == 0, err
    assert "step time median" in out and "±inf" not in out and "±26.7%" in out


def test_zero_step_times_do_not_divide_by_zero():
    assert relative_spread([0.0, 0.0, 0.0, 0.0]) > 0  # the floor, not ZeroDivisionError
    new = with_field("step_time.per_rank", [{"rank": 0, "steps_s": [0.0] * 4}])
    old = with_field("step_time.per_rank", [{"rank": 0, "steps_s": [0.01] * 4}])
    table, _ = results.compare(old, new, 0.1)
    assert "step time median" in table


# --- S4-19: a size bound before parsing ---------------------------------------------------

def test_compare_dev_zero_is_refused_at_once(plan, tmp_path, monkeypatch):
    started = time.perf_counter()
    bench_refused(monkeypatch, [plan, "--nproc", "2", "--out", str(tmp_path / "r"),
                                "--compare", "/dev/zero"], "'/dev/zero' is a device",
                  "regular file")
    assert time.perf_counter() - started < 5


def test_a_result_past_the_size_bound_is_not_parsed(plan, tmp_path, monkeypatch):
    monkeypatch.setattr(result_check, "MAX_RESULT_BYTES", 1000)
    big = tmp_path / "big.json"
    big.write_text(json.dumps({**complete_result(), "padding": "x" * 2000}))
    bench_refused(monkeypatch, [plan, "--nproc", "2", "--out", str(tmp_path / "r"),
                                "--compare", str(big)], "larger than 1,000 bytes",
                  "not a bench result")


# --- S4-08: pipes, devices and folders are refused without opening them ----------------------

@pytest.fixture
def fifo(tmp_path):
    """A FIFO with no writer; if a reader blocks on it, a watchdog opens it for writing
    after 30 s so the test fails instead of hanging the suite."""
    path = tmp_path / "pipe"
    os.mkfifo(path)
    done = threading.Event()

    def watchdog() -> None:
        if not done.wait(30):  # a reader is blocked: give it an end of file
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
    thread = threading.Thread(target=watchdog, daemon=True)
    thread.start()
    yield str(path)
    done.set()


def test_a_fifo_plan_is_refused_by_emit_and_predict(fifo, tmp_path, capsys):
    for argv in (["emit", fifo, "-o", str(tmp_path / "policy.py")], ["predict", fifo]):
        started = time.perf_counter()
        cli_checks.refused(capsys, argv, "named pipe (FIFO)", "regular file")
        assert time.perf_counter() - started < 20
    assert not (tmp_path / "policy.py").exists()


def test_a_fifo_model_is_refused(fifo, tmp_path, capsys):
    cli_checks.refused(capsys, [fifo, *TINY_ARGS, "--plan", str(tmp_path / "p.yaml")],
                       "named pipe (FIFO)")
    assert not (tmp_path / "p.yaml").exists()


def test_fifo_and_device_results_and_hardware_are_refused(fifo, plan, tmp_path, monkeypatch,
                                                          capsys):
    bench_refused(monkeypatch, [plan, "--nproc", "2", "--out", str(tmp_path / "r"),
                                "--compare", fifo], "--compare", "named pipe (FIFO)")
    bench_refused(monkeypatch, [plan, "--nproc", "2", "--out", str(tmp_path / "r"),
                                "--predicted-trace", "/dev/zero"], "--predicted-trace")
    cli_checks.refused(capsys, ["predict", plan, "--hardware", fifo], "--hardware",
                       "named pipe (FIFO)")
    bench_refused(monkeypatch, [plan, "--nproc", "2", "--out", str(tmp_path / "r"),
                                "--compare", str(tmp_path)], "--compare", "is a folder")


def test_a_fifo_hf_config_is_refused(fifo, tmp_path, capsys):
    pytest.importorskip("transformers")
    cli_checks.refused(capsys, ["--hf-config", fifo, "--mem", "1GB"], "named pipe (FIFO)")


# --- S4-07: a BaseException from the model is the model's error --------------------------

BOOM = "class Boom(BaseException):\n    pass\n\n"


@pytest.mark.parametrize("head, forward, needles", [
    (BOOM + "raise Boom('at import')\n", "pass", ["importing model file", "Boom: at import",
                                                 "line 4"]),
    ("raise GeneratorExit\n", "pass", ["importing model file", "GeneratorExit", "line 1"]),
    (BOOM, "raise Boom('in forward')", ["Boom: in forward", "tiny.py line"]),
    ("", "raise GeneratorExit()", ["GeneratorExit", "tiny.py line"]),
])
def test_a_model_raising_a_base_exception_is_bad_input(tmp_path, capsys, head, forward,
                                                       needles):
    model = tiny_model(tmp_path, head=head, forward=forward)
    out = tmp_path / "p.yaml"
    err = cli_checks.refused(capsys, [model, *TINY_ARGS, "--plan", str(out)],
                             "BaseException, not Exception", *needles)
    last = err.strip().splitlines()[-1]  # after the progress lines, the one paragraph
    assert all(needle in last for needle in needles), err
    assert not out.exists()


def test_ctrl_c_raised_in_the_model_still_stops_the_planner(tmp_path, capsys):
    model = tiny_model(tmp_path, head="raise KeyboardInterrupt\n")
    err = cli_checks.refused(capsys, [model, *TINY_ARGS], "interrupted", code=130)
    assert "BaseException" not in err


def test_a_base_exception_outside_user_code_guards_is_one_paragraph(monkeypatch, capsys):
    import fsdp_plan.cli.emit as emit_cli

    class Odd(BaseException):
        pass

    def run(args):
        raise Odd("from a library")
    monkeypatch.setattr(emit_cli, "run", run)
    err = cli_checks.refused(capsys, ["emit", "p.yaml", "-o", "x.py"], "Odd: from a library",
                             "not an Exception")
    assert err.count("\n") == 1


# --- S3-15: bench --format json on a printing model prints one document -------------------

def test_bench_json_on_a_printing_model_is_one_document(tmp_path):
    model = tiny_model(tmp_path, forward="print('forward print')")
    plan_path = tmp_path / "p.yaml"
    base = [sys.executable, "-m", "fsdp_plan.cli.main"]
    made = subprocess.run([*base, model, *TINY_ARGS, "--strategy", "full", "--plan",
                           str(plan_path)], check=False, capture_output=True, text=True, env=ENV,
                          cwd=tmp_path, timeout=300)
    assert made.returncode == 0, made.stderr
    done = subprocess.run([*base, "bench", str(plan_path), "--nproc", "2", "--steps", "1",
                           "--warmup", "0", "--format", "json", "--out", str(tmp_path / "r")],
                          check=False, capture_output=True, text=True, env=ENV, cwd=tmp_path,
                          timeout=500)
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)  # nothing before, inside or after it
    assert document["fsdp_plan_bench_version"] == 1
    assert "forward print" not in done.stdout
    assert "forward print" in done.stderr


# --- S4-13: a signal while a worker starts leaves no worker traceback ----------------------

class _SignalledStart:
    """A process whose ``start`` is hit by SIGTERM half-way (the payload being written)."""

    def __init__(self) -> None:
        self.started = False

    def start(self) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)  # a signal let through would raise Terminated here
        self.started = True


def test_a_signal_during_a_workers_start_waits_until_it_is_listed():
    started: list = []
    process = _SignalledStart()
    with pytest.raises(Terminated), stop_on_signals():
        launch_module._start_whole(process, started)
    assert process.started and started == [process]  # kill_all knows of it


def test_a_signal_during_a_start_outside_stop_on_signals_still_interrupts():
    # SIGINT as Python sets it up from a terminal: a suite started as a shell's background
    # job (``CMD &``) inherits it ignored, and there is no KeyboardInterrupt to hand on
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)

    class Interrupted(_SignalledStart):
        def start(self) -> None:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            self.started = True
    started: list = []
    process = Interrupted()
    try:
        with pytest.raises(KeyboardInterrupt):
            launch_module._start_whole(process, started)
        assert process.started and started == [process]
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, previous)


# --- S4-14: outputs' modes come from the umask the command started with ---------------------

def test_a_model_setting_umask_777_does_not_make_outputs_unreadable(tmp_path, capsys):
    model = tiny_model(tmp_path, head="import os\nos.umask(0o777)\n")
    policy, plan_path = tmp_path / "policy.py", tmp_path / "p.yaml"
    old = os.umask(0o022)
    try:
        from fsdp_plan.cli.main import main
        assert main([model, *TINY_ARGS, "-o", str(policy), "--plan", str(plan_path)]) == 0, \
            capsys.readouterr().err
        assert os.umask(0o022) == 0o022  # the model's umask did not outlive its import
    finally:
        os.umask(old)
    for path in (policy, plan_path):
        assert stat.S_IMODE(path.stat().st_mode) == 0o644, path


# --- S4-15: the Python API checks its arguments at the edge ---------------------------------

def _source() -> fsdp_plan.ModelSource:
    return fsdp_plan.ModelSource(source=str(ROOT / "examples" / "llama.py"))


@pytest.mark.parametrize("call, error, needle", [
    (lambda: fsdp_plan.make_plan(None), TypeError, "make_plan(request)"),
    (lambda: fsdp_plan.predict(None, None), TypeError, "predict(plan)"),
    (lambda: fsdp_plan.plan_from_facts(None, None), TypeError, "plan_from_facts(facts)"),
    (lambda: fsdp_plan.analyze_model(None), TypeError, "analyze_model(source)"),
    (lambda: fsdp_plan.read_plan(None), TypeError, "a path must be a str"),
    (lambda: fsdp_plan.ModelSource(source=123), TypeError, "ModelSource.source"),
    (lambda: fsdp_plan.ModelSource(source=""), BadInput, "ModelSource.source is empty"),
    (lambda: fsdp_plan.ModelSource(source="m.py", args=[1]), TypeError, "ModelSource.args"),
    (lambda: fsdp_plan.PlanRequest(source=_source(), budget_bytes=10**9, world_size=0),
     BadInput, "PlanRequest.world_size is 0"),
    (lambda: fsdp_plan.PlanRequest(source=_source(), budget_bytes=10**9, gpus_per_node=0),
     BadInput, "PlanRequest.gpus_per_node is 0"),
    (lambda: fsdp_plan.PlanRequest(source=_source(), budget_bytes="80GB"), TypeError,
     "PlanRequest.budget_bytes"),
    (lambda: fsdp_plan.PlanRequest(source="m.py", budget_bytes=10**9), TypeError,
     "PlanRequest.source"),
    (lambda: fsdp_plan.PlanRequest(source=_source(), budget_bytes=10**9, world_size=True),
     TypeError, "PlanRequest.world_size"),
    (lambda: fsdp_plan.PlanRequest(source=_source(), budget_bytes=10**9, strategy="fast"),
     BadInput, "PlanRequest.strategy"),
    (lambda: fsdp_plan.SearchOptions(exact_analysis="yes"), TypeError,
     "SearchOptions.exact_analysis"),
    (lambda: fsdp_plan.PlanRequest(source=_source(), budget_bytes=10**9, search={}), TypeError,
     "PlanRequest.search"),
    (lambda: fsdp_plan.PlanRequest(source=_source(), budget_bytes=10**9,
                                   search=fsdp_plan.SearchOptions(compile_auto=True)),
     BadInput, "set compile_blocks too"),
])
def test_public_api_arguments_are_checked_naming_the_argument(call, error, needle):
    with pytest.raises(error) as caught:
        call()
    assert needle in str(caught.value)


def test_the_search_settings_are_one_field_of_the_request():
    """What the user asked and how widely the planner looks are apart (issue 28 item 4):
    the search's settings are ``PlanRequest.search``, and a request at its own micro-batch
    keeps every other search setting."""
    search = fsdp_plan.SearchOptions(exact_analysis=True, auto_batch=True)
    request = fsdp_plan.PlanRequest(source=_source(), budget_bytes=10**9, global_batch_size=64,
                                    search=search)
    assert request.analysis_options()["exact"] is True
    one = request.at_its_micro_batch()
    assert one.global_batch_size is None
    assert one.search == fsdp_plan.SearchOptions(exact_analysis=True)
    assert request.search is search  # the request it came from is unchanged
    with pytest.raises(TypeError, match="exact_analysis"):
        fsdp_plan.PlanRequest(source=_source(), budget_bytes=10**9, exact_analysis=True)


def test_predict_checks_its_facts_and_gpus_per_node():
    plan = fsdp_plan.read_plan(str(ROOT / "policies" / "llama8b_h100x8.yaml"))
    with pytest.raises(TypeError, match=r"predict\(facts\)"):
        fsdp_plan.predict(plan, None)


# --- S4-11: --autocast "" is a dtype given, and not one --------------------------------------

@pytest.mark.parametrize("flag", ["--autocast", "--param-dtype"])
def test_an_empty_dtype_flag_is_refused(tmp_path, capsys, flag):
    model = tiny_model(tmp_path)
    out = tmp_path / "p.yaml"
    cli_checks.refused(capsys, [model, *TINY_ARGS, flag, "", "--plan", str(out)], flag,
                       "not a floating dtype")
    assert not out.exists()
