"""Hardware files (SPEC 6) and the hardware a plan keeps (SPEC 7), through the real CLI.

Issue 21 (S3-02, S3-04 to S3-09, S3-27) and issue 19 item 5. Every refusal keeps the SPEC 2
contract: exit 2, a message naming the field, its value and what is accepted, no traceback,
nothing on stdout and no file written.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import yaml
from cli_checks import refused

from fsdp_plan.cli.main import main
from fsdp_plan.cost.hardware import GPUS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA = os.path.join(ROOT, "examples", "llama.py")

# its plans and predictions of the same small models share their analyses (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("facts_cache_per_file")


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> str:
    """The issue's plan: tiny Llama, 2 ranks, full sharding, on the h100 preset."""
    folder = tmp_path_factory.mktemp("hw")
    path = str(folder / "full.yaml")
    assert main([LLAMA, "--model-arg", "size=tiny", "--mem", "80GB", "--world-size", "2",
                 "--seq-len", "64", "--strategy", "full", "--format", "json",
                 "--plan", path]) == 0
    return path


def write_yaml(folder, name: str, doc) -> str:
    path = folder / name
    path.write_text(doc if isinstance(doc, str) else yaml.safe_dump(doc, sort_keys=False))
    return str(path)


def read_yaml(path: str):
    with open(path) as f:
        return yaml.safe_load(f)


def predicted(capsys, plan: str, *flags: str) -> dict:
    capsys.readouterr()
    assert main(["predict", plan, "--format", "json", *flags]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)["predicted"]




# --- S3-02: a base figure reaches the tables fitted at it -----------------------------------

# Communication is bus time alone: no latency, no launch cost, no FSDP copies around it.
BUS_ONLY = {"collective_latency_s": 0, "launch_overhead_s": 0,
            "fsdp_s_per_byte": {"all_gather": {"1": 0}, "reduce_scatter": {"1": 0}}}


def test_a_slower_link_slows_communication_by_its_factor(planned, tmp_path, capsys):
    """The issue's case first (360x slower link: more communication than without the file),
    then exactly: with communication pure bus time, a 10x slower link is 10x the time."""
    preset = predicted(capsys, planned)
    slow = predicted(capsys, planned, "--hardware",
                     write_yaml(tmp_path, "slow.yaml", {"intra_node_bandwidth": 1.0e9}))
    assert slow["total_comm_s"] > preset["total_comm_s"]
    assert slow["step_time_s"] > preset["step_time_s"]
    fast = predicted(capsys, planned, "--hardware", write_yaml(
        tmp_path, "a.yaml", {**BUS_ONLY, "intra_node_bandwidth": 1.0e8}))
    slower = predicted(capsys, planned, "--hardware", write_yaml(
        tmp_path, "b.yaml", {**BUS_ONLY, "intra_node_bandwidth": 1.0e7}))
    assert fast["total_comm_s"] > 1e-3  # well above the 1e-6 rounding of the plan's figures
    assert slower["total_comm_s"] == pytest.approx(10 * fast["total_comm_s"], rel=1e-4)
    assert slower["compute_s"] == fast["compute_s"]


def test_a_lower_peak_slows_compute_by_its_factor(planned, tmp_path, capsys):
    """The preset's per-op rates follow peak_flops: 10x lower peak, 10x the matmul and
    attention time (host overheads off, memory-bound ops at the fastest memory accepted)."""
    quiet = {"op_overhead_s": 0, "memory_bandwidth": 1e15}
    base = predicted(capsys, planned, "--hardware", write_yaml(
        tmp_path, "base.yaml", {**quiet, "peak_flops": 1e10}))
    low = predicted(capsys, planned, "--hardware", write_yaml(
        tmp_path, "low.yaml", {**quiet, "peak_flops": 1e9}))
    assert base["compute_s"] > 1e-2
    assert low["compute_s"] == pytest.approx(10 * base["compute_s"], rel=1e-3)
    # the issue's case: 989x lower FLOP/s is not the preset's step any more (the host's floor,
    # the same for both, off: a tiny Llama on an H100 waits for its host, [Note: the host
    # floor]; unit_overhead_s follows op_overhead_s to 0)
    host_off = {"op_overhead_s": 0}
    issue = predicted(capsys, planned, "--hardware", write_yaml(
        tmp_path, "issue.yaml", {**host_off, "peak_flops": 1.0e10}))
    preset = predicted(capsys, planned, "--hardware", write_yaml(tmp_path, "preset.yaml",
                                                                 host_off))
    assert issue["compute_s"] > 10 * preset["compute_s"]
    # with the floor the file still moves the step: the device is now the slower
    floored = predicted(capsys, planned, "--hardware", write_yaml(
        tmp_path, "floored.yaml", {"peak_flops": 1.0e10}))
    assert floored["compute_s"] > 2 * predicted(capsys, planned)["compute_s"]


def test_rescaled_tables_equal_the_same_tables_written_out(planned, tmp_path, capsys):
    """A file that sets peak_flops alone predicts what a file with the preset's per-op rates
    scaled by the same ratio, written as tables, predicts: those are taken as written."""
    h100 = GPUS["h100"]
    ratio = 1e11 / h100.peak_flops
    short = predicted(capsys, planned, "--hardware", write_yaml(
        tmp_path, "short.yaml", {"peak_flops": 1e11}))
    written = predicted(capsys, planned, "--hardware", write_yaml(tmp_path, "long.yaml", {
        "peak_flops": 1e11,
        "matmul_flops": {d: {c: v * ratio for c, v in t.items()}
                         for d, t in h100.matmul_flops.items()},
        "attention_flops": {d: v * ratio for d, v in h100.attention_flops.items()}}))
    assert short == written
    # a table written beside its base figure is taken as written, not rescaled
    mine = predicted(capsys, planned, "--hardware", write_yaml(tmp_path, "mine.yaml", {
        "peak_flops": 1e11, "matmul_flops": {d: dict(t) for d, t in h100.matmul_flops.items()},
        "attention_flops": dict(h100.attention_flops)}))
    assert mine["compute_s"] == predicted(capsys, planned)["compute_s"]


def test_each_base_figure_rescales_its_own_tables():
    from fsdp_plan.cost.hardware import hardware_for
    h100 = GPUS["h100"]
    hw = hardware_for("h100", {"intra_node_bandwidth": 36e9, "collective_latency_s": 40e-6,
                               "hbm_bandwidth": 3.35e11, "efficiency": 0.25})
    for kind, groups in hw.collectives.items():
        for group, fit in groups.items():
            was = h100.collectives[kind][group]
            assert fit["bus_bandwidth"] == pytest.approx(was["bus_bandwidth"] / 10)
            assert fit["latency_s"] == pytest.approx(was["latency_s"] * 2)
    assert hw.memory_bandwidth == pytest.approx(h100.memory_bandwidth / 10)
    assert hw.matmul_flops["float32"]["large"] == pytest.approx(
        h100.matmul_flops["float32"]["large"] / 2)
    assert hw.attention_flops["bfloat16"] == pytest.approx(h100.attention_flops["bfloat16"] / 2)
    assert "collectives.bus_bandwidth x0.1" in hw.source and "matmul_flops x0.5" in hw.source
    # no latency at all: every fitted latency goes to 0 with it
    zero = hardware_for("h100", {"collective_latency_s": 0})
    assert all(fit["latency_s"] == 0 for g in zero.collectives.values() for fit in g.values())
    # the same figure as the preset's changes nothing, and says nothing
    assert hardware_for("h100", {"peak_flops": 989e12}) == h100


# --- S3-07, S3-27, S3-09: hardware files get the plan file's guards ------------------------

# Imported => leaves a marker: a refusal "before any work" must leave none.
MARKED = """\
import os
from torch import nn
open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "imported.marker"), "w").close()

def build_model():
    return nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 4))
"""

BOMB = "".join(f"l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]\n" if i else
               "l0: &l0 [1, 1, 1, 1, 1, 1, 1, 1, 1]\n" for i in range(9))


@pytest.mark.parametrize("text,needles", [
    (BOMB, ["expands to more than 10,000 values", "anchors and aliases",
            "a hardware file is a few dozen values"]),
    ("a: &a [*a]\n", ["recursive alias *a", "a hardware file is a tree"]),
    ("collectives: " + "[" * 20 + "]" * 20 + "\n", ["more than 16 deep",
                                                     "a hardware file nests 4 deep"]),
    ("peak_flops: 1.0e15\npeak_flops: 1.0e12\n", ["the key 'peak_flops' twice", "line 2",
                                                  "keep only the last"]),
    ("collectives:\n  all_gather: {'8': {bus_bandwidth: 1e9}, '8': {bus_bandwidth: 2e9}}\n",
     ["the key '8' twice"]),
    ("peak_flops: 1" + "0" * 5000 + "\n", ["cannot turn into data", "4300"]),
    ("peak_flops: !!float 1e12\n", ["YAML tag", "constructs no tagged values"]),
    ("\0peak_flops: 1\n", ["binary data", "a hardware file is YAML text"]),
])
def test_hostile_hardware_files_are_refused_before_any_work(tmp_path, capsys, text, needles):
    model = tmp_path / "model.py"
    model.write_text(MARKED)
    hw = tmp_path / "hw.yaml"
    hw.write_text(text)
    refused(capsys, [str(model), "--mem", "80GB", "--hardware", str(hw), "--plan",
                     str(tmp_path / "p.yaml"), "-o", str(tmp_path / "p.py")],
            f"--hardware {str(hw)!r}", *needles)
    assert sorted(os.listdir(tmp_path)) == ["hw.yaml", "model.py"]  # no marker, no output


def test_the_alias_bomb_is_refused_at_once():
    """The issue's 416-byte file took 45-65 s and gigabytes; the event walk stops at the
    first mapping past the bound without building a value (a bound on work, not a timing)."""
    import yaml

    from fsdp_plan.common.errors import BadInput
    from fsdp_plan.common.safe_yaml import load_yaml
    from fsdp_plan.cost.hardware.hardware import HARDWARE_DOCUMENT
    events = sum(1 for _ in yaml.parse(BOMB))
    assert events < 200 and len(BOMB) < 600  # 9**9 values once expanded
    with pytest.raises(BadInput, match="expands to more than 10,000 values at line 5"):
        load_yaml(BOMB.encode(), "--hardware 'hw.yaml'", HARDWARE_DOCUMENT)


# --- S3-06, S3-08, S3-09: every figure bounded at reading -----------------------------------

@pytest.mark.parametrize("text,needles", [
    ("peak_flops: 1.0e-300\n", ["peak_flops 1e-300 is out of range",
                                "from 1e+06 to 1e+18 FLOP/s"]),
    ("intra_node_bandwidth: 5e-324\n", ["intra_node_bandwidth '5e-324' is out of range",
                                        "from 1e+06 to 1e+15 bytes/s"]),
    ("memory_bandwidth: 5.0e-324\n", ["memory_bandwidth 5e-324", "or 0 (0.8 x hbm_bandwidth)"]),
    ("efficiency: 1.0e-300\n", ["efficiency 1e-300", "from 0.001 to 1"]),
    ("collective_latency_s: 5.0e-324\n", ["collective_latency_s 5e-324",
                                          "from 1e-15 to 10 seconds, or 0 (none)"]),
    ("matmul_flops: {bfloat16: {large: 1.0e-300}}\n", ["matmul_flops.bfloat16.large 1e-300",
                                                       "from 1e+06"]),
    ("collectives: {all_gather: {'8': {bus_bandwidth: 5.0e-324}}}\n",
     ["collectives.all_gather.8.bus_bandwidth 5e-324", "from 1e+06 to 1e+15 bytes/s"]),
    ("fsdp_s_per_byte: {all_gather: {'1024': 1.0e-300}}\n",
     ["fsdp_s_per_byte.all_gather.1024 1e-300", "or 0 (free)"]),
    ("peak_flops: 1" + "0" * 400 + "\n", ["peak_flops a 1329-bit number is out of range"]),
    ("h2d_bandwidth: -1.0e+400\n", ["h2d_bandwidth -inf is out of range"]),
    # S3-08: digits int() refuses
    ("collectives: {all_gather: {'²': {bus_bandwidth: 1.0e+9}}}\n",
     ["collectives.all_gather.²", "group size '²'", "digits 0-9"]),
    ("fsdp_s_per_byte: {reduce_scatter: {'٣٢': 1.0e-12}}\n",
     ["fsdp_s_per_byte.reduce_scatter", "unit size '٣٢'", "digits 0-9"]),
    ("collectives: {all_gather: {'99999999': {bus_bandwidth: 1.0e+9}}}\n",
     ["group size '99999999'", "at most 1,048,576"]),
    ("name: \"h100\\nbold\"\n", ["name is 'h100\\nbold'", "one printable line"]),
])
def test_figures_out_of_bounds_are_refused_with_the_range(planned, tmp_path, capsys, text,
                                                          needles):
    hw = write_yaml(tmp_path, "hw.yaml", text)
    for argv in (["predict", planned, "--hardware", hw],
                 [LLAMA, "--model-arg", "size=tiny", "--mem", "80GB", "--hardware", hw,
                  "--plan", str(tmp_path / "p.yaml")]):
        refused(capsys, argv, f"--hardware {hw!r}", *needles)
    assert os.listdir(tmp_path) == ["hw.yaml"]


def test_the_slowest_accepted_figures_give_finite_plans(tmp_path, capsys):
    """At the lowest bounds every figure the plan holds is finite, and the plan reads back
    (peak_flops 1e-300 wrote mfu: .inf, which predict then refused)."""
    hw = write_yaml(tmp_path, "hw.yaml", {
        "peak_flops": 1e6, "efficiency": 1e-3, "hbm_bandwidth": 1e6, "memory_bandwidth": 1e6,
        "intra_node_bandwidth": 1e6, "inter_node_bandwidth": 1e6,
        "matmul_flops": {"bfloat16": {"large": 1e6}}, "attention_flops": {"bfloat16": 1e6}})
    plan = str(tmp_path / "p.yaml")
    capsys.readouterr()
    assert main([LLAMA, "--model-arg", "size=tiny", "--mem", "80GB", "--world-size", "2",
                 "--seq-len", "64", "--strategy", "full", "--hardware", hw,
                 "--format", "json", "--plan", plan]) == 0
    stored = read_yaml(plan)["predicted"]
    assert all(math.isfinite(v) for v in
               (stored["step_time_s"], stored["mfu"], stored["tokens_per_s"]))
    assert stored["step_time_s"] > 1.0
    assert predicted(capsys, plan, "--hardware", hw)["step_time_s"] == stored["step_time_s"]


# --- S3-05: h2d_bandwidth 0 means not measured ----------------------------------------------

TIGHT = [LLAMA, "--model-arg", "size=tiny", "--mem", "3MB", "--headroom", "0", "--world-size",
         "2", "--seq-len", "64", "--strategy", "full"]


def test_offload_is_not_priced_without_a_measured_host_link(tmp_path, capsys):
    """What calibrate writes on a CPU (h2d_bandwidth: 0) priced offload copies at a GPU
    host's PCIe rate; now --allow-offload is refused before any work, a plan already
    offloaded cannot be predicted on it, and without --allow-offload the no-fit answer (exit
    3) stands, without offering offload it cannot price."""
    hw = write_yaml(tmp_path, "cpu.yaml", {"name": "calibrated-cpu", "h2d_bandwidth": 0})
    model = tmp_path / "model.py"
    model.write_text(MARKED)
    refused(capsys, [str(model), "--mem", "80GB", "--allow-offload", "--hardware", hw,
                     "--plan", str(tmp_path / "p.yaml")],
            "offload copies cannot be priced on hardware 'calibrated-cpu'",
            "h2d_bandwidth is 0, which means not measured", "e.g. 50e9", "--allow-offload")
    assert sorted(os.listdir(tmp_path)) == ["cpu.yaml", "model.py"]
    offloaded = str(tmp_path / "offloaded.yaml")
    assert main([*TIGHT, "--allow-offload", "--format", "json", "--plan", offloaded]) == 0
    assert read_yaml(offloaded)["offload"] == {"params": True, "optimizer": True}
    capsys.readouterr()
    refused(capsys, ["predict", offloaded, "--hardware", hw],
            "offload copies cannot be priced", "h2d_bandwidth")
    err = refused(capsys, [*TIGHT, "--hardware", hw], "plan fits", code=3)
    assert "With --allow-offload it would fit" not in err
    assert sorted(os.listdir(tmp_path)) == ["cpu.yaml", "model.py", "offloaded.yaml"]


# --- S3-04: predict's --gpus-per-node and the plan's gpus_per_node -------------------------

def edited(planned: str, tmp_path, change) -> str:
    doc = read_yaml(planned)
    change(doc)
    return write_yaml(tmp_path, "edited.yaml", doc)


@pytest.mark.parametrize("value,needles", [
    ("0", ["--gpus-per-node 0 is outside 1..1,024", "8 on DGX/HGX"]),
    ("-4", ["--gpus-per-node -4 is outside 1..1,024"]),
    ("1025", ["--gpus-per-node 1025 is outside 1..1,024"]),
])
def test_predict_bounds_gpus_per_node_as_planning_does(planned, capsys, value, needles):
    refused(capsys, ["predict", planned, "--gpus-per-node", value], *needles)


@pytest.mark.parametrize("value,needles", [
    ("eight", ["predicted.gpus_per_node must be a whole number, got 'eight'",
               "from 1 to 1024"]),
    (0, ["predicted.gpus_per_node is 0, outside 1..1024"]),
    (True, ["predicted.gpus_per_node must be a whole number, got true"]),
])
def test_a_plans_gpus_per_node_is_checked_with_the_plan(planned, tmp_path, capsys, value,
                                                        needles):
    plan = edited(planned, tmp_path, lambda d: d["predicted"].update(gpus_per_node=value))
    for verb in ("predict", "verify"):
        refused(capsys, [verb, plan], *needles)


def test_predict_wants_whole_nodes(planned, tmp_path, capsys):
    """Six ranks on nodes of four leave a node half full: planning refuses that layout, and
    so does predict (naming a --gpus-per-node that fits)."""
    def six(doc):
        doc["world_size"], doc["mesh"] = 6, {"replicate": 1, "shard": 6}
    plan = edited(planned, tmp_path, six)
    refused(capsys, ["predict", plan, "--gpus-per-node", "4"],
            "world_size 6 is not a multiple of --gpus-per-node 4", "nodes must be full",
            "(e.g. 3)")
    # the plan's own gpus_per_node (SPEC 8), or where plans before it kept one, is checked
    # with the plan, naming the field (issue 31, S4-06)
    plan = edited(planned, tmp_path, lambda d: (six(d), d.update(gpus_per_node=4)))
    refused(capsys, ["predict", plan], "gpus_per_node is 4, which does not divide world_size 6")
    plan = edited(planned, tmp_path, lambda d: (six(d), d.pop("gpus_per_node", None),
                                                d["predicted"].update(gpus_per_node=4)))
    refused(capsys, ["predict", plan],
            "predicted.gpus_per_node is 4, which does not divide world_size 6")


# --- issue 19 item 5: plans keep their hardware (SPEC 7) ------------------------------------

CALIBRATED = os.path.join(ROOT, "benchmarks", "results", "closed_loop_hw.yaml")


def fake_time_plans(source, plans, *, nproc, mesh, steps, warmup, **kwargs):
    """tune's bench without workers: every plan 1.0 s per step (1% jitter), both ranks."""
    return [[[1.0 * (1 + 0.01 * (i % 3 - 1)) for i in range(steps)]] * nproc for _ in plans]


def fake_held_twin(source, plan, *, nproc, mesh, steps, warmup, **kwargs):
    """tune's baseline launch without workers: its steps, and a held twin 10 ms slower."""
    [times] = fake_time_plans(source, [plan], nproc=nproc, mesh=mesh, steps=steps,
                              warmup=warmup)
    run = {"comm": {"backward_compute_s": 0.5, "backward_hidden_s": 0.01},
           "phases_s": {"backward": 0.5, "tail": 0.0}}
    return times, run, {**run, "phases_s": {"backward": 0.51}, "how": "held by a fake"}


@pytest.fixture(scope="module")
def calibrated_plan(tmp_path_factory) -> dict:
    """The tiny Llama planned with a file fsdp-plan calibrate wrote (this repo's closed loop),
    then the file deleted: what each verb must do without it."""
    folder = tmp_path_factory.mktemp("calibrated")
    hw = folder / "cpu.yaml"
    hw.write_bytes(Path(CALIBRATED).read_bytes())
    plan, policy = str(folder / "plan.yaml"), str(folder / "policy.py")
    assert main([LLAMA, "--model-arg", "size=tiny", "--mem", "80GB", "--world-size", "2",
                 "--seq-len", "64", "--strategy", "full", "--hardware", str(hw),
                 "--format", "json", "--plan", plan, "-o", policy]) == 0
    hw.unlink()
    return {"plan": plan, "policy": policy, "folder": folder}


def test_the_plan_stores_every_figure_and_where_it_came_from(calibrated_plan):
    import hashlib

    from fsdp_plan.cost.hardware import hardware_for, read_hardware_file
    from fsdp_plan.plan.emit import load_policy_module
    doc = read_yaml(calibrated_plan["plan"])
    block = doc["hardware"]
    assert list(doc)[list(doc).index("gpu") + 1] == "hardware"
    assert block["file"] == "cpu.yaml"
    assert block["sha256"] == hashlib.sha256(Path(CALIBRATED).read_bytes()).hexdigest()
    assert block["header"].startswith("Hardware file written by fsdp-plan calibrate")
    calibrated = hardware_for("h100", read_hardware_file(CALIBRATED))
    assert block["figures"] == calibrated.to_dict()
    assert doc["gpu"] == calibrated.name
    # the policy module's PLAN is the YAML, hardware included
    assert load_policy_module(calibrated_plan["policy"]).PLAN == doc


def test_predict_verify_and_tune_need_no_flag_after_the_file_is_gone(calibrated_plan, capsys,
                                                                     monkeypatch):
    plan, folder = calibrated_plan["plan"], calibrated_plan["folder"]
    stored = read_yaml(plan)["predicted"]
    assert not (folder / "cpu.yaml").exists()
    again = predicted(capsys, plan)
    for key in ("step_time_s", "exposed_comm_s", "total_comm_s", "compute_s", "phases_s",
                "peak_bytes", "collectives_per_step"):
        assert again[key] == stored[key], key
    # the calibrated CPU is far slower than the h100 preset: the figures are really used
    assert stored["step_time_s"] > 2 * predicted(capsys, plan, "--gpu", "h100")["step_time_s"]
    # --hardware still overrides: the preset (the plan's name is no preset: h100) with it over
    other = write_yaml(folder, "other.yaml", {"peak_flops": 1e10})
    assert predicted(capsys, plan, "--hardware", other)["compute_s"] != stored["compute_s"]

    capsys.readouterr()
    assert main(["verify", plan, "--format", "json"]) == 0
    checked = json.loads(capsys.readouterr().out)
    assert checked["fresh_prediction"] and checked["ok"]
    assert not any("cannot be predicted" in n for n in checked["notes"]), checked["notes"]

    import fsdp_plan.bench.timing
    monkeypatch.setattr(fsdp_plan.bench.timing, "time_plans", fake_time_plans)
    monkeypatch.setattr(fsdp_plan.bench.timing, "time_with_held_twin", fake_held_twin)
    out = folder / "tuned"
    assert main(["tune", plan, "--nproc", "2", "--steps", "4", "--warmup", "1",
                 "--budget-minutes", "1", "--out", str(out), "--format", "json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["trials"][0]["knob"] == "baseline"
    assert record["trials"][0]["predicted_step_s"] == pytest.approx(stored["step_time_s"],
                                                                    abs=1e-6)
    for key in ("best_plan", "rollback_plan"):
        assert read_yaml(record[key])["hardware"] == read_yaml(plan)["hardware"]


def test_a_preset_plan_records_only_its_gpu(planned):
    doc = read_yaml(planned)
    assert doc["gpu"] == "h100" and "hardware" not in doc


def test_refit_starts_from_the_stored_figures(calibrated_plan, tmp_path):
    """bench --refit into a new file begins from the figures the plan was predicted with (the
    factors are measured against that prediction), not from the plan's name."""
    from fsdp_plan.bench.refit import refit
    from fsdp_plan.cost.hardware import hardware_for, read_hardware_file
    from fsdp_plan.cost.hardware.stored import hardware_of
    start = hardware_of(read_yaml(calibrated_plan["plan"])["hardware"])
    result = {"path": "run.json",
              "step_time": {"median_s": 2.0, "predicted_s": 1.0,
                            "phases": {"measured": {"forward": 0.8, "backward": 1.0,
                                                    "optimizer": 0.2},
                                       "predicted": {"forward": 0.4, "backward": 0.5,
                                                     "optimizer": 0.1}}},
              "predicted_extra": {"compute_s": 0.8, "total_comm_s": 0.1},
              "comm": {"rank0": {"step_s": 2.0, "compute_s": 1.6, "comm_s": 0.2}}}
    path = tmp_path / "refit.yaml"
    new, f = refit(str(path), start.name, result, start)
    assert new.name == start.name and f["compute"] == pytest.approx(2.0)
    assert new.matmul_flops["float32"]["large"] == pytest.approx(
        start.matmul_flops["float32"]["large"] / 2)
    assert hardware_for("h100", read_hardware_file(str(path))) == new


@pytest.mark.parametrize("change,needles", [
    (lambda h: h["figures"].update(peak_flops=0), [("hardware.figures: peak_flops 0 is out "
                                                    "of range"), "from 1e+06"]),
    (lambda h: h["figures"].update(peak_flops=1.0e-300), ["peak_flops 1e-300"]),
    (lambda h: h["figures"]["collectives"]["all_gather"].update({"²": {"bus_bandwidth": 1e9}}),
     ["group size '²'"]),
    (lambda h: h.update(colour="red"), ["hardware.colour is not a key", "figures"]),
    (lambda h: h.pop("figures"), ["hardware has no figures"]),
    (lambda h: h.update(sha256="xyz"), ["hardware.sha256 must be 64"]),
    (lambda h: h["figures"].update(h2d_bandwidth=float("inf")),
     ["hardware.figures.h2d_bandwidth is .inf", "finite numbers only"]),
    (lambda h: h["figures"].update(h2d_bandwidth="fast"), ["h2d_bandwidth is 'fast' (str)"]),
])
def test_the_stored_hardware_is_checked_with_the_plan(calibrated_plan, tmp_path, capsys,
                                                      change, needles):
    doc = read_yaml(calibrated_plan["plan"])
    change(doc["hardware"])
    plan = write_yaml(tmp_path, "edited.yaml", doc)
    before = sorted(os.listdir(tmp_path))
    for verb in ("predict", "verify", "tune"):
        refused(capsys, [verb, plan, "--out", str(tmp_path / "t")] if verb == "tune"
                else [verb, plan], f"plan file {plan!r}", *needles)
    assert sorted(os.listdir(tmp_path)) == before


def test_duplicate_figures_in_a_plan_are_refused(calibrated_plan, tmp_path, capsys):
    text = Path(calibrated_plan["plan"]).read_text().replace(
        "    peak_flops:", "    peak_flops: 1.0e+12\n    peak_flops:", 1)
    plan = write_yaml(tmp_path, "dup.yaml", text)
    refused(capsys, ["predict", plan], "the key 'peak_flops' twice")
