"""CPU offload as the last resort: FSDP2 ``CPUOffloadPolicy`` on device memory and step time.

[Note: offload as the last resort]
Asked for with ``--allow-offload`` and chosen only when no plan fits on the device. The
sharded parameters, their gradients and the optimizer states then live in pinned host memory
and the optimizer steps on the CPU (memory.py [Note: CPU offload on the device] for what stays
on the device). Its time cost, added to the device plan's simulated step:
- every all-gather first copies the unit's shard host-to-device (stored dtype), and every
  reduce-scatter's output is copied back; these copies run at the host link's bandwidth
  (``h2d_bandwidth`` of the hardware description: PCIe Gen5 x16 on H100/H200/B200 hosts,
  Gen4 on A100; 0 means not measured and offload is then refused) on their own copy
  engine, so they hide behind compute the communication stream left free, and what does not
  fit there is exposed;
- the optimizer step runs on the CPU instead of the device: AdamW reads parameters, gradients
  and both states and writes parameters and states, ``(3 + 2 * states) * 4`` bytes per
  parameter of the rank's shard, at ``HOST_OPTIMIZER_BANDWIDTH``; it cannot overlap (the next
  step's all-gathers need its result).
These are estimates: on a CPU-only machine host and device are the same memory, so the
offloaded device peak can be checked only on a GPU (``fsdp_plan.bench.gpu_check``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fsdp_plan.errors import BadInput
from fsdp_plan.memory import OPTIMIZER_STATES, MemoryEstimate, StepContext, estimate_peak
from fsdp_plan.search import Candidate, Evaluator

OFFLOAD_ALL = {"params": True, "optimizer": True}
"""The plan's ``offload`` key (SPEC 6): ``CPUOffloadPolicy`` moves both."""
DEFAULT_PCIE_BANDWIDTH = 50e9
"""Bytes/s of pinned host-device copies when the hardware description has no ``h2d_bandwidth``:
PCIe Gen5 x16 is 64 GB/s per direction (PCI-SIG); pinned ``cudaMemcpyAsync`` reaches ~50-55."""
HOST_OPTIMIZER_BANDWIDTH = 25e9
"""Bytes/s per GPU that PyTorch's CPU AdamW (``foreach``) moves: an estimate. A dual-socket
DGX H100 host (2 x Xeon 8480C, 16 channels DDR5-4800, 614 GB/s peak, ~400 GB/s STREAM triad)
shared by 8 ranks gives ~50 GB/s each; the CPU kernels reach about half of that."""


@dataclass(kw_only=True)
class OffloadCandidate(Candidate):
    """A candidate planned with ``CPUOffloadPolicy``: ``device_memory`` is what stays on the
    device (``memory``, the figure held against the budget), ``host_bytes`` what moves off it."""

    offload: dict[str, bool] = dataclasses.field(default_factory=lambda: dict(OFFLOAD_ALL))
    host_bytes: dict[str, int] = dataclasses.field(default_factory=dict)
    copy_s: float = 0.0
    """Host-device copy time per step (both directions), before overlap."""


def pcie_bandwidth(hardware) -> float:
    """The host link's copy bandwidth from the hardware description (see the Note).

    ``h2d_bandwidth: 0`` means not measured (``fsdp-plan calibrate`` on a CPU, which has no
    device to copy to): offload copies cannot be priced then, and pricing them at a GPU
    host's PCIe figure, or at nothing, would invent the step (issue 21, S3-05), so it is a
    ``BadInput``. A description without the field at all takes ``DEFAULT_PCIE_BANDWIDTH``."""
    value = getattr(hardware, "h2d_bandwidth", None)
    if value is None:
        return DEFAULT_PCIE_BANDWIDTH
    if value > 0:
        return float(value)
    name = getattr(hardware, "name", "?")
    raise BadInput(f"offload copies cannot be priced on hardware {name!r}: its h2d_bandwidth "
                   "is 0, which means not measured (fsdp-plan calibrate writes 0 on a CPU, which "
                   "has no device to copy to). Set h2d_bandwidth in the "
                   "hardware file to the host-to-device copy rate in bytes/s (e.g. 50e9 for PCIe "
                   "Gen5 x16), or plan without offload (no --allow-offload).")


def offload_priced(hardware) -> bool:
    """Whether ``pcie_bandwidth`` can price offload copies on ``hardware``."""
    return getattr(hardware, "h2d_bandwidth", None) != 0


def host_bytes(candidate: Candidate, optimizer: str, orig_bytes: int = 4) -> dict[str, int]:
    """What lives on the host per rank: sharded parameters, their gradients, optimizer states."""
    shard = sum(u.shard_numel for u in candidate.units)
    states = OPTIMIZER_STATES.get(optimizer, 0)
    return {"sharded_params": shard * orig_bytes, "sharded_grads": shard * orig_bytes,
            "optimizer_states": states * shard * orig_bytes}


def _profile(evaluator: Evaluator, candidate: Candidate):
    """The activation profile the candidate was evaluated with."""
    index = {b: i for i, b in enumerate(evaluator.graph.blocks)}
    selective = frozenset(index[b] for b in getattr(candidate, "selective", []) if b in index)
    full = frozenset(index[b] for b in candidate.checkpointed if b in index) - selective
    return evaluator.profile(full, selective) if selective else evaluator.profile(full)


def offload_memory(evaluator: Evaluator, candidate: Candidate) -> MemoryEstimate:
    """Device peak of ``candidate`` with ``CPUOffloadPolicy`` (memory.py's model, offload on)."""
    s = evaluator.settings
    ctx = StepContext(precision=s.precision, shard_size=candidate.shard, optimizer=s.optimizer,
                      buffer_bytes=evaluator.graph.total_buffer_bytes,
                      input_bytes=evaluator.analysis.input_bytes, offload=True)
    return estimate_peak(_profile(evaluator, candidate), candidate.units, ctx,
                         forward_prefetch=candidate.forward_prefetch,
                         backward_prefetch=candidate.backward_prefetch)


def offload_seconds(evaluator: Evaluator, candidate: Candidate) -> tuple[float, float, float]:
    """(copy seconds per step, exposed copy seconds, CPU optimizer seconds) for ``candidate``."""
    s = evaluator.settings
    orig = s.precision.orig_bytes
    to_device = sum(u.shard_numel * orig * (2 if u.reshard_after_forward else 1)
                    for u in candidate.units if u.numel)
    to_host = sum(u.shard_numel * orig for u in candidate.units if u.numel)
    bandwidth = pcie_bandwidth(s.hardware)
    copy_s = max(to_device, to_host) / bandwidth  # the link is full duplex
    t = candidate.time
    free_compute = max(0.0, t.forward_s + t.backward_s - t.hidden_comm_s)
    exposed = max(0.0, copy_s - free_compute)
    shard = sum(u.shard_numel for u in candidate.units)
    states = OPTIMIZER_STATES.get(s.optimizer, 0)
    optimizer_s = (0.0 if s.optimizer == "none"
                   else shard * orig * (3 + 2 * states) / HOST_OPTIMIZER_BANDWIDTH)
    return copy_s, exposed, optimizer_s


def with_offload(evaluator: Evaluator, candidate: Candidate) -> OffloadCandidate:
    """``candidate`` re-evaluated with ``CPUOffloadPolicy``: device peak and step time."""
    memory = offload_memory(evaluator, candidate)
    copy_s, exposed, cpu_optimizer_s = offload_seconds(evaluator, candidate)
    t = candidate.time
    end = t.step_s - t.optimizer_s + exposed
    spans = [sp for sp in t.spans if sp[1] != "optimizer"]
    spans.append(("compute", "optimizer (CPU)", end, end + cpu_optimizer_s))
    time = dataclasses.replace(
        t, step_s=end + cpu_optimizer_s, optimizer_s=cpu_optimizer_s,
        exposed_comm_s=t.exposed_comm_s + exposed, total_comm_s=t.total_comm_s + copy_s,
        spans=spans)
    fields = {f.name: getattr(candidate, f.name) for f in dataclasses.fields(Candidate)}
    fields.update(name=candidate.name + " offload", memory=memory, time=time,
                  fits=_runnable(evaluator, candidate)
                  and memory.peak_bytes <= evaluator.settings.limit_bytes)
    return OffloadCandidate(**fields, host_bytes=host_bytes(candidate, evaluator.settings.optimizer,
                                                            evaluator.settings.precision.orig_bytes),
                            copy_s=copy_s)


def _runnable(evaluator: Evaluator, candidate: Candidate) -> bool:
    """Whether every unit with parameters runs forward (as ``Evaluator.evaluate`` requires)."""
    profile = _profile(evaluator, candidate)
    return all(profile.ran(u) or u.numel == 0 or u.modules == [""]
               for u in candidate.units)


def best_offloaded(evaluator: Evaluator, candidates: list[Candidate], limit: int = 12
                   ) -> OffloadCandidate | None:
    """The fastest fitting offloaded variant among the ``limit`` smallest-peak candidates (and,
    for each, fewer checkpointed blocks: offload frees room that checkpointing bought), else
    the one with the smallest device peak; None without candidates."""
    if not offload_priced(evaluator.settings.hardware):
        return None  # nothing to offer; --allow-offload itself is refused (PlanRequest)
    # DDP keeps whole replicas (no CPUOffloadPolicy); FSDP candidates only.
    pool = sorted((c for c in candidates if c.strategy != "ddp"),
                  key=lambda c: c.memory.peak_bytes)[:limit]
    tried: list[OffloadCandidate] = []
    for cand in pool:
        tried.append(with_offload(evaluator, cand))
        if tried[-1].fits and cand.checkpointed and not getattr(cand, "selective", None):
            fewer = _fewest_checkpointed_offloaded(evaluator, cand)
            if fewer is not None:
                tried.append(fewer)
    if not tried:
        return None
    fitting = [c for c in tried if c.fits]
    if fitting:
        return min(fitting, key=lambda c: (round(c.time.step_s, 9), c.memory.peak_bytes))
    return min(tried, key=lambda c: c.memory.peak_bytes)


def _fewest_checkpointed_offloaded(evaluator: Evaluator, cand: Candidate
                                   ) -> OffloadCandidate | None:
    """The offloaded variant of ``cand`` with the fewest leading blocks checkpointed that
    still fits (binary search: the device peak falls as more are checkpointed), re-evaluated
    with the search's own models; None when ``cand`` is not a leading run of blocks."""
    index = {b: i for i, b in enumerate(evaluator.graph.blocks)}
    k = len(cand.checkpointed)
    if any(index.get(b) != i for i, b in enumerate(cand.checkpointed)):
        return None
    groups = [list(u.modules) for u in cand.units[:-1]]
    reshard = [u.reshard_after_forward for u in cand.units[:-1]]

    def at(n: int) -> OffloadCandidate:
        plain = evaluator.evaluate(
            name=cand.name.split(" ac")[0] + (f" ac{n}" if n else ""), strategy=cand.strategy,
            replicate=cand.replicate, shard=cand.shard, groups=groups, reshard=reshard,
            root_reshard=cand.units[-1].reshard_after_forward,
            checkpoint=frozenset(range(n)), forward_prefetch=cand.forward_prefetch,
            backward_prefetch=cand.backward_prefetch)
        return with_offload(evaluator, plain)

    lo, hi, best = -1, k, None  # k fits (the caller checked); find the smallest that does
    while hi - lo > 1:
        mid = (lo + hi) // 2
        trial = at(mid)
        if trial.fits:
            hi, best = mid, trial
        else:
            lo = mid
    return best
