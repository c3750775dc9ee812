"""CPU offload as the last resort (offload.py): device accounting, time, plan key, policy, CLI.

On a CPU host and device are the same memory: FSDPMemTracker cannot tell what an offloaded
plan keeps on the device (measured: the same peak with and without ``CPUOffloadPolicy``), so
the accounting is tested here and the device peak is checked on a GPU (``bench.gpu_check``).
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import yaml
from layouts import evaluate

from fsdp_plan.common.errors import BadInput
from fsdp_plan.cost.hardware import hardware_for
from fsdp_plan.cost.memory import StepContext, estimate_peak
from fsdp_plan.cost.offload import (
    HOST_OPTIMIZER_BANDWIDTH,
    host_bytes,
    pcie_bandwidth,
)
from fsdp_plan.cost.precision import Precision
from fsdp_plan.facts.types import ModelFacts
from fsdp_plan.search.candidate import OffloadDetail, SearchSettings
from fsdp_plan.search.evaluator import Evaluator

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA = os.path.join(ROOT, "examples", "llama.py")
TINY = [LLAMA, "--model-arg", "size=tiny", "--seq-len", "64", "--world-size", "2",
        "--headroom", "0"]


@pytest.fixture(scope="module")
def facts() -> ModelFacts:
    with open(os.path.join(ROOT, "tests", "fixtures", "tiny_llama_facts.json")) as f:
        return ModelFacts.from_json(f.read())


def _evaluator(facts: ModelFacts, budget: int = 10**10) -> Evaluator:
    settings = SearchSettings(budget_bytes=budget, headroom_bytes=0, world_size=2,
                              gpus_per_node=8, hardware=hardware_for("h100"))
    return Evaluator(facts.graph, facts.analysis, settings)


def _per_block(ev: Evaluator, k: int = 0):
    groups = [[b] for b in ev.graph.blocks]
    return evaluate(ev, name="per-block", strategy="full", replicate=1, shard=2, groups=groups,
                       reshard=[True] * len(groups), root_reshard=False, k=k,
                       forward_prefetch=0, backward_prefetch=1)


def offloaded(ev, cand):
    """``cand``'s layout evaluated with ``CPUOffloadPolicy``."""
    return ev.evaluate(dataclasses.replace(cand.layout, offload=True), cand.name + " offload")


def test_device_peak_excludes_what_lives_on_the_host(facts):
    ev = _evaluator(facts)
    cand = _per_block(ev)
    device = offloaded(ev, cand).memory
    parts = device.breakdown
    assert parts["sharded_params"] == 0 and parts["optimizer_states"] == 0
    assert "sharded_grads" not in parts and "optimizer_temporaries" not in parts
    assert device.phase != "optimizer step"
    host = host_bytes(cand.units, "adamw")
    shard = sum(u.shard_numel for u in cand.units)
    assert host == {"sharded_params": 4 * shard, "sharded_grads": 4 * shard,
                    "optimizer_states": 8 * shard}
    # Nothing but what moved to the host (and the copies' transients) changes.
    assert device.peak_bytes < cand.memory.peak_bytes
    on_device = cand.memory.peak_bytes - device.peak_bytes
    assert on_device <= sum(host.values()) + 4 * shard


def test_offload_copies_are_the_shard_and_its_cast(facts):
    """While an all-gather input is built: the shard copied in (float32) and cast (bf16)."""
    ev = _evaluator(facts)
    cand = _per_block(ev)
    ctx = StepContext(precision=Precision(), shard_size=2, optimizer="adamw", buffer_bytes=0,
                      input_bytes=0, offload=True)
    plain = StepContext(precision=Precision(), shard_size=2, optimizer="adamw", buffer_bytes=0,
                        input_bytes=0)
    profile = ev.profile(cand.layout.full, cand.layout.selective)
    with_copies = estimate_peak(profile, cand.units, ctx)
    without = estimate_peak(profile, cand.units, plain)
    biggest = max(u.shard_numel for u in cand.units)
    assert with_copies.peak_bytes <= without.peak_bytes
    if with_copies.breakdown.get("offload_copies"):
        assert with_copies.breakdown["offload_copies"] <= 6 * biggest


def test_offload_time_adds_copies_and_a_cpu_optimizer_step(facts):
    ev = _evaluator(facts)
    cand = _per_block(ev)
    off = offloaded(ev, cand)
    shard = sum(u.shard_numel for u in cand.units)
    assert off.time.optimizer_s == pytest.approx(shard * 4 * 7 / HOST_OPTIMIZER_BANDWIDTH)
    assert off.detail.copy_s == pytest.approx(
        sum(u.shard_numel * 4 * (2 if u.reshard_after_forward else 1)
            for u in cand.units if u.numel) / pcie_bandwidth(hardware_for("h100")))
    assert off.time.step_s >= cand.time.step_s - cand.time.optimizer_s + off.time.optimizer_s
    assert off.collectives == cand.collectives  # offload changes no collective
    assert off.layout.offload and isinstance(off.detail, OffloadDetail)


def test_pcie_bandwidth_comes_from_the_hardware_description():
    h100 = hardware_for("h100")
    assert pcie_bandwidth(dataclasses.replace(h100, h2d_bandwidth=25e9)) == 25e9
    with pytest.raises(BadInput, match="h2d_bandwidth is 0, which means not measured"):
        pcie_bandwidth(dataclasses.replace(h100, h2d_bandwidth=0.0))  # calibrate on a CPU


def _offload_window(facts):
    """A budget no device plan fits but an offloaded one does."""
    from fsdp_plan.api import PlanRequest, plan_from_facts
    from fsdp_plan.common.errors import NoFeasiblePlan
    from fsdp_plan.model.source import ModelSource
    source = ModelSource(source=LLAMA, args={"size": "tiny"}, batch_size=1, seq_len=64)
    budget = 10**8
    while True:
        request = PlanRequest(source=source, budget_bytes=budget, headroom_bytes=0,
                              world_size=2)
        try:
            plan_from_facts(facts, request)
        except NoFeasiblePlan as e:
            return source, budget, str(e)
        budget = budget * 2 // 3


def test_no_fit_names_offload_and_allow_offload_plans_it(facts):
    from fsdp_plan.api import PlanRequest, plan_from_facts, predict
    source, budget, message = _offload_window(facts)
    assert "--allow-offload" in message and "would fit" in message
    result = plan_from_facts(facts, PlanRequest(source=source, budget_bytes=budget,
                                                headroom_bytes=0, world_size=2,
                                                allow_offload=True))
    plan = result.plan
    assert plan.offload.to_dict() == {"params": True, "optimizer": True}
    assert plan.fsdp_plan_version == 2
    assert plan.predicted["peak_bytes"] <= budget
    assert set(plan.predicted["host_bytes"]) == {"sharded_params", "sharded_grads",
                                                 "optimizer_states"}
    # the plan as written predicts the same device peak
    assert predict(plan, facts).predicted["peak_bytes"] == plan.predicted["peak_bytes"]


def test_plan_key_round_trips_and_half_offload_is_refused(facts):
    from fsdp_plan.api import PlanRequest, plan_from_facts
    from fsdp_plan.common.errors import BadInput
    from fsdp_plan.plan.document import Plan
    source, budget, _ = _offload_window(facts)
    plan = plan_from_facts(facts, PlanRequest(source=source, budget_bytes=budget,
                                              headroom_bytes=0, world_size=2,
                                              allow_offload=True)).plan
    doc = yaml.safe_load(yaml.safe_dump(plan.to_dict()))
    doc["model"].pop("digest", None)  # plan_from_facts ran without a model file's digest
    assert doc["offload"] == {"params": True, "optimizer": True}
    assert Plan.from_dict(doc).offload.to_dict() == {"params": True, "optimizer": True}
    doc["offload"] = {"params": True, "optimizer": False}
    with pytest.raises(BadInput, match="together"):
        Plan.from_dict(doc)
    doc["offload"] = {"params": False, "optimizer": False}
    assert "offload" not in Plan.from_dict(doc).to_dict()


@pytest.mark.slow
def test_cli_exits_3_without_the_flag_and_plans_with_it(tmp_path, capsys):
    from fsdp_plan.cli.main import main
    from fsdp_plan.plan.emit import load_policy_module
    plan_path, policy = tmp_path / "p.yaml", tmp_path / "p.py"
    outputs = ["--plan", str(plan_path), "-o", str(policy)]
    assert main([*TINY, "--mem", "2MB", *outputs]) == 3
    err = capsys.readouterr().err
    assert "--allow-offload" in err and "would fit" in err and "Traceback" not in err
    assert not plan_path.exists() and not policy.exists()
    assert main([*TINY, "--mem", "2MB", "--allow-offload", *outputs]) == 0
    out = capsys.readouterr().out
    assert "CPU offload" in out and "on the host per rank" in out
    doc = yaml.safe_load(plan_path.read_text())
    assert doc["offload"] == {"params": True, "optimizer": True}
    assert doc["predicted"]["peak_bytes"] <= 2 * 10**6
    module = load_policy_module(str(policy))
    assert module.PLAN["offload"] == {"params": True, "optimizer": True}
    assert "offload_policy" in module._offload_kwargs()
    assert module.FSDP_KWARGS["cpu_offload"].offload_params is True
    # verify cannot measure a device peak on a CPU: a clear exit 2, not a wrong figure
    assert main(["verify", str(plan_path)]) == 2
    err = capsys.readouterr().err
    assert "cannot be measured" in err and "gpu_check" in err and "Traceback" not in err


@pytest.mark.slow
def test_policy_applies_cpu_offload_to_every_unit(tmp_path):
    """``apply_fully_shard`` gives every ``fully_shard`` call the offload policy (fake process
    group, fake tensors: FSDP2 then keeps each shard on the host device)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from fsdp_plan.cli.main import main
    from fsdp_plan.measure import runtime
    from fsdp_plan.measure.memory import fake_process_group
    from fsdp_plan.model.fake import materialize_fake, new_fake_mode
    from fsdp_plan.model.load import load_model, rebuild_meta
    from fsdp_plan.model.source import ModelSource
    from fsdp_plan.plan.document import read_plan
    from fsdp_plan.plan.emit import load_policy_module
    plan_path, policy = tmp_path / "p.yaml", tmp_path / "p.py"
    assert main([*TINY, "--mem", "2MB", "--allow-offload", "--plan", str(plan_path),
                 "-o", str(policy)]) == 0
    plan = read_plan(str(plan_path))
    loaded = load_model(ModelSource(source=LLAMA, args={"size": "tiny"}, batch_size=1,
                                    seq_len=64))
    module = load_policy_module(str(policy))
    with fake_process_group(2):
        fake_mode = new_fake_mode()
        model = materialize_fake(rebuild_meta(loaded), fake_mode)
        mesh = runtime.make_mesh("cpu", plan.mesh.replicate, plan.mesh.shard)
        with fake_mode:
            model = module.apply_fully_shard(model, mesh)
        states = {id(m._get_fsdp_state()): m._get_fsdp_state() for m in model.modules()
                  if isinstance(m, FSDPModule)}
        assert len(states) == len(plan.units)
        for state in states.values():
            group = state._fsdp_param_group
            assert group is not None and all(p.offload_to_cpu for p in group.fsdp_params)
    assert not dist.is_initialized()
