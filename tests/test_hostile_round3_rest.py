"""Hostile input, round 3 (issue 21): tune, the torchrun worker entry, plans and predict.

Each case runs through a real entry point (``fsdp_plan.cli.main.main`` in-process, or a
subprocess of ``python -m fsdp_plan.cli.main`` / ``python -m fsdp_plan.cli.bench_worker``) and
checks the SPEC 2 contract for it: the exit code, the message's words, no Python traceback,
and no file written, changed or left behind (no worker left running either). Where a check
must come "before any measuring", the functions that start workers (``time_plans`` and
``time_with_held_twin`` for tune) are replaced by a recorder, and the model loader by one that fails the test.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import cli_checks
import pytest
from test_bench_hostile import _marked_pids, _wait_gone
from test_measure_helpers import plan_file, tiny_llama_plan

from fsdp_plan.bench import timing
from fsdp_plan.cli.main import main
from fsdp_plan.measure import runtime
from fsdp_plan.plan.document import Plan, read_plan

ROOT = Path(__file__).resolve().parent.parent

# its plans and predictions of the same small models share their analyses (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("facts_cache_per_file")


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under ``folder`` (recursively): bytes and mode. A refused run changes none,
    adds none and leaves no temporary."""
    return {str(p.relative_to(folder)): (p.read_bytes(), stat.S_IMODE(p.stat().st_mode))
            for p in sorted(folder.rglob("*")) if p.is_file()}


def refused(capsys, argv: list[str], code: int, *needles: str) -> str:
    """``cli_checks.refused`` with the exit code first, as this file's cases read."""
    return cli_checks.refused(capsys, argv, *needles, code=code)


class FakeTimePlans:
    """Stands in for ``bench.timing.time_plans`` and ``time_with_held_twin`` (the only things
    tune starts workers with): records the plans and answers with a step time per plan (1%
    jitter, two ranks), the held twin with a backward that overlap shortened by 10 ms."""

    def __init__(self, seconds=lambda plan: 1.0, action=None) -> None:
        self.calls: list[list] = []
        self.seconds = seconds
        self.action = action

    def __call__(self, source, plans, *, nproc, mesh, steps, warmup, **_):
        self.calls.append(list(plans))
        if self.action is not None:
            self.action()
        return [[[self.seconds(p) * (1 + 0.01 * (i % 3 - 1)) for i in range(steps)]] * nproc
                for p in plans]

    def held(self, source, plan, *, nproc, mesh, steps, warmup, **_):
        [times] = self(source, [plan], nproc=nproc, mesh=mesh, steps=steps, warmup=warmup)
        overlapped = {"comm": {"backward_compute_s": 0.5, "backward_hidden_s": 0.01},
                      "phases_s": {"backward": 0.5, "tail": 0.0}}
        held = {"comm": {"backward_compute_s": 0.5, "backward_hidden_s": 0.0},
                "phases_s": {"backward": 0.51, "tail": 0.0}, "how": "held by a fake"}
        return times, overlapped, held


def fake_workers(monkeypatch, fake: FakeTimePlans) -> FakeTimePlans:
    monkeypatch.setattr(timing, "time_plans", fake)
    monkeypatch.setattr(timing, "time_with_held_twin", fake.held)
    return fake


def _no_model_loading(*args, **kwargs):
    raise AssertionError("the model was loaded: the check did not come before the work")


@pytest.fixture(scope="module")
def plan(tmp_path_factory) -> str:
    """A tiny Llama plan at world 2 (one unit per block, root last), in a folder of its own."""
    return plan_file(tmp_path_factory.mktemp("plan"), tiny_llama_plan(world=2))


@pytest.fixture
def private_tmp(tmp_path, monkeypatch) -> Path:
    """The folder ``tempfile`` uses in this test: it must be empty when the command returns."""
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


# --- tune: outputs checked before measuring (S3-11) -------------------------------------------

def test_s3_11_tune_out_under_a_file_is_refused_before_any_measuring(plan, tmp_path, capsys,
                                                                     monkeypatch):
    readme = tmp_path / "README.md"
    readme.write_text("# a project's readme\n")
    bench = FakeTimePlans()
    fake_workers(monkeypatch, bench)
    monkeypatch.setattr(runtime, "load_planned_model", _no_model_loading)
    before = snapshot(tmp_path)
    refused(capsys, ["tune", plan, "--out", str(readme / "sub")], 2,
            "--out", "README.md", "is a file, not a folder")
    assert bench.calls == []
    assert snapshot(tmp_path) == before


# --- tune: --nproc capped as bench and calibrate cap it (S3-31) -------------------------------

@pytest.mark.parametrize("over", [1, 64])
def test_s3_31_tune_nproc_is_capped_like_bench(plan, tmp_path, capsys, monkeypatch, over):
    from fsdp_plan.bench.inputs import max_local_workers
    limit = max_local_workers()
    bench = FakeTimePlans()
    fake_workers(monkeypatch, bench)
    monkeypatch.setattr(runtime, "load_planned_model", _no_model_loading)
    out = tmp_path / "results"
    before = snapshot(tmp_path)
    refused(capsys, ["tune", plan, "--nproc", str(limit + over), "--out", str(out)], 2,
            f"--nproc is the number of local worker processes, from 1 to {limit}",
            f"got {limit + over}")
    refused(capsys, ["tune", plan, "--nproc", "0", "--out", str(out)], 2, "from 1 to")
    assert bench.calls == [] and not out.exists()
    assert snapshot(tmp_path) == before


# --- tune: signals end the workers and remove the temporaries (S3-12) -------------------------

@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_s3_12_a_signal_during_tune_exits_with_its_code_and_leaves_nothing(
        plan, tmp_path, private_tmp, capsys, monkeypatch, signum):
    def signalled() -> None:
        os.kill(os.getpid(), signum)
        time.sleep(5)
        raise AssertionError("the signal did not stop tune")

    fake_workers(monkeypatch, FakeTimePlans(action=signalled))
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP,
                                                        signal.SIGINT)}
    out = tmp_path / "results"
    err = refused(capsys, ["tune", plan, "--out", str(out)], 128 + signum,
                  f"stopped by {signal.Signals(signum).name}", "workers were ended")
    assert len([line for line in err.splitlines() if not line.startswith("tune: ")]) == 1
    assert not out.exists()
    assert list(private_tmp.iterdir()) == []
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers  # restored


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_s3_12_sigterm_to_a_real_tune_ends_its_workers_and_their_folder(plan, tmp_path,
                                                                          short_tmp):
    """A real ``fsdp-plan tune`` benching its baseline on two gloo workers gets SIGTERM: it
    exits 143 saying so, no worker outlives it, and no ``fsdp-plan-workers-*`` folder stays
    in TMPDIR."""
    marker = uuid.uuid4().hex
    private = short_tmp
    out = tmp_path / "results"
    env = {**os.environ, "FSDP_PLAN_TEST_MARKER": marker, "TMPDIR": str(private),
           "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fsdp_plan.cli.main", "tune", plan, "--nproc", "2",
         "--steps", "1000", "--warmup", "100", "--out", str(out)],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    deadline = time.monotonic() + 300
    # the workers are up once both have reported progress into their private folder
    while not list(private.glob("fsdp-plan-workers-*/rank1.progress.json")):
        assert proc.poll() is None, "".join(lines)
        assert time.monotonic() < deadline, "".join(lines)
        time.sleep(0.2)
    assert len(_marked_pids(marker)) >= 3  # tune and its two workers
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 143, "".join(lines)
    time.sleep(0.5)  # the stderr reader catches up
    text = "".join(lines)
    assert "fsdp-plan tune: stopped by SIGTERM" in text and "Traceback" not in text, text
    assert proc.stdout.read() == ""
    assert _wait_gone(marker) == [], "workers still running after tune exited"
    assert list(private.iterdir()) == []
    assert not out.exists()


# --- tune: outputs get names of their own, never an existing file (S3-13) ---------------------

STAMP = "20990101-000000"


def test_s3_13_two_tunes_in_one_second_keep_every_output_and_the_input(plan, tmp_path, capsys,
                                                                      monkeypatch):
    """The input plan is named as the first run's best plan would be (the run of an earlier
    second, tuned again); two runs end in the same second. Nothing is replaced: each run
    writes three new files and its record names them."""
    import json

    real_strftime = time.strftime
    monkeypatch.setattr(time, "strftime", lambda fmt, *rest: STAMP if fmt == "%Y%m%d-%H%M%S"
                        else real_strftime(fmt, *rest))
    fake_workers(monkeypatch, FakeTimePlans())
    out = tmp_path / "results"
    out.mkdir()
    given = out / f"tune-{STAMP}-best.yaml"
    given.write_bytes(Path(plan).read_bytes() + b"# my notes: a rewrite would drop this line\n")
    before = snapshot(out)
    records = []
    for _ in range(2):
        assert main(["tune", str(given), "--out", str(out), "--format", "json"]) == 0
        captured = capsys.readouterr()
        assert "Traceback" not in captured.err
        records.append(json.loads(captured.out))
    after = snapshot(out)
    assert after[given.name] == before[given.name]  # the input is untouched
    written = {records[i][key] for i in range(2) for key in ("best_plan", "rollback_plan")}
    assert len(written) == 4 and str(given) not in written
    assert set(after) == {given.name, *(os.path.basename(p) for p in written),
                          f"tune-{STAMP}-2.json", f"tune-{STAMP}-3.json"}
    assert all(data for data, _ in after.values())  # no empty reservation left
    for record in records:
        assert read_plan(record["rollback_plan"]).to_dict() == read_plan(str(given)).to_dict()


def test_s3_13_names_are_reserved_so_concurrent_runs_never_share_them(tmp_path):
    from fsdp_plan.cli.tune import reserve_output_names
    (tmp_path / f"tune-{STAMP}-rollback.yaml").symlink_to(tmp_path / "nowhere")  # dangling
    first = reserve_output_names(str(tmp_path), STAMP)
    second = reserve_output_names(str(tmp_path), STAMP)
    assert first[0].endswith(f"tune-{STAMP}-2-best.yaml")
    assert second[0].endswith(f"tune-{STAMP}-3-best.yaml")
    assert not set(first) & set(second)
    assert not (tmp_path / "nowhere").exists()


# --- tune: only neighbours the plan format accepts, labelled truly (S3-14) --------------------

def _ddp_plan(tmp_path: Path) -> str:
    doc = tiny_llama_plan(world=2).to_dict()
    doc.update(fsdp_plan_version=2, strategy="ddp", mesh={"replicate": 2, "shard": 1},
               units=[{"modules": [""], "reshard_after_forward": False}], forward_prefetch={},
               backward_prefetch={}, ddp={"bucket_cap_mb": 25})
    return plan_file(tmp_path, Plan.from_dict(doc), "ddp.yaml")


def _selective_plan(tmp_path: Path) -> str:
    """Root only (so every neighbour is benched in the first round), two blocks selective."""
    from fsdp_plan.facts.checkpointing import DEFAULT_SELECTIVE_OPS
    doc = tiny_llama_plan(world=2).to_dict()
    doc.update(fsdp_plan_version=2, units=[{"modules": [""], "reshard_after_forward": False}],
               forward_prefetch={}, backward_prefetch={},
               activation_checkpointing={"layers.0": "selective", "layers.1": "selective"},
               selective_ops=list(DEFAULT_SELECTIVE_OPS))
    return plan_file(tmp_path, Plan.from_dict(doc), "selective.yaml")


@pytest.mark.parametrize("make", [_ddp_plan, _selective_plan], ids=["ddp", "selective"])
def test_s3_14_tune_benches_only_valid_neighbours_with_true_labels(tmp_path, capsys,
                                                                   monkeypatch, make):
    import json
    import re

    from fsdp_plan.bench.results import plan_hash
    given = Path(make(tmp_path))
    bench = FakeTimePlans()
    fake_workers(monkeypatch, bench)
    out = tmp_path / "results"
    assert main(["tune", str(given), "--out", str(out), "--format", "json"]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    record = json.loads(captured.out)
    baseline = read_plan(str(given))
    benched = {plan_hash(p.to_dict()): p for call in bench.calls for p in call}
    for p in benched.values():
        Plan.from_dict(p.to_dict())  # the plan format accepts it (BadInput otherwise)
        if baseline.strategy == "ddp":
            assert p.strategy == "ddp" and [u.modules for u in p.units] == [[""]]
        else:  # every checkpointed block stays selective
            ac = p.activation_checkpointing
            assert ac == [] or isinstance(ac, dict) and set(ac.values()) == {"selective"}, ac
    checkpointing = [t for t in record["trials"] if t["knob"] == "checkpointing"]
    if baseline.strategy != "ddp":
        assert len(checkpointing) == 3  # 2 -> 1, 2 -> 0, 2 -> 3 (layers.2 selective)
    for trial in checkpointing:
        after = int(re.fullmatch(r"\d+ -> (\d+) blocks( \(.*\))?", trial["change"]).group(1))
        assert len(benched[trial["plan_hash"]].activation_checkpointing) == after
    assert record["trials"][0]["knob"] == "baseline"
    assert len(benched) == len(record["trials"])


def test_s3_14_grad_op_and_unit_precision_neighbours_stay_valid():
    """grad-op keeps every unit gathered, and a unit with its own mixed precision keeps it:
    no neighbour may reshard under grad-op or drop a unit's precision."""
    from fsdp_plan.bench.tune_stages import STAGES, Context
    from fsdp_plan.facts.types import ModelFacts
    facts = ModelFacts.from_json((ROOT / "tests" / "fixtures" / "tiny_llama_facts.json")
                                 .read_text())
    grad_op = tiny_llama_plan(world=2, block_reshard=False)
    grad_op.strategy = "grad-op"
    precise = tiny_llama_plan(world=2)
    precise.units[0].mixed_precision = {"param_dtype": "float32"}
    for plan in (grad_op, precise):
        found = [p for stage in STAGES
                 for p in stage.propose(Context(plan=plan, facts=facts)).proposals]
        assert found
        for _, _, other in found:
            Plan.from_dict(other.to_dict())
            if plan is grad_op:
                assert not any(u.reshard_after_forward for u in other.units)
            else:
                assert other.units[0].mixed_precision == {"param_dtype": "float32"}


# --- tune: a baseline over its budget is refused, never reported as best (S3-30) --------------

def test_s3_30_a_baseline_that_does_not_fit_is_refused_before_measuring(tmp_path, capsys,
                                                                         monkeypatch):
    doc = tiny_llama_plan(world=2).to_dict()
    doc["budget_bytes"] = 100_000  # the tiny Llama's states alone are more
    given = plan_file(tmp_path, Plan.from_dict(doc), "over.yaml")
    bench = FakeTimePlans()
    fake_workers(monkeypatch, bench)
    out = tmp_path / "results"
    before = snapshot(tmp_path)
    refused(capsys, ["tune", given, "--out", str(out)], 3,
            "the plan to tune peaks at", "above its limit 100.00 kB",
            "keeps only plans that fit", "nothing was measured")
    assert bench.calls == [] and not out.exists()
    assert snapshot(tmp_path) == before


# --- the torchrun worker entry: its environment checked first (S3-17, S3-34) ------------------

def _torchrun_env(**changes: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT")}
    env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT="29517")
    for key, value in changes.items():
        if value is None:
            env.pop(key)
        else:
            env[key] = value
    return env


@pytest.mark.slow
@pytest.mark.parametrize("changes, needles", [
    ({"WORLD_SIZE": "abc"}, ["WORLD_SIZE='abc'", "not a whole number from 1 to 1048576"]),
    ({"WORLD_SIZE": "\u0662"}, ["WORLD_SIZE=", "not a whole number"]),  # an Arabic-Indic 2
    ({"RANK": None}, ["lacks RANK"]),
    ({"MASTER_ADDR": None}, ["lacks MASTER_ADDR"]),
    ({"RANK": "5", "WORLD_SIZE": "2"}, ["RANK=5", "outside 0..1"]),  # hung before
    ({"WORLD_SIZE": "0"}, ["WORLD_SIZE=0", "outside 1..1048576"]),  # S3-34: no --nproc
    ({"MASTER_PORT": "70000"}, ["MASTER_PORT=70000", "outside 1..65535"]),
], ids=["world-abc", "world-unicode-digit", "no-rank", "no-master-addr", "rank-5-of-2",
        "world-0", "port"])
def test_s3_17_the_worker_refuses_a_broken_torchrun_environment(plan, tmp_path, changes,
                                                                needles, short_tmp):
    private = short_tmp
    out = tmp_path / "results"
    env = {**_torchrun_env(**changes), "TMPDIR": str(private)}
    done = subprocess.run([sys.executable, "-m", "fsdp_plan.cli.bench_worker", plan, "--out",
                           str(out)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240, check=False)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""
    assert done.stderr.startswith("python -m fsdp_plan.cli.bench_worker: ")
    assert len(done.stderr.strip().splitlines()) == 1
    for needle in [*needles, "torchrun --nproc-per-node"]:
        assert needle in done.stderr, done.stderr
    assert "--nproc " not in done.stderr  # the worker has no such option (S3-34)
    assert not out.exists() and list(private.iterdir()) == []


@pytest.mark.parametrize("path", ["/proc/cal.yaml", "/sys/cal.yaml"])
def test_s3_34_calibrate_to_an_unwritable_place_does_not_speak_of_planning(capsys, monkeypatch,
                                                                           path):
    import fsdp_plan.measure.calibrate as calibration
    if not os.path.isdir(os.path.dirname(path)):
        pytest.skip(f"{os.path.dirname(path)} does not exist here")

    def no_calibration(**kwargs):
        raise AssertionError("calibrate measured before checking its output")

    monkeypatch.setattr(calibration, "calibrate", no_calibration)
    err = refused(capsys, ["calibrate", "-o", path], 2, f"-o {path!r} cannot be written",
                  "nothing was written")
    assert "planned" not in err
    assert not os.path.exists(path)


# --- plans: selective_ops must name real ops (S3-18) ------------------------------------------

def _plan_doc(**changes) -> dict:
    doc = tiny_llama_plan(world=2).to_dict()
    doc.update(changes)
    return doc


def _write_doc(folder: Path, doc: dict, name: str = "plan.yaml") -> str:
    import yaml
    path = folder / name
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(path)


@pytest.mark.parametrize("ops, index", [(["os.system"], 0),
                                        (["aten.nonexistent_op.default"], 0),
                                        (["aten.mm.default", "aten.nonexistent_op.default"], 1),
                                        (["aten.mm"], 0)],  # a packet, not an op overload
                         ids=["os.system", "nonexistent", "one-of-two", "no-overload"])
@pytest.mark.parametrize("verb", ["verify", "predict", "emit"])
def test_s3_18_selective_ops_naming_no_op_are_refused_at_validation(tmp_path, capsys,
                                                                    monkeypatch, ops, index,
                                                                    verb):
    given = _write_doc(tmp_path, _plan_doc(fsdp_plan_version=2, selective_ops=ops,
                                           activation_checkpointing={"layers.0": "selective"}))
    monkeypatch.setattr(runtime, "load_planned_model", _no_model_loading)
    before = snapshot(tmp_path)
    argv = [verb, given] + (["-o", str(tmp_path / "policy.py")] if verb == "emit" else [])
    refused(capsys, argv, 2, f"selective_ops[{index}] is {ops[index]!r}",
            "names no op of this PyTorch", "e.g. aten.mm.default")
    assert snapshot(tmp_path) == before


def test_s3_18_the_ops_fsdp_plan_writes_are_accepted_whatever_the_build():
    from fsdp_plan.facts.checkpointing import DEFAULT_SELECTIVE_OPS
    plan = Plan.from_dict(_plan_doc(fsdp_plan_version=2, selective_ops=DEFAULT_SELECTIVE_OPS,
                                    activation_checkpointing={"layers.0": "selective"}))
    assert plan.selective_ops == DEFAULT_SELECTIVE_OPS


# --- plans: a unit on an nn.ModuleList container (S3-19) --------------------------------------

@pytest.mark.parametrize("where", ["unit", "checkpointing"])
@pytest.mark.parametrize("verb", ["predict", "verify"])
def test_s3_19_a_container_as_a_unit_or_checkpointed_is_refused_naming_it(tmp_path, capsys,
                                                                          verb, where):
    if where == "unit":
        doc = _plan_doc(units=[{"modules": ["layers"], "reshard_after_forward": True},
                               {"modules": [""], "reshard_after_forward": False}],
                        forward_prefetch={}, backward_prefetch={})
        path = "units[0].modules[0]"
    else:
        doc = _plan_doc(activation_checkpointing=["layers"])
        path = "activation_checkpointing[0]"
    given = _write_doc(tmp_path, doc)
    before = snapshot(tmp_path)
    refused(capsys, [verb, given], 2, f"{path} 'layers' is a ModuleList container",
            "never calls", "'layers.0', 'layers.1', 'layers.2', ...")
    assert snapshot(tmp_path) == before


# --- bench --refit: every predicted figure it computes with is checked first (S3-21) ----------

@pytest.mark.parametrize("predicted, needle", [
    ({"phases_s": "forward 1 s"}, "predicted.phases_s must be a mapping"),
    ({"phases_s": {"forward": "fast", "backward": 0.2}},
     "predicted.phases_s.forward must be a finite number >= 0, got 'fast'"),
    ({"phases_s": {"forward": -1.0}}, "predicted.phases_s.forward must be a finite number"),
    ({"compute_s": "a while"}, "predicted.compute_s must be a finite number"),
    ({"total_comm_s": [1]}, "predicted.total_comm_s must be a finite number"),
], ids=["text", "text-phase", "negative-phase", "compute", "comm"])
def test_s3_21_bench_refit_refuses_text_in_predicted_before_the_run(tmp_path, private_tmp,
                                                                   capsys, monkeypatch,
                                                                   predicted, needle):
    from test_bench_hostile import PREDICTED, FakeLaunch

    import fsdp_plan.cli.bench as bench_cli
    given = _write_doc(tmp_path, _plan_doc(predicted={**PREDICTED, **predicted}))
    fake = FakeLaunch()
    monkeypatch.setattr(bench_cli, "launch", fake)
    out, refit = tmp_path / "results", tmp_path / "hw.yaml"
    before = snapshot(tmp_path)
    refused(capsys, ["bench", given, "--nproc", "2", "--out", str(out), "--refit", str(refit)],
            2, needle)
    assert fake.calls == 0
    assert snapshot(tmp_path) == before and not out.exists() and not refit.exists()


# --- plans: offload is a version-2 field (S3-28) ----------------------------------------------

@pytest.mark.parametrize("offload", [{"params": True, "optimizer": True},
                                     {"params": False, "optimizer": False}],
                         ids=["on", "off"])
@pytest.mark.parametrize("verb", ["predict", "verify", "emit"])
def test_s3_28_offload_in_a_version_1_plan_is_refused_like_other_version_2_fields(
        tmp_path, capsys, monkeypatch, verb, offload):
    given = _write_doc(tmp_path, _plan_doc(fsdp_plan_version=1, offload=offload))
    monkeypatch.setattr(runtime, "load_planned_model", _no_model_loading)
    before = snapshot(tmp_path)
    argv = [verb, given] + (["-o", str(tmp_path / "policy.py")] if verb == "emit" else [])
    refused(capsys, argv, 2, "offload is set in a version-1 plan",
            "offload needs fsdp_plan_version: 2; write that, or remove offload")
    assert snapshot(tmp_path) == before
    # in the words a version-1 plan's checkpointing mapping is refused with
    refused(capsys, ["predict", _write_doc(tmp_path, _plan_doc(
        fsdp_plan_version=1, activation_checkpointing={"layers.0": "full"}), "map.yaml")], 2,
        "needs fsdp_plan_version: 2")


def test_s3_28_offload_in_a_version_2_plan_is_read():
    plan = Plan.from_dict(_plan_doc(fsdp_plan_version=2,
                                    offload={"params": True, "optimizer": True}))
    assert plan.offload.to_dict() == {"params": True, "optimizer": True}


# --- plans: a document of plain lists is not blamed on aliases (S3-25) ------------------------

def test_s3_25_a_huge_plan_of_plain_lists_is_refused_for_its_size_not_for_aliases(tmp_path,
                                                                                 capsys):
    """15.5 MB of plain lists under an unknown key (under the 16 MiB file limit): refused for
    holding more than a million values, the plan node bound, without a word of aliases."""
    import yaml
    row = "[" + ",".join(["1"] * 50) + "]"
    lines = [yaml.safe_dump(tiny_llama_plan(world=2).to_dict(), sort_keys=False), "junk:\n"]
    lines += [f"- {row}\n"] * int(15.5e6 // (len(row) + 3))
    given = tmp_path / "big.yaml"
    given.write_text("".join(lines))
    assert 15e6 < given.stat().st_size < 16 * 2**20
    before = snapshot(tmp_path)
    err = refused(capsys, ["predict", str(given)], 2, "holds more than 1,000,000 values",
                  "a plan is a few thousand values", "it is not a plan")
    assert "alias" not in err
    assert snapshot(tmp_path) == before


def test_s3_25_aliases_that_expand_a_plan_past_the_bound_are_still_named(tmp_path, capsys):
    import yaml
    bomb = "".join(f"b{i}: &b{i} [{', '.join([f'*b{i - 1}'] * 9)}]\n" if i else
                   "b0: &b0 [1, 1, 1, 1, 1, 1, 1, 1, 1]\n" for i in range(9))
    given = tmp_path / "bomb.yaml"
    given.write_text(yaml.safe_dump(tiny_llama_plan(world=2).to_dict(), sort_keys=False) + bomb)
    refused(capsys, ["predict", str(given)], 2, "expands to more than 1,000,000 values",
            "anchors and aliases repeating each other")


# --- verify at a million ranks: FSDP2's padding in one step (S3-29) ---------------------------

def _measure(plan_obj: Plan, path: str):
    from fsdp_plan.measure.memory import measure_peak
    loaded = runtime.load_planned_model(plan_obj, None, path)
    return measure_peak(loaded, plan_obj, runtime.load_policy(runtime.policy_source(plan_obj)))


def test_s3_29_one_shared_empty_shard_measures_what_fsdp2_measures(tmp_path, monkeypatch):
    """[Note: one empty shard for every absent rank]: at 512 ranks (tiny Llama, two blocks, so
    most ranks get empty shards of every parameter) the measurement with the shared padding
    equals FSDP2's own, every figure of it."""
    import contextlib

    from fsdp_plan.measure import memory
    small = tiny_llama_plan(world=512, n_layers=2)
    path = plan_file(tmp_path, small)
    fast = _measure(small, path)
    monkeypatch.setattr(memory, "one_empty_shard", contextlib.nullcontext)
    slow = _measure(small, path)
    assert fast.peak_bytes == slow.peak_bytes > 0
    assert fast.breakdown == slow.breakdown
    assert fast.module_peaks == slow.module_peaks
    assert fast.step_start_bytes == slow.step_start_bytes
    from torch.distributed.fsdp._fully_shard import _fsdp_common, _fsdp_param
    assert _fsdp_param._chunk_with_empty is _fsdp_common._chunk_with_empty  # restored


@pytest.mark.slow
def test_s3_29_verify_at_a_million_ranks_pads_each_parameter_once(tmp_path, capsys,
                                                                  monkeypatch):
    """verify at world 1,048,576 (the plan format's largest) answers: each of FSDP2's
    parameter splits pads the absent ranks with one empty tensor, not a million (before: about
    2 ms per rank, 35 minutes)."""
    from fsdp_plan.measure import fake_shards
    real = fake_shards.chunk_with_one_empty
    splits: list[tuple[int, int, int]] = []  # ranks, distinct tensors handed out, dim-0 length

    def counted(tensor, num_chunks, dim):
        chunks = real(tensor, num_chunks, dim)
        splits.append((num_chunks, len({id(c) for c in chunks}), tensor.shape[dim]))
        return chunks
    monkeypatch.setattr(fake_shards, "chunk_with_one_empty", counted)
    doc = tiny_llama_plan(world=2**20).to_dict()
    doc["budget_bytes"] = 10**12
    given = _write_doc(tmp_path, doc)
    before = snapshot(tmp_path)
    assert main(["verify", given]) == 0
    captured = capsys.readouterr()
    assert "at world size 1048576 (mesh 1x1048576)" in captured.out
    assert "verify: OK" in captured.out and "Traceback" not in captured.err
    assert splits and all(ranks == 2**20 for ranks, _, _ in splits)
    assert all(distinct <= rows + 1 for _, distinct, rows in splits)  # its rows and one pad
    assert snapshot(tmp_path) == before
