"""The same planned model with its gradient communication kept off the backward's compute:
the reference run of ``fsdp-plan bench --baseline no-overlap`` (bench/overlap.py).

[Note: holding communication until compute is done]
What overlap buys is only visible against the same plan run without it, so the baseline keeps
every collective of the backward from running beside backward compute, with real DDP and real
FSDP2 and no private state changed:

- DDP: a communication hook (``DistributedDataParallel.register_comm_hook``) that holds each
  bucket the reducer hands it and all-reduces them all, in bucket order, when the last bucket
  (``GradBucket.is_last()``) is ready: the buckets DDP built, gradients synced after backward,
  averaged as DDP's default hook does. A plan with its own ``ddp.comm_hook`` is refused
  (``bench/inputs.py``): DDP takes one hook, and a baseline without the plan's compression would
  compare two different plans.
- FSDP2: explicit forward prefetch off (``set_modules_to_forward_prefetch([])``) and backward
  prefetch off. An empty backward list means FSDP2's default prefetch of the next unit, so each
  unit is told to prefetch only itself (``set_modules_to_backward_prefetch([self])``), a no-op:
  it is unsharded by then. Each reduce-scatter is waited where it is issued
  (``set_custom_reduce_scatter``: FSDP2's own reduce-scatter, then the host waits until it has
  finished, so no backward kernel is launched meanwhile). That is the same critical path as
  holding every reduce-scatter to the end of backward (compute alone, then communication
  alone), without keeping every unsharded gradient alive until then, which FSDP2 cannot do
  without accumulating (``set_requires_gradient_sync(False)``) and would change the memory of
  the step. HSDP's all-reduce across replicas still runs on its own stream.

The counting and timed steps never run this way: ``hold_communication`` is called after them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter


class _WaitedReduceScatter(DefaultReduceScatter):
    """FSDP2's default reduce-scatter, then a wait for it on the host."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op: Any, async_op: bool = False) -> Any:
        work = super().__call__(output_tensor, input_tensor, group, op, async_op=async_op)
        if work is not None:
            work.wait()
        if output_tensor.device.type == "cuda":  # the reduce-scatter stream is current here
            torch.cuda.current_stream(output_tensor.device).synchronize()
        return None


def _held_buckets_hook():
    """A DDP communication hook (a function: DDP logs its ``__name__``): every bucket held until
    the last is ready, then each all-reduced and averaged, in DDP's bucket order."""
    held: list[tuple[torch.Tensor, torch.futures.Future]] = []

    # no annotations: DDP compares them with dist.GradBucket and Future[Tensor], and
    # ``from __future__ import annotations`` would make them strings
    def held_until_last_bucket(process_group, bucket):
        group = process_group if process_group is not None else dist.group.WORLD
        future: torch.futures.Future = torch.futures.Future()
        held.append((bucket.buffer(), future))
        if bucket.is_last():
            world = dist.get_world_size(group)
            for buffer, waiting in held:
                buffer.div_(world)
                dist.all_reduce(buffer, group=group)
                waiting.set_result(buffer)
            held.clear()
        return future
    return held_until_last_bucket


def hold_communication(model: torch.nn.Module) -> str:
    """Switch ``model`` (DDP or FSDP2, as the plan applied it) to the baseline of [Note: holding
    communication until compute is done]; what was done, in words."""
    if hasattr(model, "register_comm_hook") and hasattr(model, "_get_ddp_logging_data"):
        model.register_comm_hook(None, _held_buckets_hook())
        return ("DDP buckets held by a communication hook until the last is ready, then "
                "all-reduced in bucket order after backward compute")
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        raise ValueError("hold_communication: the model is neither DDP nor FSDP2")
    for unit in units:
        unit.set_modules_to_forward_prefetch([])
        unit.set_modules_to_backward_prefetch([unit])
        unit.set_custom_reduce_scatter(_WaitedReduceScatter())
    return ("FSDP2 prefetch off and each reduce-scatter waited on the host before backward "
            "compute goes on")
