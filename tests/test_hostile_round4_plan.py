"""Issue 31 (round 4): plan-validation defects, each replayed from its reproduction.

- S4-06: plans record ``gpus_per_node`` (SPEC 8); predict and export read it from the plan.
- S4-10: unknown keys are refused at every level, the closest known key named (one
  declaration of the plan's fields, plan/schema.py).
- S4-20: every verb reads a plan through the same validation; messages name the plan field.
- S4-05: what planning writes from a hardware file always reads back.
- S4-16: a Python ``PlanRequest`` is bounded as the plan it writes is.

Refusals keep the failure contract: exit 2, one paragraph, no traceback, nothing written.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from test_measure_helpers import LLAMA, run_cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = [LLAMA, "--model-arg", "size=tiny", "--seq-len", "32"]


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def refused(argv: list[str], *words: str) -> str:
    """Run ``fsdp-plan ARGV``: exit 2, one paragraph naming ``words``, no traceback."""
    code, out, err = run_cli(argv)
    assert code == 2, (code, out, err)
    text = err.strip()
    assert "Traceback" not in err and "\n\n" not in text, err
    for word in words:
        assert word in text, (word, text)
    return text


@pytest.fixture(scope="module")
def hsdp_plan(tmp_path_factory) -> Path:
    """The tiny Llama planned for 2 nodes of 4 GPUs (HSDP 2 x 4)."""
    path = tmp_path_factory.mktemp("hsdp") / "plan.yaml"
    code, _, err = run_cli([*TINY, "--mem", "1GB", "--world-size", "8", "--gpus-per-node", "4",
                            "--strategy", "hybrid", "--plan", str(path), "--format", "json"])
    assert code == 0, err
    return path


# --- S4-06: plans record gpus_per_node --------------------------------------------------------

def test_s4_06_the_plan_records_gpus_per_node_and_predict_reads_it(hsdp_plan):
    import json

    doc = yaml.safe_load(hsdp_plan.read_text())
    assert doc["gpus_per_node"] == 4 and doc["mesh"] == {"replicate": 2, "shard": 4}
    assert list(doc).index("gpus_per_node") == list(doc).index("world_size") + 1
    code, out, err = run_cli(["predict", str(hsdp_plan), "--format", "json"])
    assert code == 0, err
    again = json.loads(out)["predicted"]
    # with no flag the plan is predicted for the nodes it was planned for: as planning said
    for key in ("peak_bytes", "step_time_s", "total_comm_s", "exposed_comm_s"):
        assert again[key] == doc["predicted"][key], key
    code, out, err = run_cli(["predict", str(hsdp_plan), "--format", "json",
                              "--gpus-per-node", "8"])
    assert code == 0, err  # the flag still overrides: one node, no traffic across nodes
    assert json.loads(out)["predicted"]["total_comm_s"] < doc["predicted"]["total_comm_s"]


def test_s4_06_export_lays_out_the_nodes_the_plan_was_made_for(hsdp_plan, tmp_path):
    code, _, err = run_cli(["export", str(hsdp_plan), "--to", "accelerate", "-o",
                            str(tmp_path / "acc")])
    assert code == 0, err
    config = yaml.safe_load((tmp_path / "acc" / "accelerate_config.yaml").read_text())
    assert (config["num_machines"], config["num_processes"]) == (2, 8)
    code, _, err = run_cli(["export", str(hsdp_plan), "--to", "lightning", "-o",
                            str(tmp_path / "light")])
    assert code == 0, err
    trainer = yaml.safe_load((tmp_path / "light" / "lightning_config.yaml").read_text())
    assert (trainer["trainer"]["num_nodes"], trainer["trainer"]["devices"]) == (2, 4)


def test_s4_06_a_plan_without_gpus_per_node_reads_as_before(hsdp_plan, tmp_path):
    from fsdp_plan.plan.document import Plan

    doc = yaml.safe_load(hsdp_plan.read_text())
    del doc["gpus_per_node"]
    assert Plan.from_dict(doc).node_gpus == 8
    doc["predicted"]["gpus_per_node"] = 4  # where predict looked before (issue 21, S3-04)
    assert Plan.from_dict(doc).node_gpus == 4


@pytest.mark.parametrize("value, words", [(0, ["gpus_per_node", "outside 1..1024"]),
                                          (3, ["gpus_per_node", "does not divide world_size 8"]),
                                          ("4", ["gpus_per_node", "whole number"])])
def test_s4_06_a_bad_gpus_per_node_is_refused_naming_the_field(hsdp_plan, tmp_path, value,
                                                               words):
    doc = yaml.safe_load(hsdp_plan.read_text())
    doc["gpus_per_node"] = value
    given = tmp_path / "plan.yaml"
    given.write_text(yaml.safe_dump(doc, sort_keys=False))
    before = snapshot(tmp_path)
    text = refused(["predict", str(given)], *words)
    assert "--gpus-per-node" not in text
    assert snapshot(tmp_path) == before


# --- S4-10: unknown keys are refused at every level, the closest known key named -------------

def _edited(hsdp_plan: Path, folder: Path, edit) -> Path:
    doc = yaml.safe_load(hsdp_plan.read_text())
    edit(doc)
    given = folder / "given.yaml"
    given.write_text(yaml.safe_dump(doc, sort_keys=False))
    return given


@pytest.mark.parametrize("verb", ["emit", "predict", "export"])
def test_s4_10_a_misspelt_top_level_key_is_refused_naming_the_key_meant(hsdp_plan, tmp_path,
                                                                        verb):
    """``activation_checkpointng:`` was dropped: a policy without checkpointing, exit 0."""
    given = _edited(hsdp_plan, tmp_path, lambda d: d.update(
        activation_checkpointng=["layers.0"]))
    before = snapshot(tmp_path)
    extra = {"emit": ["-o", str(tmp_path / "policy.py")], "predict": [],
             "export": ["--to", "accelerate", "-o", str(tmp_path / "out")]}[verb]
    refused([verb, str(given), *extra], "activation_checkpointng is not a key",
            "did you mean activation_checkpointing?")
    assert snapshot(tmp_path) == before


NESTED = {
    "model": (lambda d: d["model"].update(seqlen=64), "model.seqlen", "seq_len"),
    "mesh": (lambda d: d["mesh"].update(replicat=2), "mesh.replicat", "replicate"),
    "units": (lambda d: d["units"][0].update(reshard_after_foward=False),
              "units[0].reshard_after_foward", "reshard_after_forward"),
    "mixed_precision": (lambda d: d["mixed_precision"].update(param_dtyp="float32"),
                        "mixed_precision.param_dtyp", "param_dtype"),
    "offload": (lambda d: d.update(fsdp_plan_version=2, offload={"param": True}),
                "offload.param", "params"),
    "compile": (lambda d: d.update(fsdp_plan_version=2, compile={"block": True}),
                "compile.block", "blocks"),
    "predicted": (lambda d: d["predicted"].update(peak_byte=1), "predicted.peak_byte",
                  "peak_bytes"),
}


@pytest.mark.parametrize("case", sorted(NESTED))
def test_s4_10_a_misspelt_nested_key_is_refused_naming_the_key_meant(hsdp_plan, case):
    from fsdp_plan.common.errors import BadInput
    from fsdp_plan.plan.document import Plan

    edit, path, meant = NESTED[case]
    doc = yaml.safe_load(hsdp_plan.read_text())
    edit(doc)
    with pytest.raises(BadInput) as error:
        Plan.from_dict(doc)
    assert f"{path} is not a key" in str(error.value)
    assert f"did you mean {meant}?" in str(error.value)


def test_s4_10_ddp_and_hardware_keys_are_refused_too(hsdp_plan):
    from fsdp_plan.common.errors import BadInput
    from fsdp_plan.plan.document import Plan

    doc = yaml.safe_load(hsdp_plan.read_text())
    ddp = {**doc, "fsdp_plan_version": 2, "strategy": "ddp", "mesh": {"replicate": 8, "shard": 1},
           "units": [{"modules": [""], "reshard_after_forward": False}], "forward_prefetch": {},
           "backward_prefetch": {}, "ddp": {"bucket_cap": 25}}
    with pytest.raises(BadInput, match=r"ddp\.bucket_cap is not a key.*did you mean "
                                       r"bucket_cap_mb\?"):
        Plan.from_dict(ddp)
    hardware = {**doc, "hardware": {"figure": {"name": "h100"}}}
    with pytest.raises(BadInput, match=r"hardware\.figure is not a key.*did you mean figures\?"):
        Plan.from_dict(hardware)


def test_s4_10_the_report_keeps_keys_of_other_versions(hsdp_plan):
    """``predicted`` is the planner's report: a key an earlier fsdp-plan wrote still reads."""
    from fsdp_plan.plan.document import Plan

    doc = yaml.safe_load(hsdp_plan.read_text())
    doc["predicted"]["recompute_share"] = 0.25
    assert Plan.from_dict(doc).predicted["recompute_share"] == 0.25


def test_s4_10_the_version_rule_is_one_rule_for_every_version_2_field(hsdp_plan):
    from fsdp_plan.common.errors import BadInput
    from fsdp_plan.plan.document import Plan
    from fsdp_plan.plan.schema import FIELDS

    doc = yaml.safe_load(hsdp_plan.read_text())
    assert doc["fsdp_plan_version"] == 1
    later = {"framework": "accelerate", "selective_mm_stride": 2, "grad_accum_steps": 2,
             "offload": {"params": True, "optimizer": True},
             "compile": {"blocks": True, "activation_memory_budget": None,
                         "modules": ["layers.0"]},
             "mixed_precision": {"param_dtype": "float32", "reduce_dtype": "float32",
                                 "autocast_dtype": "bfloat16"}}
    assert {f.name for f in FIELDS if f.since == 2} >= set(later)
    for name, value in later.items():
        with pytest.raises(BadInput, match=f"{name} needs fsdp_plan_version: 2; write that"):
            Plan.from_dict({**doc, name: value})
        Plan.from_dict({**doc, name: value, "fsdp_plan_version": 2})  # read in version 2


# --- S4-20: one validation for every verb, naming the plan's field ---------------------------

VERBS = {"emit": lambda d: ["-o", str(d / "policy.py")], "predict": lambda d: [],
         "verify": lambda d: [], "export": lambda d: ["--to", "accelerate", "-o", str(d / "o")],
         "tune": lambda d: ["--nproc", "1", "--out", str(d / "tuned")]}


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_s4_20_a_gpu_that_is_no_preset_is_refused_by_every_verb_naming_the_field(
        hsdp_plan, tmp_path, verb):
    given = _edited(hsdp_plan, tmp_path, lambda d: d.update(gpu="</script>"))
    before = snapshot(tmp_path)
    text = refused([verb, str(given), *VERBS[verb](tmp_path)], "gpu is '</script>'",
                   "no bundled GPU preset")
    assert "--gpu" not in text
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_s4_20_prefetch_lists_of_no_uniform_depth_are_refused_by_every_verb(hsdp_plan,
                                                                           tmp_path, verb):
    def backwards(doc):  # a forward list naming the unit before: no depth d says that
        doc["units"] = [{"modules": ["layers.0"], "reshard_after_forward": True},
                        {"modules": ["layers.1"], "reshard_after_forward": True},
                        {"modules": [""], "reshard_after_forward": False}]
        doc["forward_prefetch"] = {"layers.1": ["layers.0"]}
    given = _edited(hsdp_plan, tmp_path, backwards)
    before = snapshot(tmp_path)
    refused([verb, str(given), *VERBS[verb](tmp_path)], "forward_prefetch",
            "not a uniform depth")
    assert snapshot(tmp_path) == before


def test_s4_20_a_calibrated_machine_keeps_its_name_beside_its_figures(hsdp_plan):
    from fsdp_plan.cost.hardware import hardware_for
    from fsdp_plan.cost.hardware.stored import stored_block
    from fsdp_plan.plan.document import Plan

    doc = yaml.safe_load(hsdp_plan.read_text())
    hw = hardware_for("h100", {"name": "lab-box-3", "peak_flops": 5e14})
    doc.update(gpu="lab-box-3", hardware=stored_block(hw, {"file": "hw.yaml"}))
    assert Plan.from_dict(doc).gpu == "lab-box-3"


# --- S4-05: what planning writes from a hardware file reads back -----------------------------

@pytest.mark.parametrize("text, figure, table", [("op_overhead_s: 0.5\n", "op_overhead_s",
                                                  "overhead_s"),
                                                 ("peak_flops: 1e6\n", "peak_flops",
                                                  "matmul_flops")])
def test_s4_05_a_figure_that_rescales_a_table_out_of_bounds_is_refused_up_front(
        tmp_path, text, figure, table):
    hw = tmp_path / "hw.yaml"
    hw.write_text(text)
    plans = tmp_path / "plans"
    plans.mkdir()
    before = snapshot(tmp_path)
    refused([*TINY, "--mem", "1GB", "--world-size", "2", "--hardware", str(hw),
             "--plan", str(plans / "plan.yaml"), "-o", str(plans / "policy.py")],
            f"sets {figure}, which rescales the preset's", table,
            "Set ")
    assert snapshot(tmp_path) == before


BASE_FIGURES = ("peak_flops", "efficiency", "hbm_bandwidth", "memory_bandwidth",
                "intra_node_bandwidth", "collective_latency_s", "op_overhead_s")


def _hardware_files():
    from hypothesis import strategies as st

    from fsdp_plan.cost.hardware.hardware import _RANGES

    def figure(name):
        low, high = _RANGES[name][:2]
        import math
        return st.floats(math.log10(low), math.log10(high)).map(lambda e: float(f"{10**e:.6g}"))

    return st.fixed_dictionaries({}, optional={name: figure(name) for name in BASE_FIGURES})


def test_s4_05_any_hardware_file_planning_accepts_is_stored_as_a_plan_reads_it():
    """Property: planning either refuses a hardware file (exit 2, naming the figure) or the
    figures it stores in the plan read back, the same ``Hardware`` (plan/check.py reads
    ``hardware`` with the bounds of a hardware file)."""
    from hypothesis import given, settings

    from fsdp_plan.common.errors import BadInput
    from fsdp_plan.cost.hardware import hardware_for
    from fsdp_plan.cost.hardware.stored import check_stored_block, hardware_of, stored_block

    @settings(max_examples=300, deadline=None, derandomize=True)
    @given(_hardware_files(), __import__("hypothesis").strategies.sampled_from(
        ["h100", "a100", "b200", "h200"]))
    def prop(figures, preset):
        try:
            hw = hardware_for(preset, dict(figures), where="--hardware 'hw.yaml'")
        except BadInput:
            return
        block = stored_block(hw, {"file": "hw.yaml"})
        if block is None:
            return
        text = yaml.safe_dump(block, sort_keys=False, default_flow_style=None, width=100)
        again = yaml.safe_load(text)
        check_stored_block(again, "plan")
        assert hardware_of(again) == hw

    prop()


# --- S4-16: the Python API is bounded as the plan it writes ---------------------------------

@pytest.mark.parametrize("change, words", [
    ({"budget_bytes": 10**40}, ["budget_bytes", "133-bit", "1,152,921,504,606,846,976"]),
    ({"world_size": 2**21}, ["world_size", "1,048,576"]),
    ({"gpus_per_node": 0}, ["gpus_per_node", "from 1"]),
    ({"world_size": 6, "gpus_per_node": 4}, ["world_size 6", "gpus_per_node 4", "full"]),
    ({"grad_accum_steps": 0}, ["grad_accum_steps"]),
])
def test_s4_16_a_request_out_of_the_plan_bounds_is_refused_naming_the_argument(change, words):
    from fsdp_plan.api import PlanRequest
    from fsdp_plan.common.errors import BadInput
    from fsdp_plan.model.source import ModelSource

    source = ModelSource(source=LLAMA, args={"size": "tiny"}, batch_size=1, seq_len=32)
    with pytest.raises(BadInput) as error:
        PlanRequest(source=source, **{"budget_bytes": 10**9, **change})
    for word in words:
        assert word in str(error.value), (word, str(error.value))
    assert "--" not in str(error.value)  # an API call names its argument, not a flag


def test_s4_16_a_request_of_the_wrong_type_is_a_type_error_naming_the_argument():
    """A float where bytes are asked for is the caller's type error ([Note: API arguments])."""
    from fsdp_plan.api import PlanRequest
    from fsdp_plan.model.source import ModelSource

    source = ModelSource(source=LLAMA, args={"size": "tiny"}, batch_size=1, seq_len=32)
    with pytest.raises(TypeError, match="PlanRequest.budget_bytes must be of type int"):
        PlanRequest(source=source, budget_bytes=1.5e9)


def test_s4_16_every_request_in_bounds_writes_a_plan_that_reads_back():
    """The plan fields a request sets, at the request bounds' extremes, pass ``read_plan``'s
    checks (the search is not run: ``to_plan``'s fields come from the request)."""
    from fsdp_plan.common.limits import MAX_BYTES, MAX_GPUS_PER_NODE, MAX_WORLD_SIZE
    from fsdp_plan.plan.document import Mesh, Plan, Unit

    for budget, world, gpus in ((1 << 1, 1, 1), (MAX_BYTES, MAX_WORLD_SIZE, MAX_GPUS_PER_NODE)):
        plan = Plan(model={"source": LLAMA}, budget_bytes=budget, world_size=world,
                    gpus_per_node=gpus, mesh=Mesh(replicate=1, shard=world),
                    units=[Unit(modules=[""])], headroom_bytes=budget // 10)
        again = Plan.from_dict(plan.to_dict())
        assert (again.budget_bytes, again.world_size, again.gpus_per_node) == (budget, world,
                                                                              gpus)
