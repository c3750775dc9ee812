"""Compute time of compiled blocks: fused kernels and matmul/attention rooflines.

[Note: compiled block time]
With ``--compile`` a repeated block runs as two compiled graphs, the AOTAutograd partition's
forward and backward (facts/compiled.py [Note: compiled blocks]). Their op-class counters
are counted per fused kernel (facts/fused.py [Note: fused regions]): matmul FLOPs by shape
class, attention FLOPs, the bytes crossing each fused region's boundary and one launch per
kernel. They are timed with the same rates as eager ops (cost/step_time.py
``compute_time``), so what compile buys is exactly what fusion removes: the intermediate
reads and writes of memory-bound chains and most of their launches. The FLOP-bound part
(matmuls, attention) is unchanged.

In a unit's time the compiled block replaces the eager ops of every module inside it
(``inside``): its forward graph in forward, its backward graph in backward. A checkpointed
compiled block recomputes in its backward graph what its partition recomputes, so its
recompute time is its mode's backward graph over the plain one's (never negative: the
partitioner may save more under a checkpoint policy than it recomputes). Parameters,
gradients, collectives and the optimizer are timed as in eager.

Pure over the facts: no torch.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from fsdp_plan.cost.step_time import Rates, compute_time
from fsdp_plan.facts.types import CompiledBlocks

MODES = ("full", "selective")


@dataclass(kw_only=True, frozen=True)
class CompiledTimes:
    """Seconds of each compiled block, by its FQN ([Note: compiled block time])."""

    inside: frozenset[str]
    """Module FQNs inside compiled blocks (the blocks too): their eager ops are replaced."""
    fw_s: dict[str, float] = field(default_factory=dict)
    bw_s: dict[str, float] = field(default_factory=dict)
    recompute_s: dict[str, dict[str, float]] = field(default_factory=dict)
    """Block -> checkpointing mode -> seconds its backward graph adds in that mode."""

    def forward_s(self, owned: frozenset[str]) -> float:
        """Forward seconds of the compiled blocks among the modules ``owned``."""
        return sum(s for b, s in self.fw_s.items() if b in owned)

    def backward_s(self, owned: frozenset[str]) -> float:
        return sum(s for b, s in self.bw_s.items() if b in owned)


def compiled_times(rates: Rates, compiled: CompiledBlocks, module_names: set[str]
                   ) -> CompiledTimes:
    """The times of every traced compiled block at ``rates``; ``module_names``: the model's
    modules (those inside a traced block are marked ``inside``)."""
    fw_s: dict[str, float] = {}
    bw_s: dict[str, float] = {}
    recompute: dict[str, dict[str, float]] = {}
    for block in compiled.block_class:
        plain = compiled.of(block)
        if plain is None or not plain.fw_ops:  # facts from before the fused counters
            continue
        fw_s[block] = compute_time(rates, plain.fw_ops, 0.0)
        bw_s[block] = compute_time(rates, plain.bw_ops, 0.0)
        recompute[block] = {}
        for mode in MODES:
            other = compiled.of(block, mode)
            if other is not None and other.bw_ops:
                recompute[block][mode] = max(0.0, compute_time(rates, other.bw_ops, 0.0)
                                             - bw_s[block])
    inside = frozenset(m for m in module_names
                       if any(m == b or m.startswith(b + ".") for b in fw_s))
    return CompiledTimes(inside=inside, fw_s=fw_s, bw_s=bw_s, recompute_s=recompute)


def without_inside(per_module: Mapping[str, object], times: CompiledTimes | None) -> dict:
    """``per_module`` (FLOPs or op counters by module) with the modules inside compiled blocks
    emptied: the compiled graphs' times stand for them."""
    if times is None:
        return dict(per_module)
    return {m: (type(v)() if m in times.inside else v) for m, v in per_module.items()}
