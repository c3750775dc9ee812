"""DDP plans (issue 13): buckets exactly as DDP builds them, memory, step time, plan, policy.

The exact bucket lists below were read from ``_get_ddp_logging_data()`` on gloo with 2
processes (``test_buckets_counts_and_peak_equal_ddp_on_gloo`` measures them again).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import random

import pytest
import yaml

from fsdp_plan.api import PlanRequest, analyze_model, plan_from_facts, predict
from fsdp_plan.cli.main import main
from fsdp_plan.cost.ddp_buckets import (
    BucketOrder,
    DDPConfig,
    _bucket_ranges,
    assign_by_size,
    build_buckets,
    ddp_api_kwargs,
    ddp_memory,
    evaluate_ddp,
    unused_parameters,
)
from fsdp_plan.cost.hardware import hardware_for
from fsdp_plan.cost.precision import Precision
from fsdp_plan.model.source import ModelSource
from fsdp_plan.plan.document import Plan
from fsdp_plan.plan.emit import load_policy_module, render_policy_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA = os.path.join(ROOT, "examples", "llama.py")
GPT2 = os.path.join(ROOT, "examples", "gpt2.py")
RESNET = os.path.join(ROOT, "examples", "resnet.py")
UNUSED = os.path.join(ROOT, "tests", "fixtures", "ddp_unused.py")

# (model, args, cap MiB, first-bucket MiB) -> bytes of each bucket DDP built (gloo, 2 ranks)
MEASURED = {
    (LLAMA, "tiny", 0.05, 0.05): [131072, 98560, 65792, 82176, 98304, 98816, 98304, 98816,
                                  98304, 180736],
    (LLAMA, "tiny", 0.25, 0.01): [131072, 295680, 262912, 361216],
    (GPT2, "tiny", 0.05, 0.05): [66304, 66560, 67072, 66304, 66560, 67072, 66304, 66560, 67072,
                                 66304, 66560, 67072, 66048, 131072],
    (GPT2, "tiny", 0.25, 0.25): [266240, 266496, 267008, 197120],
    (RESNET, "tiny", 0.02, 0.02): [143400, 67584, 147968, 33280, 54528, 34048, 37120, 50432,
                                   54528, 22400, 22400, 22656, 12192],
    (RESNET, "tiny", 0.1, 0.01): [11304, 132096, 215552, 104960, 104960, 107520, 26144],
    (UNUSED, None, 0.05, 0.05): [4608, 74880, 148992, 148608, 148992, 148608, 148992, 148608,
                                 148992, 184704],
    (UNUSED, None, 0.25, 0.01): [79488, 297600, 297600, 297600, 296832, 36864],
}

# its plans and predictions of the same small models share their analyses (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("facts_cache_per_file")


def source(path: str, size: str | None, batch: int = 2, seq: int = 16) -> ModelSource:
    return ModelSource(source=path, args={"size": size} if size else {}, batch_size=batch,
                       seq_len=seq)


@pytest.fixture(scope="module")
def facts():
    """fp32 analyses of the four models (what a DDP run without autocast computes in)."""
    return {(path, size): analyze_model(source(path, size), param_dtype="float32").facts
            for path, size in {(k[0], k[1]) for k in MEASURED}}


def config(f, cap: float, first: float) -> DDPConfig:
    return DDPConfig(bucket_cap_mb=cap, first_bucket_mb=first,
                     find_unused_parameters=bool(unused_parameters(f.graph, f.analysis)))


def test_assign_by_size_closes_a_bucket_once_it_reaches_its_limit():
    # the parameter that crosses the limit stays in the bucket; the first limit applies once
    assert assign_by_size([3, 3, 3, 3, 3], [4, 7]) == [[0, 1], [2, 3, 4]]
    assert assign_by_size([5, 1, 1], [4, 100]) == [[0], [1, 2]]
    assert assign_by_size([2, 2, 2], [4]) == [[0, 1], [2]]
    # against the reducer's loop, parameter by parameter: zero sizes, limits of 0, several
    # limits, sizes above every limit
    rng = random.Random(7)
    for _ in range(300):
        sizes = [rng.choice((0, 1, 2, 5, 9, 40)) for _ in range(rng.randint(0, 30))]
        limits = [rng.choice((0, 1, 4, 8, 30)) for _ in range(rng.randint(1, 3))]
        buckets, current, size, at = [], [], 0, 0
        for i, nbytes in enumerate(sizes):
            current.append(i)
            size += nbytes
            if size >= limits[at]:
                buckets.append(current)
                current, size, at = [], 0, min(at + 1, len(limits) - 1)
        assert assign_by_size(sizes, limits) == buckets + ([current] if current else [])
        # the search's cut: buckets at the last limit ended from every position at once
        order = BucketOrder.of([], 0)
        order = dataclasses.replace(order, cumulative=list(itertools.accumulate(sizes,
                                                                                initial=0)))
        assert _bucket_ranges(order.cumulative, limits, order.ends_at(limits[-1])) == \
            _bucket_ranges(order.cumulative, limits)


@pytest.mark.parametrize("key", sorted(MEASURED, key=str), ids=lambda k: f"{os.path.basename(k[0])}"
                         f"-{k[2]}-{k[3]}")
def test_predicted_buckets_equal_what_ddp_built(facts, key):
    path, size, cap, first = key
    f = facts[(path, size)]
    buckets, _ = build_buckets(f.graph, f.analysis.timeline.events, config(f, cap, first))
    assert [b.nbytes for b in buckets] == MEASURED[key]


def test_unused_parameters_are_found_and_switch_off_the_rebuild(facts):
    f = facts[(UNUSED, None)]
    unused = unused_parameters(f.graph, f.analysis)
    assert sorted({p.module for p in unused}) == ["spare"]
    assert config(f, 25, 1).find_unused_parameters
    assert not unused_parameters(facts[(GPT2, "tiny")].graph, facts[(GPT2, "tiny")].analysis)


def test_keyword_arguments_follow_ddps_first_bucket_rule():
    base = {"gradient_as_bucket_view": True, "static_graph": False,
            "find_unused_parameters": False}
    assert ddp_api_kwargs(DDPConfig()) == {**base, "bucket_cap_mb": None}  # (1, 25): default
    assert ddp_api_kwargs(DDPConfig(bucket_cap_mb=5, first_bucket_mb=5)) == {
        **base, "bucket_cap_mb": 5}
    assert ddp_api_kwargs(DDPConfig(bucket_cap_mb=100, first_bucket_mb=1)) == {
        **base, "bucket_cap_mb_list": [1, 100]}


def test_gradient_as_bucket_view_saves_a_gradient_copy(facts):
    f = facts[(GPT2, "tiny")]
    p = Precision.of("float32", "float32")
    view = ddp_memory(f.graph, f.analysis, p, "adamw", DDPConfig())
    copy = ddp_memory(f.graph, f.analysis, p, "adamw", DDPConfig(gradient_as_bucket_view=False))
    assert copy.peak_bytes - view.peak_bytes == f.graph.total_param_bytes


def test_bf16_compression_halves_the_all_reduce_bytes(facts):
    f = facts[(LLAMA, "tiny")]
    hw = dataclasses.replace(hardware_for("h100"), collective_latency_s=0.0,
                             launch_overhead_s=0.0, inter_node_bandwidth=1e6)
    common = {"hw": hw, "world_size": 16, "gpus_per_node": 8, "optimizer": "adamw",
              "precision": Precision.of("float32", "float32"), "dtype": "float32"}
    plain = evaluate_ddp(f.graph, f.analysis, DDPConfig(), **common)
    half = evaluate_ddp(f.graph, f.analysis, DDPConfig(comm_hook="bf16_compress"), **common)

    def all_reduce_s(e) -> float:  # the copy back after each all-reduce is not on the wire
        return sum(end - start for lane, label, start, end in e.time.spans
                   if lane == "comm" and label.startswith("AR "))
    assert all_reduce_s(half) == pytest.approx(all_reduce_s(plain) / 2, rel=1e-6)


def test_small_buckets_pay_latency_and_large_ones_a_tail(facts):
    f = facts[(LLAMA, "tiny")]
    # 6 us per op, as the preset had: the backward left after the last gradient is ready
    # hides part of the one bucket's 40 us all-reduce (6.6 us at 6 us per op, 11 us at the
    # preset's 10 us, which leaves 73% of it a tail)
    hw = dataclasses.replace(hardware_for("h100"), collective_latency_s=1e-3,
                             intra_node_bandwidth=2e8, op_overhead_s=6e-6)
    common = {"hw": hw, "world_size": 8, "gpus_per_node": 8, "optimizer": "adamw",
              "precision": Precision.of("float32", "float32"), "dtype": "float32"}
    small = evaluate_ddp(f.graph, f.analysis, DDPConfig(bucket_cap_mb=0.01,
                                                        first_bucket_mb=0.01), **common)
    one = evaluate_ddp(f.graph, f.analysis, DDPConfig(bucket_cap_mb=400,
                                                      first_bucket_mb=400), **common)
    assert len(small.buckets) > 10 and len(one.buckets) == 1
    assert small.time.total_comm_s > one.time.total_comm_s  # latency per bucket
    # one bucket starts only once the last gradient is ready: most of it is the tail
    assert one.time.exposed_comm_s > 0.8 * one.time.total_comm_s
    assert small.time.exposed_comm_s < one.time.exposed_comm_s


def ddp_request(path: str, size: str, **kw) -> PlanRequest:
    return PlanRequest(source=source(path, size, batch=4, seq=64), budget_bytes=8 * 10**9,
                       world_size=8, strategy="ddp", param_dtype="float32",
                       reduce_dtype="float32", **kw)


def test_a_ddp_plan_round_trips_and_predicts_as_planned(facts):
    request = ddp_request(GPT2, "tiny")
    f = analyze_model(request.source, param_dtype="float32").facts
    result = plan_from_facts(f, request)
    doc = yaml.safe_load(result.plan_yaml())
    assert doc["strategy"] == "ddp" and doc["fsdp_plan_version"] == 2
    assert doc["mesh"] == {"replicate": 8, "shard": 1}
    assert [u["modules"] for u in doc["units"]] == [[""]]
    assert set(doc["ddp"]) == {"bucket_cap_mb", "first_bucket_mb", "gradient_as_bucket_view",
                               "static_graph", "find_unused_parameters"}
    assert sum(doc["predicted"]["buckets"]) == f.graph.total_param_bytes
    assert doc["predicted"]["collectives_per_step"]["all_reduce"] == len(
        doc["predicted"]["buckets"])
    again = predict(Plan.from_dict(doc), f)
    assert again.predicted["buckets"] == doc["predicted"]["buckets"]
    assert again.predicted["peak_bytes"] == doc["predicted"]["peak_bytes"]


def test_the_policy_module_exports_ddp_kwargs_and_apply_ddp(tmp_path):
    request = ddp_request(LLAMA, "tiny")
    f = analyze_model(request.source, param_dtype="float32").facts
    plan = plan_from_facts(f, request).plan
    path = tmp_path / "policy.py"
    path.write_text(render_policy_module(plan))
    policy = load_policy_module(str(path))
    assert policy.DDP_KWARGS == ddp_api_kwargs(plan.ddp)
    assert callable(policy.apply_ddp)


def test_plan_command_with_strategy_ddp_reports_buckets_and_tail(tmp_path, capsys):
    plan_path = tmp_path / "p.yaml"
    code = main([GPT2, "--model-arg", "size=tiny", "--mem", "8GB", "--world-size", "8",
                 "--seq-len", "64", "--strategy", "ddp", "--plan", str(plan_path)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "Traceback" not in err
    assert "DDP buckets after the rebuild" in out and "communication tail" in out
    assert yaml.safe_load(plan_path.read_text())["strategy"] == "ddp"


def test_a_ddp_block_on_an_fsdp_plan_is_refused(tmp_path, capsys):
    request = ddp_request(LLAMA, "tiny")
    f = analyze_model(request.source, param_dtype="float32").facts
    doc = plan_from_facts(f, request).plan.to_dict()
    doc.update(strategy="full", mesh={"replicate": 1, "shard": 8})
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    assert main(["predict", str(path)]) == 2
    err = capsys.readouterr().err
    assert "ddp" in err and "Traceback" not in err
    assert sorted(os.listdir(tmp_path)) == ["bad.yaml"]


@pytest.mark.slow
def test_buckets_counts_and_peak_equal_ddp_on_gloo(facts):
    """One launch of 2 gloo workers: every bucket list above, the all-reduce and broadcast
    counts, and the MemTracker peak of a steady step against the prediction (within 5%)."""
    from fsdp_plan.cost.ddp_buckets import evaluate_ddp as evaluate
    from fsdp_plan.measure.ddp import measure_ddp_many

    hw = hardware_for("h100")
    p = Precision.of("float32", "float32")
    jobs, expected = [], []
    for key in sorted(MEASURED, key=str):
        path, size, cap, first = key
        f = facts[(path, size)]
        e = evaluate(f.graph, f.analysis, config(f, cap, first), hw=hw, world_size=2,
                     gpus_per_node=8, precision=p, optimizer="adamw", dtype="float32")
        jobs.append({"source": source(path, size), "ddp_kwargs": ddp_api_kwargs(e.config),
                     "optimizer": "adamw", "memory": True})
        expected.append(e)
    results = measure_ddp_many(jobs, nproc=2)
    for key, e, ranks in zip(sorted(MEASURED, key=str), expected, results):
        for r in ranks:
            assert r["rebuilt_bucket_sizes"] == [b.nbytes for b in e.buckets] == MEASURED[key]
            assert {k: v for k, v in r["counts"].items() if v} == {
                k: v for k, v in e.collectives.items() if v}
        measured = ranks[0]["peak_bytes"]
        assert abs(e.memory.peak_bytes - measured) / measured <= 0.05, (key, measured)


def auto_request(budget: int) -> PlanRequest:
    return PlanRequest(source=source(LLAMA, "tiny", batch=1, seq=64), budget_bytes=budget,
                       world_size=8, strategy="auto")


def test_auto_picks_ddp_when_it_fits_and_is_faster_and_says_why():
    from fsdp_plan.plan.report import why_line

    request = auto_request(8 * 10**9)
    f = analyze_model(request.source, param_dtype=request.param_dtype).facts
    result = plan_from_facts(f, request)
    fsdp = [c for c in result.ranked if c.fits and c.strategy != "ddp"]
    assert result.best.strategy == "ddp" and result.plan.strategy == "ddp"
    assert result.best.time.step_s < min(c.time.step_s for c in fsdp)
    line = why_line(result.ranked)
    assert line.startswith(f"why: {result.best.name} wins") and "\n" not in line
    assert fsdp[0].name in line


def test_auto_keeps_fsdp_when_ddp_does_not_fit_and_says_why():
    from fsdp_plan.plan.report import why_line

    request = auto_request(5 * 10**6)  # the model states fit sharded, not replicated
    f = analyze_model(request.source, param_dtype=request.param_dtype).facts
    result = plan_from_facts(f, request)
    assert result.plan.strategy != "ddp"
    assert any(c.strategy == "ddp" and not c.fits for c in result.ranked)
    assert "DDP does not fit" in why_line(result.ranked)


def test_without_overlap_backward_waits_for_every_all_reduce(facts):
    """A hardware file whose collectives hold the compute cores (gloo on a CPU): every
    all-reduce is exposed, so fewer buckets (less latency) are faster."""
    f = facts[(LLAMA, "tiny")]
    hw = dataclasses.replace(hardware_for("h100"), comm_overlaps_compute=False,
                             collective_latency_s=1e-3)
    common = {"hw": hw, "world_size": 8, "gpus_per_node": 8, "optimizer": "adamw",
              "precision": Precision.of("float32", "float32"), "dtype": "float32"}
    small = evaluate_ddp(f.graph, f.analysis, DDPConfig(bucket_cap_mb=0.05,
                                                        first_bucket_mb=0.05), **common)
    one = evaluate_ddp(f.graph, f.analysis, DDPConfig(bucket_cap_mb=400,
                                                      first_bucket_mb=400), **common)
    for e in (small, one):
        assert e.time.exposed_comm_s == pytest.approx(e.time.total_comm_s)
    assert small.time.step_s > one.time.step_s


@pytest.mark.slow
def test_bench_and_verify_hold_a_ddp_plan_against_what_ddp_did(tmp_path, capsys):
    """bench on 2 gloo ranks: the buckets DDP built, the counts and the MemTracker peak equal
    the plan's prediction; verify measures the same peak on a real one-rank run."""
    import json

    plan_path = tmp_path / "p.yaml"
    assert main([RESNET, "--model-arg", "size=tiny", "--mem", "8GB", "--world-size", "8",
                 "--batch-size", "4", "--strategy", "ddp", "--param-dtype", "fp32",
                 "--plan", str(plan_path), "--format", "json"]) == 0
    capsys.readouterr()
    out = tmp_path / "results"
    assert main(["bench", str(plan_path), "--nproc", "2", "--steps", "2", "--out", str(out),
                 "--format", "json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["ddp_buckets"]["measured"] == result["ddp_buckets"]["predicted"]
    assert result["collectives"]["measured"]["broadcast"] == 2  # batch norm: float + int64
    peak, predicted = result["memory"]["peak_bytes"], result["memory"]["predicted_bytes"]
    assert abs(predicted - peak) / peak <= 0.05
    assert main(["verify", str(plan_path), "--format", "json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["relative_error"] <= 0.05


def test_each_exposed_bucket_says_why():
    """The report's per-bucket reason (issue 27 item 5): queued behind the previous bucket,
    ready only as backward ended, too small to reach bandwidth; hidden buckets are hidden."""
    from fsdp_plan.plan.report import bucket_exposure

    common = {"backward_end_s": 0.010, "best_rate": 1e11}
    assert bucket_exposure(ready_s=0.002, start_s=0.002, end_s=0.004, nbytes=2 * 10**8,
                           **common) == (0.0, "hidden behind backward")
    exposed, why = bucket_exposure(ready_s=0.005, start_s=0.009, end_s=0.011, nbytes=2 * 10**8,
                                   **common)
    assert exposed == pytest.approx(0.001) and "waited 4.000 ms behind" in why
    assert "ready only" not in why and "too small" not in why
    exposed, why = bucket_exposure(ready_s=0.010, start_s=0.010, end_s=0.0101, nbytes=10**5,
                                   **common)
    assert exposed == pytest.approx(1e-4) and "ready only as backward ended" in why
    assert "too small to reach bandwidth (1 GB/s" in why and "waited" not in why


@pytest.mark.parametrize("hook,overlap", [(None, False), ("fp16_compress", False),
                                          ("powersgd", False), (None, True)])
def test_configurations_sharing_buckets_share_one_simulated_step(facts, hook, overlap):
    """``evaluate_ddp``'s ``step_times``: every configuration of the search's grid gets the
    step it gets simulated on its own, with spans and ready times of its own; caps that cut
    the same buckets simulate once."""
    f = facts[(LLAMA, "tiny")]
    common = {"hw": hardware_for("h100"), "world_size": 16, "gpus_per_node": 8,
              "optimizer": "adamw", "precision": Precision.of("float32", "float32"),
              "dtype": "float32", "optimizer_overlap": overlap}
    memo: dict = {}
    layouts = set()
    for cap in (0.01, 0.02, 0.05, 0.25, 400):
        for first in (cap, 0.01):
            c = DDPConfig(bucket_cap_mb=cap, first_bucket_mb=first, comm_hook=hook,
                          powersgd_rank=2 if hook == "powersgd" else 1)
            alone = evaluate_ddp(f.graph, f.analysis, c, **common)
            shared = evaluate_ddp(f.graph, f.analysis, c, step_times=memo, **common)
            assert shared.time == alone.time and shared.ready_s == alone.ready_s
            assert shared.memory == alone.memory and shared.buckets == alone.buckets
            layouts.add(tuple(tuple(b.params) for b in alone.buckets))
            # a candidate's own list of spans (made when read, [Note: spans when read]):
            # emptied, the next one's are untouched
            spans = shared.time.spans
            (spans if isinstance(spans, list) else spans._list()).clear()
            shared.ready_s.clear()
    assert len(memo) == len(layouts) < 10  # some caps cut the same buckets


BF16_ONLY = os.path.join(os.path.dirname(__file__), "fixtures", "bf16_only.py")


def test_strategy_ddp_on_a_model_that_fails_as_ddp_computes_it_says_why(capsys, tmp_path):
    """A model whose kernel takes bfloat16 only runs with FSDP's bf16 parameters but not as
    DDP computes it (float32 parameters under autocast). ``--strategy ddp`` is refused with
    that reason and exit 2 (it was exit 3 with a message about framework configurations),
    nothing written; ``--strategy auto`` plans FSDP and says why DDP is not planned."""
    argv = [BF16_ONLY, "--mem", "8GB", "--world-size", "8", "--seq-len", "64"]
    policy = tmp_path / "policy.py"
    assert main([*argv, "--strategy", "ddp", "-o", str(policy)]) == 2
    err = capsys.readouterr().err
    assert "--strategy ddp cannot be planned for this model" in err
    assert "takes bfloat16 weights only" in err and "--strategy auto" in err
    assert "configuration" not in err and "Traceback" not in err
    assert not policy.exists()
    assert main([*argv, "--strategy", "auto", "-o", str(policy)]) == 0
    out = capsys.readouterr().out
    assert "where this model fails" in out and policy.exists()
