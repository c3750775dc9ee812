"""Optimizer overlap (SPEC 8, ``optimizer_overlap: true``; issue 27 item 2): each parameter
stepped in backward. Checked against PyTorch: the predicted peak against FSDPMemTracker (FSDP2,
fake process group) and MemTracker (DDP, a real gloo rank), the training against the plain
loop's losses on two gloo ranks through the generated policy's ``apply``; and the plan field,
its refusals, the clock and the launch check."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.distributed as dist
from test_measure_helpers import LLAMA, plan_file, run_cli, tiny_llama_plan
from torch import nn

from fsdp_plan.api import plan_from_facts, predict
from fsdp_plan.common.errors import BadInput
from fsdp_plan.cost.hardware import hardware_for
from fsdp_plan.cost.memory import estimate_peak, memory_timeline
from fsdp_plan.cost.step_time import UnitCost, simulate_step
from fsdp_plan.facts.types import ModelFacts
from fsdp_plan.measure import runtime
from fsdp_plan.measure.launch import launch
from fsdp_plan.measure.peak import measured_peak
from fsdp_plan.model.load import ModelSource, load_model, source_kind
from fsdp_plan.pictures.series import plan_timeline, step_series
from fsdp_plan.plan.document import Plan, read_plan
from fsdp_plan.plan.emit import load_policy_module, render_policy_module
from fsdp_plan.policy_runtime import OptimizerInBackward
from fsdp_plan.search.evaluator import Evaluator
from fsdp_plan.search.request import PlanRequest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPT2 = os.path.join(ROOT, "examples", "gpt2.py")
LLAMA8 = [LLAMA, "--model-arg", "size=tiny", "--model-arg", "n_layers=8", "--seq-len", "8"]

# its plans and predictions of the same small models share their analyses (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("facts_cache_per_file")


def _plan(tmp_path, *argv: str, name: str = "plan.yaml") -> Plan:
    path = str(tmp_path / name)
    code, _, err = run_cli([*argv, "--plan", path, "--format", "json"])
    assert code == 0, err
    return read_plan(path)


def _measured(plan: Plan) -> int:
    m = plan.model
    loaded = load_model(ModelSource(source=m.source, entry=m.entry, args=m.args,
                                    batch_size=m.batch_size, seq_len=m.seq_len,
                                    kind=source_kind(m.source)))
    return measured_peak(loaded, plan, load_policy_module(render_policy_module(plan))).peak_bytes


# --- memory against PyTorch's trackers ------------------------------------------------------

@pytest.mark.slow
def test_fsdp2_plan_fits_only_with_the_optimizer_in_backward_and_its_peak_is_measured(tmp_path):
    """Tiny Llama of 8 blocks at 5 MB on 2 ranks: without overlap nothing fits on the device
    (exit 3); with it the plan fits, and FSDPMemTracker measures its peak within 3%."""
    argv = [*LLAMA8, "--mem", "5MB", "--world-size", "2", "--strategy", "full"]
    code, _, _ = run_cli([*argv, "--format", "json"])
    assert code == 3
    plan = _plan(tmp_path, *argv, "--optimizer-overlap")
    assert plan.optimizer_overlap and plan.fsdp_plan_version == 2
    predicted, measured = plan.predicted["peak_bytes"], _measured(plan)
    assert abs(predicted - measured) <= 0.03 * measured, (predicted, measured)
    assert predicted <= plan.limit_bytes


@pytest.mark.slow
@pytest.mark.parametrize("strategy, world", [("full", 4), ("ddp", 2)])
def test_overlap_removes_the_optimizer_step_peak_as_the_trackers_measure(tmp_path, strategy,
                                                                         world):
    """Both peaks, with the optimizer after backward and in it, within 3% of the trackers'.
    DDP's step peaked at the optimizer step (the whole model's step temporary) and peaks lower
    in backward; FSDP2's peaks at the end of backward either way (the root's reduce-scatter
    input beside its gradients, or beside its step)."""
    argv = [GPT2, "--model-arg", "size=tiny", "--seq-len", "16", "--mem", "40MB",
            "--world-size", str(world), "--strategy", strategy]
    plain = _plan(tmp_path, *argv, name="plain.yaml")
    overlapped = _plan(tmp_path, *argv, "--optimizer-overlap", name="overlap.yaml")
    if strategy == "ddp":
        assert plain.predicted["peak_phase"] == "optimizer step"
        assert overlapped.predicted["peak_bytes"] < plain.predicted["peak_bytes"]
    for plan in (plain, overlapped):
        predicted, measured = plan.predicted["peak_bytes"], _measured(plan)
        assert abs(predicted - measured) <= 0.03 * measured, (plan.optimizer_overlap, predicted,
                                                               measured)


# --- training: the same losses as the plain loop --------------------------------------------

def _losses_rank(ctx, payload) -> list[float]:
    """One gloo rank: 10 steps of the planned model through the policy's ``apply``; with the
    optimizer in backward the loop calls ``step`` and ``zero_grad`` of what stands for it."""
    dist.init_process_group("gloo", rank=ctx.rank, world_size=ctx.world_size)
    policy = runtime.load_policy(payload["policy"])
    loaded = load_model(ModelSource(**payload["source"]))
    model = runtime.build_real_model(loaded, torch.device("cpu"))
    if policy.PLAN.get("optimizer_overlap"):
        model = policy.apply(model, optimizer_kwargs={"lr": 1e-2})
        optimizer = policy.in_backward_optimizer(model)
        assert isinstance(optimizer, torch.optim.Optimizer)
    else:
        model = policy.apply(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
    losses = []
    for step in range(10):
        torch.manual_seed(100 + step * ctx.world_size + ctx.rank)
        args, kwargs = loaded.make_inputs(2, 8)
        loss = loaded.compute_loss(model(*args, **kwargs))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        assert all(p.grad is None for p in model.parameters())
        losses.append(loss.item())
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.25)
    return losses


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["full", "ddp"])
def test_the_optimizer_in_backward_trains_as_the_plain_loop(tmp_path, strategy):
    """Two gloo ranks, 10 steps, a learning-rate schedule: the losses with each parameter
    stepped in backward equal the plain loop's (one AdamW after backward) within float
    tolerance. DDP's plan is planned with small buckets, so several buckets step in turn."""
    argv = [LLAMA, "--model-arg", "size=tiny", "--seq-len", "8", "--mem", "40MB",
            "--world-size", "2", "--strategy", strategy]
    plain = _plan(tmp_path, *argv, name="plain.yaml")
    overlapped = _plan(tmp_path, *argv, "--optimizer-overlap", name="overlap.yaml")
    if strategy == "ddp":  # buckets of a quarter MiB: the tiny Llama's 1 MiB in several
        for plan in (plain, overlapped):
            plan.ddp = {**plan.ddp.to_dict(), "bucket_cap_mb": 0.25, "first_bucket_mb": 0.25}
    source = {"source": LLAMA, "entry": "build_model", "args": {"size": "tiny"},
              "batch_size": 2, "seq_len": 8, "kind": "file"}
    module = os.path.splitext(os.path.basename(__file__))[0]
    runs = [launch(f"{module}:_losses_rank", {"policy": render_policy_module(plan),
                                              "source": source}, nproc=2, timeout_s=120)
            for plan in (plain, overlapped)]
    for rank in range(2):
        assert runs[1][rank] == pytest.approx(runs[0][rank], rel=1e-5, abs=1e-6), rank
    assert runs[0][0][-1] < runs[0][0][0]  # it trained


# --- the plan field and its refusals --------------------------------------------------------

def test_the_field_is_written_only_when_true_and_reads_back():
    plan = tiny_llama_plan(world=2)
    assert "optimizer_overlap" not in plan.to_dict()
    plan.optimizer_overlap = True
    doc = plan.to_dict()
    assert doc["optimizer_overlap"] is True and doc["fsdp_plan_version"] == 2
    assert Plan.from_dict(doc).optimizer_overlap is True
    assert "in_backward_optimizer(model)" in render_policy_module(plan)


@pytest.mark.parametrize("change, needle", [
    ({"optimizer": "none"}, "no optimizer"),
    ({"grad_accum_steps": 4}, "accumulates 4 micro-batches"),
    ({"offload": {"params": True, "optimizer": True}}, "offloads to the CPU"),
    ({"optimizer_overlap": "yes"}, "must be true or false"),
    ({"fsdp_plan_version": 1}, "needs fsdp_plan_version: 2"),
])
def test_a_plan_that_cannot_step_in_backward_is_refused(change, needle):
    plan = tiny_llama_plan(world=2)
    plan.optimizer_overlap = True
    doc = {**plan.to_dict(), **change}
    with pytest.raises(BadInput, match="optimizer_overlap") as caught:
        Plan.from_dict(doc)
    assert needle in str(caught.value)


def test_a_ddp_plan_with_a_communication_hook_cannot_step_in_backward():
    doc = {"fsdp_plan_version": 2, "model": {"source": LLAMA, "kind": "file"},
           "budget_bytes": 10**9, "world_size": 2, "mesh": {"replicate": 2, "shard": 1},
           "strategy": "ddp", "units": [{"modules": [""], "reshard_after_forward": False}],
           "ddp": {"comm_hook": "fp16_compress"}, "optimizer_overlap": True}
    with pytest.raises(BadInput, match="DDP takes one"):
        Plan.from_dict(doc)


@pytest.mark.parametrize("extra, needle", [
    (["--optimizer", "none"], "--optimizer none"),
    (["--batch-size", "1", "--global-batch-size", "8"], "no accumulation"),
    (["--global-batch-size", "8"], "--global-batch-size"),
    (["--framework", "accelerate"], "steps its own optimizer"),
])
def test_the_command_refuses_what_cannot_step_in_backward(tmp_path, extra, needle):
    code, _, err = run_cli([LLAMA, "--model-arg", "size=tiny", "--seq-len", "8", "--mem",
                            "40MB", "--world-size", "2", "--optimizer-overlap", *extra,
                            "--plan", str(tmp_path / "p.yaml")])
    assert code == 2, err
    assert needle in err and "Traceback" not in err
    assert not (tmp_path / "p.yaml").exists()


def test_export_refuses_a_plan_whose_optimizer_steps_in_backward(tmp_path):
    plan = tiny_llama_plan(world=2)
    plan.optimizer_overlap = True
    path = plan_file(tmp_path, plan)
    code, _, err = run_cli(["export", path, "--to", "accelerate", "-o", str(tmp_path / "out")])
    assert code == 2 and "steps its own optimizer" in err, err
    assert not (tmp_path / "out").exists()


# --- the clock -------------------------------------------------------------------------------

def _units(optimizer_s: float) -> list[UnitCost]:
    return [UnitCost(key=f"u{i}", fw_compute_s=1e-3, bw_compute_s=2e-3, all_gather_s=2e-4,
                     reduce_scatter_s=2e-4, optimizer_s=optimizer_s) for i in range(4)]


def test_on_a_gpu_the_in_backward_steps_hide_behind_backward_but_the_last():
    hw = hardware_for("h100")
    after = simulate_step(_units(0.0), hw, optimizer_s=4 * 5e-4)
    inside = simulate_step(_units(5e-4), hw)
    # only the last unit's step (after its reduce-scatter) is left after backward
    assert inside.optimizer_s == pytest.approx(5e-4 + 2e-4 - after.comm_tail_s, abs=1e-9) or \
        inside.optimizer_s <= 5e-4 + 1e-12
    assert inside.step_s < after.step_s
    assert inside.contention_s > after.contention_s  # the steps slowed the compute beside them
    assert inside.total_comm_s == pytest.approx(after.total_comm_s)  # no communication
    assert inside.step_s == pytest.approx(
        inside.forward_s + inside.backward_s + (inside.contention_s - inside.backward_contention_s)
        + inside.exposed_comm_s + inside.optimizer_s + inside.host_wait_s)


def test_where_the_host_computes_in_line_the_steps_stay_on_the_critical_path():
    hw = dataclasses.replace(hardware_for("h100"), async_launch=False,
                             comm_overlaps_compute=False)
    after = simulate_step(_units(0.0), hw, optimizer_s=4 * 5e-4)
    inside = simulate_step(_units(5e-4), hw)
    assert inside.optimizer_s == pytest.approx(4 * 5e-4)
    assert inside.step_s == pytest.approx(after.step_s)


# --- the policy's pieces ---------------------------------------------------------------------

def test_launch_check_names_a_missing_in_backward_optimizer():
    plan = tiny_llama_plan(world=1)
    plan.optimizer_overlap = True
    plan.mesh.shard = 1
    policy = load_policy_module(render_policy_module(plan))
    model = nn.Linear(2, 2)
    assert any("optimizer_overlap" in d for d in policy.launch_differences(model))


def test_the_stand_in_gathers_states_and_refuses_another_models_state_dict():
    params = [nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))]
    optimizers = [torch.optim.AdamW([p], lr=0.1) for p in params]
    for p, o in zip(params, optimizers):
        p.grad = torch.ones_like(p)
        o.step()
    stand_in = OptimizerInBackward(optimizers)
    assert set(stand_in.state) == set(params)
    assert stand_in.step() is None
    saved = stand_in.state_dict()
    stand_in.load_state_dict(saved)
    with pytest.raises(ValueError, match="in-backward"):
        stand_in.load_state_dict({"in_backward": saved["in_backward"][:1]})
    for group in stand_in.param_groups:
        group["lr"] = 0.5
    assert all(o.param_groups[0]["lr"] == 0.5 for o in optimizers)


def test_the_pictures_timeline_peaks_where_the_overlapped_sweep_does():
    """With the optimizer in backward, memory_timeline (the pictures' model) holds the
    in-backward steps too: its highest total is every FSDP candidate's predicted peak, and
    the step series the page draws peaks at the plan's."""
    with open(os.path.join(ROOT, "tests", "fixtures", "tiny_llama_facts.json")) as f:
        facts = ModelFacts.from_json(f.read())
    source = ModelSource(source=LLAMA, args={"size": "tiny"}, batch_size=2, seq_len=64)
    request = PlanRequest(source=source, budget_bytes=3 * 10**6, world_size=8, gpus_per_node=4,
                          strategy="full", optimizer_overlap=True)
    result = plan_from_facts(facts, request)
    evaluator = Evaluator(facts.graph, facts.analysis, request.settings())
    checked = 0
    for c in result.ranked:
        assert c.layout.optimizer_overlap
        profile = evaluator.profile_of(c)
        ctx = evaluator.step_context(c.shard, optimizer_overlap=True)
        kw = {"forward_prefetch": c.forward_prefetch, "backward_prefetch": c.backward_prefetch}
        assert memory_timeline(profile, c.units, ctx, **kw).peak_bytes \
            == estimate_peak(profile, c.units, ctx, **kw).peak_bytes == c.memory.peak_bytes
        # the parts are those at that peak (worked out when first read, after the sweep
        # looked at every in-backward step)
        assert sum(c.memory.breakdown.values()) == c.memory.peak_bytes
        checked += 1
    assert checked >= 5
    prediction = predict(result.plan, facts, gpus_per_node=4)
    series = step_series(plan_timeline(result.plan, facts, prediction), prediction.candidate.time)
    assert series.peak_bytes == result.plan.predicted["peak_bytes"]
