"""The plan's ``offload`` and ``compile`` sections (SPEC 6, 7; version 2), checked and typed:
where a unit's state lives and how its block runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fsdp_plan.plan.checker import Checker, show


@dataclass(frozen=True)
class Offload:
    """FSDP2's ``CPUOffloadPolicy``: parameters, gradients and optimizer states on the host,
    together (a plan holds the section only when they are offloaded)."""

    params: bool = True
    optimizer: bool = True

    def to_dict(self) -> dict[str, bool]:
        return {"params": self.params, "optimizer": self.optimizer}


@dataclass(frozen=True, kw_only=True)
class CompiledBlocks:
    """The repeated blocks that run ``torch.compile(block.forward, fullgraph=True)``."""

    modules: tuple[str, ...]
    activation_memory_budget: float | None = None
    """The min-cut partitioner's ``activation_memory_budget`` (None: its default)."""

    def to_dict(self) -> dict[str, Any]:
        return {"blocks": True, "activation_memory_budget": self.activation_memory_budget,
                "modules": list(self.modules)}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> CompiledBlocks:
        return cls(modules=tuple(raw["modules"]),
                   activation_memory_budget=raw.get("activation_memory_budget"))


def check_offload(check: Checker, offload: Any, out: dict) -> Offload | None:
    """``offload: {params: bool, optimizer: bool}`` (SPEC 6); None when absent or all false.
    FSDP2's ``CPUOffloadPolicy`` moves parameters, gradients and optimizer states together.
    A version-2 field, refused in a version-1 plan even when all false (issue 21, S3-28)."""
    if offload is None:
        return None
    if isinstance(offload, Offload):
        offload = offload.to_dict()
    mapping = check.mapping(offload, "offload", "offload is {params: bool, optimizer: bool}")
    check.keys(mapping, "offload", ("params", "optimizer"))
    for key, flag in mapping.items():
        if not isinstance(flag, bool):
            raise check.fail(f"offload.{key}", f"must be true or false, got {show(flag)}",
                             "write true or false")
    params, optimizer = mapping.get("params", False), mapping.get("optimizer", False)
    if params != optimizer:
        raise check.fail("offload", f"sets params: {str(params).lower()} and optimizer: "
                         f"{str(optimizer).lower()}", "FSDP2's CPUOffloadPolicy offloads "
                         "parameters, gradients and optimizer states together; set both to "
                         "true (or both to false)")
    return Offload() if params else None


def check_compile(check: Checker, value: Any, out: dict) -> CompiledBlocks | None:
    """``compile: {blocks: true, activation_memory_budget: B | null, modules: [FQN, ...]}``
    (SPEC 7, version 2); None when absent or ``blocks: false``."""
    if value is None:
        return None
    if isinstance(value, CompiledBlocks):
        value = value.to_dict()
    fix = ("compile is {blocks: true, activation_memory_budget: null or a number in 0..1, "
           "modules: [the repeated blocks' FQNs]}")
    mapping = check.mapping(value, "compile", fix)
    check.keys(mapping, "compile", ("blocks", "activation_memory_budget", "modules"))
    blocks = mapping.get("blocks", False)
    if not isinstance(blocks, bool):
        raise check.fail("compile.blocks", f"must be true or false, got {show(blocks)}",
                         "write true or false")
    if not blocks:
        return None
    budget = mapping.get("activation_memory_budget")
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float))
                               or not 0 <= budget <= 1):
        raise check.fail("compile.activation_memory_budget", f"must be null or a number from 0 "
                         f"to 1, got {show(budget)}", "write null (the partitioner's default) or "
                         "a fraction such as 0.5")
    modules = mapping.get("modules")
    if (not isinstance(modules, list) or not modules
            or not all(isinstance(m, str) and m for m in modules) or len(set(modules)) < len(modules)):
        raise check.fail("compile.modules", f"must be a non-empty list of distinct module FQNs, "
                         f"got {show(modules)}", "list the blocks to compile, e.g. [layers.0, "
                         "layers.1]")
    return CompiledBlocks(modules=tuple(modules),
                          activation_memory_budget=None if budget is None else float(budget))
