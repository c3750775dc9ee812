"""The CUDA caching allocator's own peak for a plan at its real world size, on ONE GPU.

The fake process group makes every collective a no-op, so one process can hold rank 0 of a
64-rank job with REAL tensors: shards are 1/64 of each parameter, all-gather outputs are full
size (their values are garbage, which does not matter for memory). Over the steady step
``torch.cuda.max_memory_allocated()`` is then the number SPEC 5 defines as the GPU peak, and
the FSDPMemTracker measurement (``memory.measure_peak``) and the planner's prediction can be
held against it.

Known limitations: the full model is first built on the GPU (before sharding), so it must fit
once; NCCL's own buffers are not included (there is no NCCL here); the loss and gradients are
computed from garbage values, so a model with data-dependent control flow may take another path.
"""

from __future__ import annotations

import time
import types
from dataclasses import dataclass

import torch

from fsdp_plan.measure import runtime
from fsdp_plan.measure.memory import fake_process_group
from fsdp_plan.model.load import LoadedModel
from fsdp_plan.plan.document import Plan


@dataclass(kw_only=True)
class AllocatorPeak:
    """Rank 0's allocator figures over the steady step (bytes)."""

    peak_bytes: int
    """``max_memory_allocated`` during step 2, including what was alive when it began."""
    step_start_bytes: int
    reserved_peak_bytes: int
    """``max_memory_reserved``: what the allocator held from the driver (fragmentation)."""
    device_name: str
    world_size: int
    seconds: float


def allocator_peak(loaded: LoadedModel, plan: Plan, policy_module: types.ModuleType, *,
                   device: str = "cuda") -> AllocatorPeak:
    """Warm-up step, then the steady step with the allocator's peak statistics reset."""
    if not torch.cuda.is_available():
        raise RuntimeError("allocator_peak needs a CUDA GPU; on CPU use memory.measure_peak.")
    started = time.perf_counter()
    dev = torch.device(device)
    torch.cuda.set_device(dev)
    replicate, shard = runtime.mesh_shape(plan.mesh)
    source = loaded.source
    with fake_process_group(plan.world_size):
        mesh = runtime.make_mesh("cuda", replicate, shard)
        model = runtime.build_real_model(loaded, dev)
        model = policy_module.apply_fully_shard(model, mesh)
        optimizer = runtime.plan_optimizer(policy_module, model)
        inputs = runtime.to_device(loaded.make_inputs(source.batch_size, source.seq_len), dev)
        autocast = runtime.policy_autocast_dtype(policy_module)
        runtime.forward_backward(model, loaded, inputs, autocast)
        runtime.finish_step(model, optimizer)
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        start = torch.cuda.memory_allocated(dev)
        runtime.forward_backward(model, loaded, inputs, autocast)
        runtime.finish_step(model, optimizer)
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
        reserved = torch.cuda.max_memory_reserved(dev)
        del model, optimizer, inputs
    torch.cuda.empty_cache()
    return AllocatorPeak(peak_bytes=int(peak), step_start_bytes=int(start),
                         reserved_peak_bytes=int(reserved),
                         device_name=torch.cuda.get_device_name(dev),
                         world_size=plan.world_size, seconds=time.perf_counter() - started)
