"""DDP plans over several micro-batches ([Note: DDP and accumulation] in cost/ddp_buckets.py):
a step of N micro-batches runs N forwards and backwards and one optimizer step, all-reduces
after every micro-batch unless gradients sync on the last only (``no_sync``), and counts
its collectives over the whole step (SPEC 5 and 6). Step times against exact expected
values; counts and the peak against CommDebugMode and MemTracker on gloo with 2 processes.
"""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import yaml

from fsdp_plan.api import analyze_model
from fsdp_plan.cli.main import main
from fsdp_plan.cost.ddp_buckets import DDPConfig, evaluate_ddp
from fsdp_plan.cost.hardware import hardware_for
from fsdp_plan.cost.precision import Precision
from fsdp_plan.measure.collectives import count_collectives_many
from fsdp_plan.model.source import ModelSource
from fsdp_plan.plan.document import read_plan

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA = os.path.join(ROOT, "examples", "llama.py")
TINY = [LLAMA, "--model-arg", "size=tiny", "--world-size", "2", "--seq-len", "64",
        "--strategy", "ddp", "--param-dtype", "fp32", "--mem", "1GB"]


@pytest.fixture(scope="module")
def llama():
    source = ModelSource(source=LLAMA, args={"size": "tiny"}, batch_size=2, seq_len=16)
    return analyze_model(source, param_dtype="float32").facts


def evaluate(facts, hw, steps: int, sync: str):
    return evaluate_ddp(facts.graph, facts.analysis,
                        DDPConfig(bucket_cap_mb=0.25, first_bucket_mb=0.25), hw=hw,
                        world_size=2, gpus_per_node=8,
                        precision=Precision.of("float32", "float32"), optimizer="adamw",
                        dtype="float32", grad_accum_steps=steps, gradient_sync=sync)


@pytest.mark.parametrize("overlap", [False, True])
def test_every_micro_batch_runs_and_reduces_and_one_optimizer_step_runs(llama, overlap):
    hw = dataclasses.replace(hardware_for("h100"), comm_overlaps_compute=overlap)
    one, four = evaluate(llama, hw, 1, "every"), evaluate(llama, hw, 4, "every")
    micro = one.time.step_s - one.time.optimizer_s
    assert one.time.optimizer_s > 0 and len(one.buckets) > 1
    assert four.time.step_s == pytest.approx(4 * micro + one.time.optimizer_s, rel=1e-12)
    assert four.time.total_comm_s == pytest.approx(4 * one.time.total_comm_s, rel=1e-12)
    assert four.collectives["all_reduce"] == 4 * len(one.buckets)
    assert four.collectives["broadcast"] == 4 * one.collectives["broadcast"] == 4
    assert four.memory.peak_bytes == one.memory.peak_bytes


def test_no_sync_micro_batches_skip_the_all_reduce_and_hold_their_gradients(llama):
    # collectives on the compute cores (gloo on a CPU): one micro-batch's exposed
    # all-reduces are exactly what a micro-batch under no_sync does not pay
    hw = dataclasses.replace(hardware_for("h100"), comm_overlaps_compute=False)
    one, last = evaluate(llama, hw, 1, "every"), evaluate(llama, hw, 4, "last")
    assert one.time.contention_s == 0 and one.time.exposed_comm_s > 0
    quiet = one.time.step_s - one.time.optimizer_s - one.time.exposed_comm_s
    assert last.time.step_s == pytest.approx(one.time.step_s + 3 * quiet, rel=1e-12)
    assert last.time.total_comm_s == pytest.approx(one.time.total_comm_s, rel=1e-12)
    assert last.collectives == one.collectives
    # one gradient copy more, over the later micro-batches' activations (MemTracker on gloo
    # measures it: the bench test below)
    held = dict(last.memory.breakdown)
    assert held.pop("accumulated_grads") == llama.graph.total_param_bytes
    assert held.pop("activations") == max(e.peak for e in llama.analysis.timeline.events)
    assert held == {k: v for k, v in one.memory.breakdown.items()
                    if k not in ("activations", "optimizer_temporaries")}
    assert last.memory.peak_bytes == sum(last.memory.breakdown.values()) > one.memory.peak_bytes


def plan_json(capsys, *args: str) -> dict:
    capsys.readouterr()
    assert main([*TINY, *args, "--format", "json"]) == 0
    return json.loads(capsys.readouterr().out)["plan"]


def test_tokens_per_second_count_the_step_of_every_micro_batch(capsys):
    """The reported bug: 8 accumulated micro-batches were priced as one (tokens/s 8x)."""
    one = plan_json(capsys, "--global-batch-size", "2", "--batch-size", "1")
    eight = plan_json(capsys, "--global-batch-size", "16", "--batch-size", "1")
    assert eight["grad_accum_steps"] == 8
    p1, p8 = one["predicted"], eight["predicted"]
    assert p8["tokens_per_s"] == pytest.approx(8 * 64 / p8["step_time_s"], rel=1e-3)
    # each micro-batch still runs its forward and backward: at most the all-reduces and
    # the optimizer step are shared, far from the 8x of pricing one micro-batch
    assert p8["tokens_per_s"] < 1.1 * p1["tokens_per_s"]


def accumulated(tmp_path, capsys, sync: str) -> tuple[str, dict[str, int]]:
    """A DDP plan of 3 micro-batches with ``sync``, and its predicted counts."""
    path = tmp_path / "plan.yaml"
    capsys.readouterr()
    assert main([*TINY, "--global-batch-size", "6", "--batch-size", "1", "--plan", str(path),
                 "--format", "json"]) == 0
    doc = yaml.safe_load(path.read_text())
    assert doc["grad_accum_steps"] == 3
    doc["gradient_sync"] = sync
    doc.pop("predicted")
    out = tmp_path / f"plan_{sync}.yaml"
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    capsys.readouterr()
    assert main(["predict", str(out), "--format", "json"]) == 0
    predicted = json.loads(capsys.readouterr().out)["predicted"]["collectives_per_step"]
    return str(out), predicted


@pytest.mark.slow
def test_whole_step_counts_match_commdebugmode_on_gloo(tmp_path, capsys):
    jobs, expected = [], []
    for sync in ("every", "last"):
        path, predicted = accumulated(tmp_path, capsys, sync)
        with open(path) as f:
            jobs.append({"plan": yaml.safe_load(f), "mesh": (2, 1)})
        expected.append(predicted)
    assert expected[0]["all_reduce"] == 3 * expected[1]["all_reduce"] > 0
    assert expected[0]["broadcast"] == 3 * expected[1]["broadcast"] > 0
    source = ModelSource(source=LLAMA, args={"size": "tiny"}, batch_size=1, seq_len=64)
    measured = count_collectives_many(source, jobs, nproc=2)
    for ranks, want in zip(measured, expected):
        assert ranks[0] == ranks[1]
        assert {k: v for k, v in ranks[0].items() if v} == {k: v for k, v in want.items() if v}


@pytest.mark.slow
def test_bench_holds_a_sync_last_ddp_plan_against_memtracker(tmp_path, capsys):
    """bench on 2 gloo ranks runs the plan's micro-batches through prepare_microbatch: the
    counts equal and the MemTracker peak holds the gradients kept apart under no_sync."""
    path = str(tmp_path / "plan.yaml")
    capsys.readouterr()
    assert main([*TINY, "--global-batch-size", "6", "--batch-size", "1", "--plan", path,
                 "--format", "json"]) == 0
    plan = read_plan(path)
    assert (plan.grad_accum_steps, plan.gradient_sync) == (3, "last")  # the planner's choice
    capsys.readouterr()
    assert main(["bench", path, "--nproc", "2", "--steps", "1", "--out",
                 str(tmp_path / "results"), "--format", "json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["collectives"]["measured"] == result["collectives"]["predicted"]
    peak, predicted = result["memory"]["peak_bytes"], result["memory"]["predicted_bytes"]
    assert predicted == plan.predicted["peak_bytes"]
    assert abs(predicted - peak) / peak <= 0.01
