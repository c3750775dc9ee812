"""CPU offload's cost: what FSDP2 ``CPUOffloadPolicy`` moves to the host, its copies and the
optimizer step on the CPU.

[Note: offload as the last resort]
Asked for with ``--allow-offload`` and chosen only when no plan fits on the device
(``search/offload.py``). The sharded parameters, their gradients and the optimizer states then
live in pinned host memory and the optimizer steps on the CPU (cost/memory.py [Note: CPU
offload on the device] for what stays on the device). Its time cost, added to the device
plan's simulated step:
- every all-gather first copies the unit's shard host-to-device (stored dtype), and every
  reduce-scatter's output is copied back; these copies run at the host link's bandwidth
  (``h2d_bandwidth`` of the hardware description: PCIe Gen5 x16 on H100/H200/B200 hosts,
  Gen4 on A100; 0 means not measured and offload is then refused) on their own copy
  engine, so they hide behind compute the communication stream left free, and what does not
  fit there is exposed;
- the optimizer step runs on the CPU instead of the device: AdamW reads parameters, gradients
  and both states and writes parameters and states (cost/precision.py [Note: optimizer
  bytes]) at ``HOST_OPTIMIZER_BANDWIDTH``; it cannot overlap (the next step's all-gathers need
  its result).
These are estimates: on a CPU-only machine host and device are the same memory, so the
offloaded device peak can be checked only on a GPU (``fsdp_plan.bench.gpu_check``).
"""

from __future__ import annotations

import dataclasses

from fsdp_plan.common.errors import BadInput
from fsdp_plan.cost.hardware import Hardware
from fsdp_plan.cost.precision import OPTIMIZER_STATES, step_bytes
from fsdp_plan.cost.step_time import StepTime
from fsdp_plan.cost.streams import DeferredSpans, Span
from fsdp_plan.cost.units import UnitSpec

HOST_OPTIMIZER_BANDWIDTH = 25e9
"""Bytes/s per GPU that PyTorch's CPU AdamW (``foreach``) moves: an estimate. A dual-socket
DGX H100 host (2 x Xeon 8480C, 16 channels DDR5-4800, 614 GB/s peak, ~400 GB/s STREAM triad)
shared by 8 ranks gives ~50 GB/s each; the CPU kernels reach about half of that."""


def pcie_bandwidth(hardware: Hardware) -> float:
    """The host link's copy bandwidth from the hardware description (see the Note).

    ``h2d_bandwidth: 0`` means not measured (``fsdp-plan calibrate`` on a CPU, which has no
    device to copy to): offload copies cannot be priced then, and pricing them at a GPU
    host's PCIe figure, or at nothing, would invent the step (issue 21, S3-05), so it is a
    ``BadInput``."""
    if hardware.h2d_bandwidth > 0:
        return float(hardware.h2d_bandwidth)
    raise BadInput(f"offload copies cannot be priced on hardware {hardware.name!r}: its "
                   "h2d_bandwidth is 0, which means not measured (fsdp-plan calibrate writes 0 "
                   "on a CPU, which has no device to copy to). Set h2d_bandwidth in the "
                   "hardware file to the host-to-device copy rate in bytes/s (e.g. 50e9 for PCIe "
                   "Gen5 x16), or plan without offload (no --allow-offload).")


def offload_priced(hardware: Hardware) -> bool:
    """Whether ``pcie_bandwidth`` can price offload copies on ``hardware``."""
    return hardware.h2d_bandwidth > 0


def host_bytes(units: list[UnitSpec], optimizer: str, orig_bytes: int = 4) -> dict[str, int]:
    """What lives on the host per rank: sharded parameters, their gradients, optimizer states."""
    shard = sum(u.shard_numel for u in units)
    states = OPTIMIZER_STATES.get(optimizer, 0)
    return {"sharded_params": shard * orig_bytes, "sharded_grads": shard * orig_bytes,
            "optimizer_states": states * shard * orig_bytes}


def offload_seconds(units: list[UnitSpec], time: StepTime, hardware: Hardware, optimizer: str,
                    orig_bytes: int) -> tuple[float, float, float]:
    """(copy seconds per step, exposed copy seconds, CPU optimizer seconds) for ``units``
    whose device step is ``time``."""
    to_device = sum(u.shard_numel * orig_bytes * (2 if u.reshard_after_forward else 1)
                    for u in units if u.numel)
    to_host = sum(u.shard_numel * orig_bytes for u in units if u.numel)
    copy_s = max(to_device, to_host) / pcie_bandwidth(hardware)  # the link is full duplex
    free_compute = max(0.0, time.forward_s + time.backward_s - time.hidden_comm_s)
    exposed = max(0.0, copy_s - free_compute)
    shard = sum(u.shard_numel for u in units)
    optimizer_s = (0.0 if optimizer == "none"
                   else step_bytes(optimizer, shard, orig_bytes) / HOST_OPTIMIZER_BANDWIDTH)
    return copy_s, exposed, optimizer_s


def offloaded_time(time: StepTime, copy_s: float, exposed_s: float,
                   cpu_optimizer_s: float) -> StepTime:
    """The device step ``time`` with the copies' exposed part and the optimizer on the CPU."""
    end = time.step_s - time.optimizer_s + exposed_s

    def spans() -> list[Span]:  # read as the device step's are ([Note: spans when read])
        kept = [sp for sp in time.spans if sp[1] != "optimizer"]
        kept.append(("compute", "optimizer (CPU)", end, end + cpu_optimizer_s))
        return kept
    return dataclasses.replace(
        time, step_s=end + cpu_optimizer_s, optimizer_s=cpu_optimizer_s,
        exposed_comm_s=time.exposed_comm_s + exposed_s, total_comm_s=time.total_comm_s + copy_s,
        spans=DeferredSpans(spans))
