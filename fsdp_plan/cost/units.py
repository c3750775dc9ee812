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
from typing import TYPE_CHECKING, NamedTuple

from fsdp_plan.facts.types import ModuleGraph

if TYPE_CHECKING:
    import numpy as np


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
"""Layouts of the last graph asked about, what their units own and the modules' sizes by
shard size (``_UNIT_CACHE[0]`` is that graph)."""


def build_units(graph: ModuleGraph, groups: list[list[str]], reshard: list[bool],
                shard_size: int) -> list[UnitSpec]:
    """Units for ``groups`` (children first; the root ``[""]`` is appended when missing).

    What a layout holds does not depend on ``reshard``: it is built once per graph, layout
    and shard size (the search asks for the same layout under many choices) and each call
    gets its own list of ``UnitSpec`` objects with the ``reshard_after_forward`` asked for:
    the built ones where they have it already (units are never changed once built, so lists
    may share them), copies where not."""
    groups = [list(g) for g in groups]
    reshard = list(reshard)
    if not groups or groups[-1] != [""]:
        groups.append([""])
        reshard.append(False)
    if _UNIT_CACHE.get(0) is not graph:
        _UNIT_CACHE.clear()
        _UNIT_CACHE[0] = graph
    layout = tuple(tuple(g) for g in groups)
    key = (layout, (shard_size,))
    built: list[UnitSpec] | None = _UNIT_CACHE.get(key)  # type: ignore[assignment]
    if built is None:
        built = _UNIT_CACHE[key] = _sized_units(graph, layout, shard_size)
    return [template if template.reshard_after_forward == r else template.with_reshard(r)
            for template, r in zip(built, reshard)]


class _Owned(NamedTuple):
    """What a layout's units hold whatever the shard size (``_owned``)."""

    units: list[UnitSpec]
    """Their modules, owned modules, parameter modules, counts; no shard sizes."""
    order: np.ndarray
    """The modules with parameters (as ``_shard_sizes`` lists them) grouped by the unit that
    owns them, in module order within each unit..."""
    starts: np.ndarray
    """...where each unit's group starts in ``order``..."""
    owners: np.ndarray
    """...and that unit (units without parameters have no group)."""


def _owned(graph: ModuleGraph, layout: tuple[tuple[str, ...], ...]) -> _Owned:
    """Which unit owns each module of ``graph`` under ``layout`` (``owner_unit``: its own
    unit, else its parent's, as parents come first) and what that adds to the unit, worked
    out once per layout (in ``_UNIT_CACHE``): only the shards depend on the shard size, and
    the search asks for each layout at some six of them."""
    key = ("owned", layout)
    found = _UNIT_CACHE.get(key)
    if found is not None:
        return found  # type: ignore[return-value]
    import numpy as np  # numpy on first use (cost/memory.py [Note: numpy on first use])

    groups = [list(g) for g in layout]
    full_precision = _full_precision_modules(graph)
    units = [UnitSpec(modules=g, full_precision=full_precision.issuperset(g)) for g in groups]
    unit_of_module = {m: i for i, g in enumerate(groups) for m in g}
    owner_of: dict[str, int] = {}
    owners: list[int] = []
    for fqn, parent, direct, numel, params in _module_sizes(graph):
        at = unit_of_module.get(fqn)
        if at is None:
            at = owner_of.get(parent) if fqn else None
            if at is None:
                at = owner_unit(fqn, unit_of_module)
        owner_of[fqn] = at
        unit = units[at]
        unit.owned_modules.append(fqn)
        if direct:
            unit.param_modules.append((fqn, direct))
        if params:
            unit.numel += numel
            unit.num_params += params
            owners.append(at)
    unit_of = np.array(owners, dtype=np.int64)
    order = np.argsort(unit_of, kind="stable")
    grouped = unit_of[order]
    starts = np.flatnonzero(np.concatenate(([True], grouped[1:] != grouped[:-1]))
                            if len(grouped) else np.zeros(0, dtype=bool))
    found = _UNIT_CACHE[key] = _Owned(units, order, starts, grouped[starts])
    return found


def _full_precision_modules(graph: ModuleGraph) -> frozenset[str]:
    """The modules that keep full precision (``ModuleInfo.keeps_full_precision``): a unit of
    those alone does. Once per graph (in ``_UNIT_CACHE``)."""
    found = _UNIT_CACHE.get(("full precision",))
    if found is None:
        found = _UNIT_CACHE[("full precision",)] = frozenset(
            fqn for fqn, info in graph.modules.items() if info.keeps_full_precision)
    return found  # type: ignore[return-value]


def _module_sizes(graph: ModuleGraph) -> list[tuple[str, str, int, int, int]]:
    """Per module (in ``named_modules()`` order): its FQN, its parent's, the parameters
    registered directly on it, and the elements and count of the parameters ``_owned`` adds
    to its owner; once per graph (in ``_UNIT_CACHE``), for every layout's ``_owned``."""
    found = _UNIT_CACHE.get(("sizes",))
    if found is None:
        found = _UNIT_CACHE[("sizes",)] = [
            (fqn, fqn.rpartition(".")[0], info.direct_numel,
             sum(math.prod(shape) for shape in info.param_shapes), len(info.param_shapes))
            for fqn, info in graph.modules.items()]
    return found  # type: ignore[return-value]


def _sized_units(graph: ModuleGraph, layout: tuple[tuple[str, ...], ...], shard_size: int
                 ) -> list[UnitSpec]:
    """The units of ``layout`` (``_owned``) with their shards at ``shard_size``."""
    import numpy as np  # numpy on first use (cost/memory.py [Note: numpy on first use])

    owned = _owned(graph, layout)
    shards, largest = _shard_sizes(graph, shard_size)
    sums = np.zeros(len(owned.units), dtype=np.int64)
    tops = np.zeros(len(owned.units), dtype=np.int64)
    if len(owned.starts):
        sums[owned.owners] = np.add.reduceat(shards[owned.order], owned.starts)
        tops[owned.owners] = np.maximum.reduceat(largest[owned.order], owned.starts)
    return [UnitSpec(modules=u.modules, numel=u.numel, shard_numel=shard, num_params=u.num_params,
                     owned_modules=u.owned_modules, param_modules=u.param_modules,
                     full_precision=u.full_precision, largest_shard_numel=top)
            for u, shard, top in zip(owned.units, sums.tolist(), tops.tolist())]


def _shard_sizes(graph: ModuleGraph, shard_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Per module with parameters (in ``named_modules()`` order): its parameters' per-rank
    shards, each padded as FSDP2 pads dim 0 to the shard size, summed, and the largest one;
    from the graph's parameter shapes (``_parameter_dims``), once per shard size."""
    import numpy as np  # numpy on first use (cost/memory.py [Note: numpy on first use])

    key = ("shards", shard_size)
    found = _UNIT_CACHE.get(key)
    if found is None:
        dim0, rest, firsts = _parameter_dims(graph)
        shards = -(-dim0 // shard_size) * rest
        found = _UNIT_CACHE[key] = (
            (np.add.reduceat(shards, firsts), np.maximum.reduceat(shards, firsts))
            if len(firsts) else (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)))
    return found  # type: ignore[return-value]


def _parameter_dims(graph: ModuleGraph) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every parameter's dim 0 and its elements per dim-0 row (1 and 1 for a scalar), module
    after module, and where each module with parameters starts among them."""
    import numpy as np  # numpy on first use (cost/memory.py [Note: numpy on first use])

    found = _UNIT_CACHE.get(("dims",))
    if found is None:
        dims, rests, firsts = [], [], []
        for info in graph.modules.values():
            if info.param_shapes:
                firsts.append(len(dims))
            for shape in info.param_shapes:
                dim0 = shape[0] if shape else 1
                dims.append(dim0)
                rests.append(math.prod(shape) // max(dim0, 1))
        found = _UNIT_CACHE[("dims",)] = (np.array(dims, dtype=np.int64),
                                          np.array(rests, dtype=np.int64),
                                          np.array(firsts, dtype=np.int64))
    return found  # type: ignore[return-value]


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
