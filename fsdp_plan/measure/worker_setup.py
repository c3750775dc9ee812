"""The start of every real-worker measurement, written once: process group, device, the
planned model rebuilt on the device with the plan applied, its optimizer and its inputs.

``fsdp-plan bench`` (``fsdp_plan.bench.worker``) and ``count_collectives``
(``fsdp_plan.measure.collectives``) both start here, so counts and timings are measured on
the same set-up; what differs between them is only what they do with the model afterwards.
The payloads these workers receive are plain JSON-able dicts (``source_payload``).
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fsdp_plan.measure import runtime
from fsdp_plan.model.load import LoadedModel, ModelSource


def source_payload(source: ModelSource) -> dict[str, Any]:
    """A ``ModelSource`` as a JSON-able dict for a worker payload (``ModelSource(**d)`` back)."""
    return {"source": source.source, "entry": source.entry, "args": dict(source.args),
            "batch_size": source.batch_size, "seq_len": source.seq_len, "kind": source.kind}


def worker_device(local_rank: int) -> torch.device:
    """``cuda:<local_rank>`` on a GPU machine (and made current), else the CPU."""
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


_kept_process_groups: list[Any] = []
"""Every process group a worker destroyed, still referenced ([Note: ending a worker's process
group])."""


def end_worker_process_group() -> None:
    """Destroy the default process group (and its subgroups) at the end of a worker target,
    keeping their objects alive until the worker exits.

    [Note: ending a worker's process group]
    DDP's C++ ``Reducer`` holds its process group. A bench worker still held its DDP model
    when it called ``destroy_process_group``, so the group's last reference went with the
    model when the target returned: ``~Reducer`` ran ``~ProcessGroupGloo`` in the main thread
    with the GIL held (pybind11 frees a ``Reducer`` without releasing it), and that destructor
    joins gloo's run-loop threads, one of which was still freeing the last collective's work
    and waited for the GIL to drop its tensors: a deadlock (py-spy's stacks; pytorch#56297).
    It hung 1 bench in 10-20 on 2 ranks, after "done", and CI's suite with it. Workers end with
    ``os._exit`` (measure/launch.py), which runs no destructor, so keeping every group
    referenced here means ``~ProcessGroupGloo`` never runs at all, whoever held the group last.
    """
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if not dist.is_initialized():
        return
    world = getattr(distributed_c10d, "_world", None)
    _kept_process_groups.extend(getattr(world, "pg_map", None) or [dist.group.WORLD])
    dist.destroy_process_group()


def init_worker_process_group(local_rank: int) -> torch.device:
    """Initialise the default process group from the environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``/``PORT``, as ``launch`` and torchrun set it): NCCL on GPUs, gloo on CPU.
    Returns this rank's device."""
    import torch.distributed as dist

    torch.set_num_threads(1)  # N workers share the cores; oversubscription only adds noise
    device = worker_device(local_rank)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", device_id=(
            device if device.type == "cuda" else None))
    return device


@dataclass(kw_only=True)
class PlannedWorker:
    """One rank's planned model, ready for training steps."""

    loaded: LoadedModel
    model: nn.Module
    """The real model on ``device`` with the plan applied (FSDP2 or FSDP1)."""
    optimizer: torch.optim.Optimizer | None
    inputs: tuple[tuple, dict]
    """One micro-batch of example inputs on ``device``: ``(args, kwargs)``."""
    device: torch.device
    policy: types.ModuleType


def build_planned_worker(loaded: LoadedModel, device: torch.device, *, policy_source: str,
                         mesh: tuple[int, int] | list[int], fsdp_version: int, optimizer: str,
                         rank: int) -> PlannedWorker:
    """Rebuild the planned model on ``device`` (same weights on every rank), build the
    ``(replicate, shard)`` mesh, apply the plan through its policy module, make the plan's
    optimizer and this rank's inputs (seeded by rank, as data-parallel ranks see different
    data)."""
    policy = runtime.load_policy(policy_source)
    if (policy.PLAN or {}).get("strategy") == "ddp":  # DistributedDataParallel: no mesh
        model = runtime.build_real_model(loaded, device)
        model = policy.apply_ddp(model, device_ids=[device.index] if device.type == "cuda"
                                 else None)
    else:
        replicate, shard = runtime.mesh_shape(mesh)
        device_mesh = runtime.make_mesh(device.type, replicate, shard)
        model = runtime.build_real_model(loaded, device)
        model = runtime.apply_plan(model, policy, device_mesh, fsdp_version=int(fsdp_version),
                                   device=device)
    opt = runtime.plan_optimizer(policy, model, optimizer)
    torch.manual_seed(1 + rank)
    src = loaded.source
    inputs = runtime.to_device(loaded.make_inputs(src.batch_size, src.seq_len), device)
    return PlannedWorker(loaded=loaded, model=model, optimizer=opt, inputs=inputs, device=device,
                         policy=policy)
