"""Unit construction: which module FQNs each ``fully_shard`` call gets, and what each unit holds.

[Note: units]
Written once and shared by the search, the report, the emitted policy and the verifier.
Units are applied children first and the root ``""`` last; each parameter belongs to the
innermost unit whose modules contain it (FSDP2 skips parameters a nested ``fully_shard``
already manages). Parameters shared between modules (tied embeddings) must sit in one unit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from fsdp_plan.facts.types import ModuleGraph


@dataclass(kw_only=True)
class UnitSpec:
    """One unit with the per-rank sizes FSDP2 will allocate for it."""

    modules: list[str]
    reshard_after_forward: bool = True
    numel: int = 0
    """Parameters the unit manages (unpadded)."""
    shard_numel: int = 0
    """Per-rank shard of those parameters, padded as FSDP2 pads dim 0 to the shard size."""
    num_params: int = 0
    owned_modules: list[str] = field(default_factory=list)
    param_modules: list[tuple[str, int]] = field(default_factory=list)
    """(module FQN, parameters registered directly on it) for owned modules with parameters."""
    full_precision: bool = False
    """Batch norm kept in float32 (see [Note: batch norm in full precision]): gathered, computed
    and given gradients in float32 whatever the plan's ``param_dtype``."""
    largest_shard_numel: int = 0
    """The per-rank shard of the unit's largest parameter (padded): what one parameter's
    optimizer step in backward allocates beside it (cost/optimizer_overlap.py)."""

    @property
    def key(self) -> str:
        return self.modules[0]

    def with_reshard(self, reshard_after_forward: bool) -> UnitSpec:
        """A copy sharing this unit's lists (nothing changes them) with its own reshard choice;
        the search makes one per unit per candidate, so it avoids ``copy.copy`` (3x slower)."""
        return UnitSpec(modules=self.modules, reshard_after_forward=reshard_after_forward,
                        numel=self.numel, shard_numel=self.shard_numel,
                        num_params=self.num_params, owned_modules=self.owned_modules,
                        param_modules=self.param_modules, full_precision=self.full_precision,
                        largest_shard_numel=self.largest_shard_numel)

    def unsharded_numel(self, shard_size: int) -> int:
        """Elements of the all-gathered (padded) parameters."""
        return self.shard_numel * shard_size


def owner_unit(fqn: str, unit_of_module: dict[str, int]) -> int:
    """Index of the innermost unit that contains module ``fqn``."""
    probe = fqn
    while True:
        if probe in unit_of_module:
            return unit_of_module[probe]
        if probe == "":
            raise KeyError("the root must be a unit")
        probe = probe.rpartition(".")[0]


_UNIT_CACHE: dict[tuple | int, object] = {}
"""Layouts of the last graph asked about and its modules' sizes by shard size
(``_UNIT_CACHE[0]`` is that graph)."""


def build_units(graph: ModuleGraph, groups: list[list[str]], reshard: list[bool],
                shard_size: int) -> list[UnitSpec]:
    """Units for ``groups`` (children first; the root ``[""]`` is appended when missing).

    What a layout holds does not depend on ``reshard``: it is built once per graph, layout
    and shard size (the search asks for the same layout under many choices) and each call
    gets its own ``UnitSpec`` objects with the ``reshard_after_forward`` asked for."""
    groups = [list(g) for g in groups]
    reshard = list(reshard)
    if not groups or groups[-1] != [""]:
        groups.append([""])
        reshard.append(False)
    if _UNIT_CACHE.get(0) is not graph:
        _UNIT_CACHE.clear()
        _UNIT_CACHE[0] = graph
    key = (tuple(tuple(g) for g in groups), (shard_size,))
    if key not in _UNIT_CACHE:
        _UNIT_CACHE[key] = _build_units(graph, groups, shard_size)
    built: list[UnitSpec] = _UNIT_CACHE[key]  # type: ignore[assignment]
    return [template.with_reshard(r) for template, r in zip(built, reshard)]


def _build_units(graph: ModuleGraph, groups: list[list[str]], shard_size: int
                 ) -> list[UnitSpec]:
    reshard = [True] * len(groups)
    units = [UnitSpec(modules=g, reshard_after_forward=r,
                      full_precision=all(graph.modules[m].keeps_full_precision for m in g))
             for g, r in zip(groups, reshard)]
    unit_of_module = {m: i for i, g in enumerate(groups) for m in g}
    owner_of: dict[str, int] = {}
    for row in _module_sizes(graph, shard_size):
        # ``owner_unit``: the module's own unit, else its parent's (parents come first)
        at = unit_of_module.get(row.fqn)
        if at is None:
            at = owner_of.get(row.parent)
            if at is None:
                at = owner_unit(row.fqn, unit_of_module)
        owner_of[row.fqn] = at
        unit = units[at]
        unit.owned_modules.append(row.fqn)
        if row.direct_numel:
            unit.param_modules.append((row.fqn, row.direct_numel))
        if row.num_params:
            unit.numel += row.numel
            unit.shard_numel += row.shard_numel
            unit.largest_shard_numel = max(unit.largest_shard_numel, row.largest_shard_numel)
            unit.num_params += row.num_params
    return units


class _ModuleSizes(NamedTuple):  # a tuple: made for every module, some 1,000 per shard size
    """What one module's own parameters add to the unit that owns it, at one shard size."""

    fqn: str
    parent: str | None
    """The FQN its owner is looked up by when it is in no group (None for the root)."""
    direct_numel: int
    numel: int
    shard_numel: int
    """Its parameters' per-rank shards, each padded as FSDP2 pads dim 0 to the shard size."""
    largest_shard_numel: int
    num_params: int


def _module_sizes(graph: ModuleGraph, shard_size: int) -> list[_ModuleSizes]:
    """``_ModuleSizes`` of every module in ``named_modules()`` order, worked out once per graph
    and shard size (in ``_UNIT_CACHE``): the search builds some 40 layouts per plan, and each
    walked every parameter's shape again (a tenth of the 70B's search)."""
    key = ("module sizes", shard_size)
    found = _UNIT_CACHE.get(key)
    if found is not None:
        return found  # type: ignore[return-value]
    rows = []
    for fqn, info in graph.modules.items():
        numel_sum = shard_sum = largest = 0
        for shape in info.param_shapes:
            numel = math.prod(shape) if shape else 1
            dim0 = shape[0] if shape else 1
            shard = math.ceil(dim0 / shard_size) * (numel // max(dim0, 1))
            numel_sum += numel
            shard_sum += shard
            largest = max(largest, shard)
        rows.append(_ModuleSizes(fqn, fqn.rpartition(".")[0] if fqn else None,
                                 info.direct_numel, numel_sum, shard_sum, largest,
                                 len(info.param_shapes)))
    _UNIT_CACHE[key] = rows
    return rows


def check_tied(graph: ModuleGraph, groups: list[list[str]]) -> bool:
    """True when every tied-parameter group lands in a single unit."""
    unit_of_module = {m: i for i, g in enumerate(groups) for m in g}
    unit_of_module.setdefault("", len(groups))
    return all(len({owner_unit(m, unit_of_module) for m in tied}) == 1
               for tied in graph.tied_groups)


def with_full_precision_units(graph: ModuleGraph, groups: list[list[str]]) -> list[list[str]]:
    """``groups`` with every batch norm that has parameters as a unit of its own.

    [Note: batch norm in full precision]
    Batch norm's weights meet float32 running statistics, so a step with them gathered in
    bf16 fails (``expected scalar type BFloat16 but found Float``). FSDP1's ``MixedPrecision``
    wraps every ``_BatchNorm`` separately without mixed precision by default; FSDP2 has no
    such default, so the plan lists each one as a unit whose ``mixed_precision`` is
    ``param_dtype: float32`` with ``output_dtype`` the plan's dtype: inputs are cast up, the
    output back down, and the convolution after it sees the dtype it expects (checked with
    gloo on torch 2.13: casting up without casting back fails in that convolution). Each such
    unit goes just before the first unit that contains it (children first), else in module
    order, so the list stays in execution order. A batch norm already grouped with other
    modules (tied parameters) is left where it is.
    """
    listed = {m for g in groups for m in g}
    order = {fqn: i for i, fqn in enumerate(graph.modules)}
    out = [list(g) for g in groups]
    for fqn, info in graph.modules.items():
        if not info.keeps_full_precision or fqn in listed:
            continue
        at = next((i for i, g in enumerate(out)
                   if any(m and fqn.startswith(m + ".") for m in g)), None)
        if at is None:
            at = next((i for i, g in enumerate(out) if order[g[0]] > order[fqn]), len(out))
        out.insert(at, [fqn])
    return out


def unit_mixed_precision(unit: UnitSpec, param_dtype: str | None) -> dict[str, str] | None:
    """The plan's per-unit ``mixed_precision`` override: float32 for a full-precision unit when
    the plan computes in a lower dtype (output cast back to it), else None (the plan's own)."""
    if not unit.full_precision or param_dtype in (None, "float32", "float64"):
        return None
    return {"param_dtype": "float32", "output_dtype": param_dtype}
