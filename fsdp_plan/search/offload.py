"""CPU offload as the search's fallback: when nothing fits on the device, the fastest
candidate that fits with FSDP2 ``CPUOffloadPolicy`` (cost/offload.py [Note: offload as the last
resort] for what it costs). Chosen only with ``--allow-offload``; without it the no-fit message
still says what offload would reach.
"""

from __future__ import annotations

import dataclasses

from fsdp_plan.common.sizes import format_bytes
from fsdp_plan.cost.offload import offload_priced
from fsdp_plan.search.candidate import Candidate
from fsdp_plan.search.evaluator import Evaluator
from fsdp_plan.search.framework import FrameworkLimits
from fsdp_plan.search.fsdp import fewest_checkpointed

POOL = 12
"""How many of the smallest-peak candidates are tried offloaded."""


class OffloadFallback:
    """The fastest fitting offloaded variant of the candidates the search tried."""

    def __init__(self, *, allowed: bool, limits: FrameworkLimits | None = None) -> None:
        self.allowed = allowed
        """``--allow-offload``: a fallback not allowed still answers for the no-fit message."""
        self.limits = limits
        """A framework's limits (search/framework.py): its checkpointing is all or none, so
        no offloaded variant checkpoints fewer blocks."""

    def rescue(self, evaluator: Evaluator, tried: list[Candidate]) -> Candidate | None:
        """The fastest fitting offloaded variant among the ``POOL`` smallest-peak candidates of
        a strategy the user allowed (and, for each, fewer checkpointed blocks: offload frees
        room that checkpointing bought), else the one with the smallest device peak; None
        without such candidates. DDP keeps whole replicas: it has no ``CPUOffloadPolicy``."""
        settings = evaluator.settings
        if not offload_priced(settings.hardware):
            return None  # nothing to offer; --allow-offload itself is refused (PlanRequest)
        pool = sorted((c for c in tried if c.strategy != "ddp" and settings.allows(c.strategy)),
                      key=lambda c: c.memory.peak_bytes)[:POOL]
        offloaded: list[Candidate] = []
        for cand in pool:
            offloaded.append(_offloaded(evaluator, cand.layout, cand.name))
            if (offloaded[-1].fits and cand.checkpointed and not cand.selective
                    and self.limits is None):
                fewer = _fewest_checkpointed_offloaded(evaluator, cand)
                if fewer is not None:
                    offloaded.append(fewer)
        if not offloaded:
            return None
        fitting = [c for c in offloaded if c.fits]
        if fitting:
            return min(fitting, key=lambda c: (round(c.time.step_s, 9), c.memory.peak_bytes))
        return min(offloaded, key=lambda c: c.memory.peak_bytes)

    def advice(self, rescued: Candidate | None) -> str:
        """What the no-fit message says of offload."""
        if rescued is None:
            return ""
        if rescued.fits:
            return (f" With --allow-offload it would fit: FSDP2 CPUOffloadPolicy keeps "
                    f"parameters, gradients and optimizer states on the host (device peak "
                    f"{format_bytes(rescued.memory.peak_bytes)}, predicted step "
                    f"{rescued.time.step_s:.3g} s, {rescued.name}).")
        return (" Even CPU offload (--allow-offload) does not fit: its smallest device "
                f"peak is {format_bytes(rescued.memory.peak_bytes)}.")


def _offloaded(evaluator: Evaluator, layout, name: str) -> Candidate:
    return evaluator.evaluate(dataclasses.replace(layout, offload=True), name + " offload")


def _fewest_checkpointed_offloaded(evaluator: Evaluator, cand: Candidate) -> Candidate | None:
    """The offloaded variant of ``cand`` with the fewest leading blocks fully checkpointed that
    still fits (the device peak falls as more are checkpointed), with the search's own
    ``fewest_checkpointed``; None when ``cand`` does not checkpoint a leading run of blocks."""
    index = {b: i for i, b in enumerate(evaluator.graph.blocks)}
    k = len(cand.checkpointed)
    if any(index.get(b) != i for i, b in enumerate(cand.checkpointed)):
        return None
    base = cand.name.split(" ac")[0]

    def at(counts: tuple[int, int]) -> Candidate:
        n = counts[0]
        layout = dataclasses.replace(cand.layout, full=frozenset(range(n)),
                                     selective=frozenset())
        return _offloaded(evaluator, layout, base + (f" ac{n}" if n else ""))
    best, fits_at = fewest_checkpointed(at, [(n, 0) for n in range(k + 1)], None)
    return best if fits_at is not None and fits_at < k else None
