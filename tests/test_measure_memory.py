"""measure_peak against PyTorch's own FSDPMemTracker, driven directly in the test."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
import torch.distributed as dist
from test_measure_helpers import LLAMA, tiny_llama_plan

from fsdp_plan.common.errors import BadInput
from fsdp_plan.measure import runtime
from fsdp_plan.measure.memory import fake_process_group, measure_peak


def _measure(plan):
    loaded = runtime.load_planned_model(plan)
    return measure_peak(loaded, plan, runtime.load_policy(runtime.policy_source(plan)))


def _llama_module():
    spec = importlib.util.spec_from_file_location("_measure_test_llama", LLAMA)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _direct_tracker_peak(world: int, batch: int, seq: int) -> int:
    """The steady-step peak the way TORCH_NOTES describes it, without fsdp_plan's code path:
    fully_shard by hand, one tracker, its overall peak restarted before step 2."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fsdp_plan.model.fake import materialize_fake

    llama = _llama_module()
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with torch.device("meta"):
            model = llama.build_model(size="tiny", n_layers=4)
        materialize_fake(model, mode)
        mesh = init_device_mesh("cpu", (world,))
        with mode:
            for block in model.layers:
                fully_shard(block, mesh=mesh, reshard_after_forward=True)
            fully_shard(model, mesh=mesh, reshard_after_forward=False)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            tokens = torch.randint(0, model.cfg.vocab_size, (batch, seq))
            tracker = FSDPMemTracker(model, opt)
            tracker.track_inputs((tokens,))
            with tracker:
                for step in range(2):
                    if step == 1:
                        tracker.reset_mod_stats()
                        current = tracker.get_tracker_snapshot("current")
                        tracker._peak_mem = {d: s["Total"] for d, s in current.items()}
                        tracker._peak_mem_snap = current
                    llama.loss_fn(model(tokens)).backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
            return sum(s["Total"] for s in tracker.get_tracker_snapshot("peak").values())
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def base4():
    return _measure(tiny_llama_plan(world=4, batch_size=2, seq_len=32))


def test_peak_equals_a_direct_fsdp_mem_tracker_run(base4):
    world, measured = 4, base4
    assert measured.peak_bytes == _direct_tracker_peak(world, 2, 32)
    # 262,720 fp32 parameters, each rank keeps 1/world of them (padded per parameter).
    assert 262_720 * 4 // world <= measured.breakdown["Sharded Param"] <= 262_720 * 4 // world + 4096
    assert measured.step_start_bytes < measured.peak_bytes
    assert set(measured.module_peaks) >= {"", "layers.0", "layers.3"}
    assert not dist.is_initialized()  # safe to call again in this process


def test_checkpointing_and_bf16_are_measured(base4):
    both = _measure(tiny_llama_plan(world=4, ac=[f"layers.{i}" for i in range(4)],
                                    mixed_precision={"param_dtype": "bfloat16",
                                                     "reduce_dtype": "float32"}))
    assert both.peak_bytes < base4.peak_bytes
    assert both.breakdown["Activation"] < base4.breakdown["Activation"]
    # The peak holds the root's unsharded parameters (65,600, reshard_after_forward=False)
    # and one block's (49,280): 4 bytes each in float32, 2 in bfloat16.
    assert base4.breakdown["Unsharded Param"] == (65_600 + 49_280) * 4
    assert both.breakdown["Unsharded Param"] < base4.breakdown["Unsharded Param"]
    assert base4.breakdown["OptState"] >= 2 * 262_720 * 4 // 4  # AdamW: exp_avg, exp_avg_sq


def test_fsdp1_and_an_existing_process_group_are_refused():
    plan = tiny_llama_plan(world=2)
    with pytest.raises(BadInput, match="FSDP2"):
        measure_peak(runtime.load_planned_model(plan), plan, None, fsdp_version=1)
    plan.strategy = "ddp"  # no shards to track: measure.peak sends it to a real run instead
    with pytest.raises(BadInput, match="measured_peak"):
        measure_peak(runtime.load_planned_model(plan), plan, None)
    with fake_process_group(2), pytest.raises(RuntimeError, match="already exists"), \
            fake_process_group(2):
        pass
    assert not dist.is_initialized()
