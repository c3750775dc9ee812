"""DDP communication hooks as searched knobs (issue 27 item 1): fp16 / bf16 compression and
PowerSGD, each priced on the clock and in memory, applied by the policy module exactly as the
plan says, and counted as DDP runs them (gloo, 2 processes)."""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import yaml

from fsdp_plan.api import PlanRequest, analyze_model, plan_from_facts, predict
from fsdp_plan.common.errors import BadInput
from fsdp_plan.cost.comm_hooks import (
    COMM_HOOKS,
    CommHookKind,
    hook_phases,
    hook_state_bytes,
    powersgd_split,
)
from fsdp_plan.cost.ddp_buckets import (
    DDPConfig,
    bucket_shapes,
    build_buckets,
    evaluate_ddp,
    grad_parameters,
)
from fsdp_plan.cost.hardware import hardware_for
from fsdp_plan.cost.precision import Precision
from fsdp_plan.model.source import ModelSource
from fsdp_plan.plan.document import Plan, read_plan
from fsdp_plan.plan.emit import render_policy_module
from fsdp_plan.plan.report import ddp_lines
from fsdp_plan.search.candidate import SearchSettings
from fsdp_plan.search.ddp import DdpStrategy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA = os.path.join(ROOT, "examples", "llama.py")
SOURCE = ModelSource(source=LLAMA, args={"size": "tiny"}, batch_size=2, seq_len=16)


@pytest.fixture(scope="module")
def facts():
    return analyze_model(SOURCE, param_dtype="float32").facts


def common(hw=None):
    return {"hw": hw or hardware_for("h100"), "world_size": 16, "gpus_per_node": 8,
            "optimizer": "adamw", "precision": Precision.of("float32", "float32"),
            "dtype": "float32"}


def starved():
    """16 ranks on two nodes joined by 10 MB/s: the tiny Llama's 1 MB of gradients take 25 ms
    to all-reduce. (Its PowerSGD chain is ~260 small ops, 2.6 ms of host dispatch at the
    preset's 10 us per op: at 100 MB/s, a 2.5 ms all-reduce, plain DDP is still faster, and
    with fast links PowerSGD loses, below.)"""
    return dataclasses.replace(hardware_for("h100"), inter_node_bandwidth=1e7)


def test_powersgd_splits_a_bucket_as_the_hook_does():
    """``powerSGD_hook`` step I by hand: a matrix is compressed when (n + m) r * 2 < n m."""
    split = powersgd_split([(64, 32), (64,), (4, 4), (8, 3, 3)], rank=2)
    # (64, 32): (96) * 2 * 2 = 384 < 2048, compressed: P 64x2, Q 32x2
    # (64,): viewed 64 x 1, r = 1: 65 * 2 = 130 > 64, sent as is
    # (4, 4): 8 * 2 * 2 = 32 > 16, sent as is
    # (8, 3, 3): viewed 8 x 9: 17 * 2 * 2 = 68 < 72, compressed: P 8x2, Q 9x2
    assert (split.uncompressed, split.compressed) == (64 + 16, 2048 + 72)
    assert (split.p, split.q) == (128 + 16, 64 + 18)
    assert split.matmul_nm_r == 64 * 32 * 2 + 8 * 9 * 2
    assert hook_state_bytes("powersgd", [[(64, 32), (64,), (4, 4), (8, 3, 3)]], 4,
                            rank=2) == 4 * ((2048 + 64 + 16 + 72) + 144 + 82)
    assert hook_state_bytes("bf16_compress", [[(64, 32)]], 4) == 0


@pytest.mark.parametrize("name", [None, *COMM_HOOKS])
def test_each_chain_has_the_kinds_all_reduces(name):
    phases = hook_phases(name, [(64, 32), (64,)], 4, rank=1)
    expected = 1 if name is None else COMM_HOOKS[name].all_reduces
    assert sum(p.all_reduce_bytes is not None for p in phases) == expected
    assert phases[-1].all_reduce_bytes is None


def _all_reduce_seconds(evaluation) -> float:
    return sum(e - s for lane, label, s, e in evaluation.time.spans
               if lane == "comm" and label.startswith("AR "))


def test_half_precision_hooks_halve_the_wire_and_pay_their_casts(facts):
    hw = dataclasses.replace(starved(), collective_latency_s=0.0, launch_overhead_s=0.0)
    plain = evaluate_ddp(facts.graph, facts.analysis, DDPConfig(), **common(hw))
    for name in ("fp16_compress", "bf16_compress"):
        half = evaluate_ddp(facts.graph, facts.analysis, DDPConfig(comm_hook=name), **common(hw))
        assert _all_reduce_seconds(half) == pytest.approx(_all_reduce_seconds(plain) / 2,
                                                          rel=1e-6)
        # the cast runs on the compute stream in backward: backward grows by it
        assert half.time.backward_s > plain.time.backward_s
        assert half.collectives == plain.collectives


def test_powersgd_prices_three_all_reduces_and_its_matmuls(facts):
    plain = evaluate_ddp(facts.graph, facts.analysis, DDPConfig(), **common(starved()))
    low = evaluate_ddp(facts.graph, facts.analysis, DDPConfig(comm_hook="powersgd"),
                       **common(starved()))
    assert low.collectives["all_reduce"] == 3 * plain.collectives["all_reduce"]
    buckets, params = build_buckets(facts.graph, facts.analysis.timeline.events, low.config)
    wire = sum(p.all_reduce_bytes or 0 for b in buckets
               for p in hook_phases("powersgd", bucket_shapes(facts.graph, params, b), 4))
    assert wire < facts.graph.total_param_bytes / 4  # rank 1 of 64-wide matrices
    assert _all_reduce_seconds(low) < _all_reduce_seconds(plain)
    assert low.time.step_s < plain.time.step_s  # a starved network: compression pays
    # where bandwidth is plenty, the latency of three all-reduces per bucket and the host's
    # synchronize do not pay
    fast = dataclasses.replace(hardware_for("h100"), inter_node_bandwidth=1e13,
                               intra_node_bandwidth=1e13)
    plain_fast = evaluate_ddp(facts.graph, facts.analysis, DDPConfig(), **common(fast))
    low_fast = evaluate_ddp(facts.graph, facts.analysis, DDPConfig(comm_hook="powersgd"),
                            **common(fast))
    assert low_fast.time.step_s > plain_fast.time.step_s
    # its error feedback, P and Q stay alive across steps
    state = low.memory.breakdown.get("comm_hook_state", 0)
    assert state == hook_state_bytes(
        "powersgd", [bucket_shapes(facts.graph, params, b) for b in buckets], 4)
    assert state > facts.graph.total_param_bytes  # the error alone is a gradient's size
    assert low.memory.peak_bytes >= plain.memory.peak_bytes + state


def _settings(reduce_dtype: str, lossy: bool) -> SearchSettings:
    return SearchSettings(budget_bytes=10**10, headroom_bytes=0, world_size=16,
                          gpus_per_node=8, hardware=hardware_for("h100"),
                          precision=Precision.of("float32", reduce_dtype),
                          allow_lossy_hooks=lossy)


def test_lossy_hooks_are_tried_only_when_allowed():
    assert DdpStrategy.hooks(_settings("float32", False)) == [(None, 1)]
    assert DdpStrategy.hooks(_settings("float16", False)) == [("fp16_compress", 1)]
    assert DdpStrategy.hooks(_settings("bfloat16", False)) == [("bf16_compress", 1)]
    tried = DdpStrategy.hooks(_settings("float32", True))
    assert {h for h, _ in tried} == {None, *COMM_HOOKS}
    assert {r for h, r in tried if h == "powersgd"} == {1, 2, 4}


def _request(hw, **kw) -> PlanRequest:
    return PlanRequest(source=SOURCE, budget_bytes=8 * 10**9, world_size=16, gpus_per_node=8,
                       strategy="ddp", param_dtype="float32", reduce_dtype="float32",
                       hardware=hw, **kw)


def test_a_starved_network_plans_powersgd_and_the_plan_says_so(facts):
    result = plan_from_facts(facts, _request(starved(), allow_lossy_hooks=True))
    doc = yaml.safe_load(result.plan_yaml())
    assert doc["ddp"]["comm_hook"] == "powersgd"
    assert set(doc["ddp"]["powersgd"]) == {"rank", "start_iter"}
    buckets = len(doc["predicted"]["buckets"])
    assert doc["predicted"]["collectives_per_step"]["all_reduce"] == 3 * buckets
    # predict reads the hook back and prices the plan as planned
    again = predict(Plan.from_dict(doc), facts)
    assert again.predicted["step_time_s"] == doc["predicted"]["step_time_s"]
    assert again.predicted["peak_bytes"] == doc["predicted"]["peak_bytes"]
    assert any(line.startswith("lossy: the powersgd communication hook")
               for line in ddp_lines(result.best, result.ranked))
    # without the flag the same network keeps DDP's own all-reduce
    plain = plan_from_facts(facts, _request(starved()))
    assert plain.plan.ddp.comm_hook is None


def _plan_file(facts, ddp: dict, folder) -> str:
    """The tiny Llama's DDP plan with ``ddp`` edited in by hand, its prediction made again."""
    doc = yaml.safe_load(plan_from_facts(facts, _request(hardware_for("h100"))).plan_yaml())
    doc["ddp"].update(ddp)
    doc["model"]["source"] = LLAMA
    path = folder / "plan.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    try:
        doc["predicted"] = predict(read_plan(str(path)), facts).predicted
    except BadInput:
        return str(path)  # a refused edit: the caller reads it
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(path)


@pytest.mark.parametrize("ddp, needle", [
    ({"comm_hook": "powersgd", "powersgd": {"rank": 0}}, "ddp.powersgd.rank"),
    ({"comm_hook": "powersgd", "powersgd": {"start_iter": 1}}, "ddp.powersgd.start_iter"),
    ({"comm_hook": "powersgd", "powersgd": {"rnak": 2}}, "ddp.powersgd.rnak"),
    ({"powersgd": {"rank": 2}}, "ddp.powersgd"),
    ({"comm_hook": "fp8_compress"}, "ddp.comm_hook"),
])
def test_bad_hook_settings_are_refused(facts, ddp, needle, tmp_path):
    with pytest.raises(BadInput, match=needle.replace(".", r"\.")):
        read_plan(_plan_file(facts, ddp, tmp_path))


def test_policy_registers_each_hook_as_planned_and_gloo_counts_what_was_predicted(facts,
                                                                                  tmp_path):
    """One launch of 2 gloo workers: for each hook the policy's ``apply_ddp`` registers the
    plan's hook (and PowerSGD's rank and start iteration), DDP's all-reduces in a steady step
    equal ``predicted.collectives_per_step``, and PowerSGD's error, P and Q tensors hold exactly
    the bytes the plan predicts. (bf16_compress needs NCCL: gloo refuses it, and so does the
    policy, before training: ``test_the_bf16_hook_is_refused_on_gloo_before_training``.)"""
    from fsdp_plan.measure.ddp import measure_ddp_many

    # PowerSGD over one bucket: on gloo several buckets can misorder (the policy refuses them)
    cases = {"fp16_compress": {"comm_hook": "fp16_compress", "bucket_cap_mb": 0.25,
                               "first_bucket_mb": 0.25},
             "powerSGD_hook": {"comm_hook": "powersgd", "powersgd": {"rank": 2, "start_iter": 2},
                               "bucket_cap_mb": 25, "first_bucket_mb": 25}}
    jobs, expected = [], []
    for name, ddp in cases.items():
        plan = read_plan(_plan_file(facts, ddp, tmp_path))
        e = evaluate_ddp(facts.graph, facts.analysis, plan.ddp,
                         hw=hardware_for("h100"), world_size=2, gpus_per_node=8,
                         precision=Precision.of("float32", "float32"), optimizer="adamw",
                         dtype="float32")
        jobs.append({"source": SOURCE, "policy_source": render_policy_module(plan),
                     "optimizer": "adamw"})
        expected.append((name, e))
    results = measure_ddp_many(jobs, nproc=2)
    for (name, e), ranks in zip(expected, results):
        for r in ranks:
            assert r["comm_hook"]["hook"].startswith(name.split("_compress")[0]), r["comm_hook"]
            # the hook's all-reduces, from whatever thread issued them (CommDebugMode sees only
            # the training thread's: measure.ddp._python_all_reduces)
            assert r["hook_all_reduces"] == e.collectives["all_reduce"], name
            assert r["rebuilt_bucket_sizes"] == [b.nbytes for b in e.buckets]
            if name == "powerSGD_hook":
                params = grad_parameters(facts.graph, facts.analysis.timeline.events)
                shapes = [bucket_shapes(facts.graph, params, b) for b in e.buckets]
                assert (r["comm_hook"]["rank"], r["comm_hook"]["start_iter"]) == (2, 2)
                assert r["comm_hook"]["state_bytes"] == hook_state_bytes(
                    "powersgd", shapes, 4, rank=2) == e.memory.breakdown["comm_hook_state"]
                assert math.isfinite(r["comm_hook"]["state_bytes"])


@pytest.mark.parametrize("ddp, needle", [
    ({"comm_hook": "bf16_compress"}, "bf16_compress needs NCCL.*gloo"),
    ({"comm_hook": "powersgd", "powersgd": {"start_iter": 2}, "bucket_cap_mb": 0.25,
      "first_bucket_mb": 0.25}, "powersgd over [0-9]+ buckets on gloo"),
])
def test_the_bf16_hook_is_refused_on_gloo_before_training(facts, tmp_path, ddp, needle):
    """torch's bf16_compress_hook raises only inside the first backward on gloo, and PowerSGD
    over several buckets can abort gloo mid-step; the policy says so at ``apply_ddp``."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: F401

    from fsdp_plan.plan.emit import load_policy_module

    plan = read_plan(_plan_file(facts, ddp, tmp_path))
    path = tmp_path / "policy.py"
    path.write_text(render_policy_module(plan))
    policy = load_policy_module(str(path))
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path}/pg")
    try:
        from fsdp_plan.model.load import load_model
        from fsdp_plan.measure import runtime
        import torch
        model = runtime.build_real_model(load_model(SOURCE), torch.device("cpu"))
        with pytest.raises(ValueError, match=needle):
            policy.apply_ddp(model)
        assert policy.DDP_KWARGS  # the plan itself is fine: the backend is not
    finally:
        dist.destroy_process_group()


def test_a_new_hook_kind_is_one_entry_in_the_table(facts, tmp_path, monkeypatch):
    """Adding a hook kind touches one place, its ``COMM_HOOKS`` entry in cost/comm_hooks.py
    (issue 28 item 2): the plan checker, the search, the clock, the memory model, the report
    and the policy module all read the table (the policy registers torch's
    ``default_hooks.<name>_hook`` by name). Shown with torch's plain ``allreduce_hook`` added,
    used end to end, and removed again."""
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    from fsdp_plan.measure import runtime
    from fsdp_plan.model.load import load_model
    from fsdp_plan.plan.emit import load_policy_module

    monkeypatch.setitem(COMM_HOOKS, "allreduce", CommHookKind(
        name="allreduce", torch_hook="default_hooks.allreduce_hook", wire_element_bytes=4,
        numerics=""))
    assert ("allreduce", 1) in DdpStrategy.hooks(_settings("float32", True))
    assert [p.all_reduce_bytes for p in hook_phases("allreduce", [[4, 4]], 4)] == [64, None]
    path = _plan_file(facts, {"comm_hook": "allreduce"}, tmp_path)
    plan = read_plan(path)
    assert plan.ddp.comm_hook == "allreduce" and plan.predicted["step_time_s"] > 0
    module = tmp_path / "policy.py"
    module.write_text(render_policy_module(plan))
    policy = load_policy_module(str(module))
    dist.init_process_group("gloo", rank=0, world_size=1, init_method=f"file://{tmp_path}/pg")
    try:
        model = policy.apply_ddp(runtime.build_real_model(load_model(SOURCE),
                                                          torch.device("cpu")))
        assert [hook for hook, _ in model._comm_hooks] == [default_hooks.allreduce_hook]
    finally:
        dist.destroy_process_group()
    monkeypatch.undo()
    with pytest.raises(BadInput, match=r"ddp\.comm_hook"):
        read_plan(path)
