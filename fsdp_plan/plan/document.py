"""The plan: SPEC section 3 as dataclasses, written to YAML atomically and read back as data.

``Plan.to_dict()`` is exactly the YAML document (and the emitted module's ``PLAN``);
``read_plan`` reads a plan file as untrusted data (``fsdp_plan.plan.read``) and
``Plan.from_dict()`` validates it (``fsdp_plan.plan.check``) before anything uses it.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Any

import yaml

from fsdp_plan.common.files import atomic_write_all, atomic_write_text, check_writable  # noqa: F401
from fsdp_plan.common.limits import budget_limit
from fsdp_plan.cost.ddp_buckets import DDPConfig
from fsdp_plan.plan.read import read_plan_document
from fsdp_plan.plan.schema import FIELDS, check_plan_document, needed_version
from fsdp_plan.plan.sections import (
    DEFAULT_GPUS_PER_NODE,
    CompiledBlocks,
    ModelRecipe,
    Offload,
    PlanPrecision,
)

PLAN_VERSION = 1


@dataclass(kw_only=True)
class Unit:
    """One ``fully_shard`` call: the modules it groups and whether it reshards after forward."""

    modules: list[str]
    """Module FQNs given to one ``fully_shard`` call (``""`` is the root)."""
    reshard_after_forward: bool = True
    mixed_precision: dict[str, str | None] | None = None
    """This unit's own ``MixedPrecisionPolicy`` dtypes (``param_dtype``, ``reduce_dtype``,
    ``output_dtype``) over the plan's; None (not written) uses the plan's."""

    @property
    def key(self) -> str:
        """The unit's first module FQN: how prefetch maps name units."""
        return self.modules[0]


@dataclass(kw_only=True)
class Mesh:
    """The device mesh: ``replicate`` groups of ``shard`` ranks (``replicate == 1`` is plain FSDP)."""

    replicate: int = 1
    shard: int = 1

    @property
    def world_size(self) -> int:
        return self.replicate * self.shard


_SECTION_TYPES: dict[str, Any] = {
    "model": ModelRecipe.from_dict,
    "mixed_precision": PlanPrecision.from_dict,
    "ddp": DDPConfig.from_dict,
    "offload": lambda raw: Offload(**raw) if any(raw.values()) else None,
    "compile": lambda raw: CompiledBlocks.from_dict(raw) if raw.get("blocks") else None,
}
"""The typed sections of a plan (plan/sections/), by field, from their plain mappings."""


@dataclass(kw_only=True)
class Plan:
    """Everything a training script needs to apply a plan, plus what the planner predicted."""

    fsdp_plan_version: int = PLAN_VERSION
    model: ModelRecipe
    budget_bytes: int
    headroom_bytes: int = 0
    world_size: int
    gpus_per_node: int | None = None
    """GPUs per node the plan was made for (``--gpus-per-node``, SPEC 8): which collectives
    cross nodes, and how ``export`` lays out machines; None (a plan written before it was
    recorded) reads as ``predicted.gpus_per_node``, else 8 (``node_gpus``)."""
    mesh: Mesh
    strategy: str = "full"
    framework: str | None = None
    """The framework the plan was made for (``--framework``, version 2): ``export`` writes its
    files by default; None: none named."""
    units: list[Unit]
    ddp: DDPConfig | None = None
    """``DistributedDataParallel`` arguments (SPEC 6) when ``strategy`` is ``ddp``: bucket_cap_mb,
    first_bucket_mb, gradient_as_bucket_view, static_graph, find_unused_parameters, comm_hook."""
    activation_checkpointing: list[str] | dict[str, str] = field(default_factory=list)
    """FQNs fully checkpointed (a list, version 1), or ``{FQN: full | selective}`` (version 2)."""
    selective_ops: list[str] = field(default_factory=list)
    """Ops whose outputs selective checkpointing saves (``aten.mm.default``); written only
    when some module is selective."""
    selective_mm_stride: int = 1
    """Of a selective block's ``aten.mm`` calls, the 1st, (k+1)th, ... are saved (version 2,
    SPEC 7; torchtitan's op policy is 2); written only when not 1."""
    forward_prefetch: dict[str, list[str]] = field(default_factory=dict)
    backward_prefetch: dict[str, list[str]] = field(default_factory=dict)
    mixed_precision: PlanPrecision = field(default_factory=PlanPrecision)
    optimizer: str = "adamw"
    optimizer_overlap: bool = False
    """Each parameter stepped by its own optimizer as soon as its gradient is reduced (SPEC 8,
    version 2; the policy's ``apply`` installs it); written only when true."""
    gpu: str = "h100"
    hardware: dict[str, Any] | None = None
    """The figures the plan was predicted with and where they came from, when they are not a
    bundled preset's (hardware/stored.py [Note: plans keep their hardware])."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step (``model.batch_size`` samples each, per rank)."""
    gradient_sync: str = "every"
    """``every``: reduce-scatter after each micro-batch; ``last``: only after the last, with
    gradients accumulated unsharded in between (``prepare_microbatch`` in the policy)."""
    offload: Offload | None = None
    """``{params: true, optimizer: true}``: FSDP2 ``CPUOffloadPolicy`` (version 2); None: none."""
    compile: CompiledBlocks | None = None
    """``{blocks: true, activation_memory_budget: B | null, modules: [FQN, ...]}``: the listed
    repeated blocks run ``torch.compile(block.forward, fullgraph=True)`` (SPEC 7, version 2);
    None: eager."""
    predicted: dict[str, Any] = field(default_factory=dict)

    def __setattr__(self, name: str, value: Any) -> None:
        """A section given as the plain mapping of a plan document (built by hand, or set on a
        plan) becomes its type; ``from_dict`` hands them over already checked."""
        if isinstance(value, dict) and name in _SECTION_TYPES:
            value = _SECTION_TYPES[name](value)
        super().__setattr__(name, value)

    @property
    def node_gpus(self) -> int:
        """GPUs per node as the plan says: its ``gpus_per_node``, else (plans written before it
        was recorded) ``predicted.gpus_per_node``, else 8."""
        if self.gpus_per_node is not None:
            return self.gpus_per_node
        return int(self.predicted.get("gpus_per_node") or DEFAULT_GPUS_PER_NODE)

    @property
    def limit_bytes(self) -> int:
        """The peak the plan may reach: budget minus headroom."""
        return budget_limit(self.budget_bytes, self.headroom_bytes)

    def to_dict(self) -> dict[str, Any]:
        """The YAML document: the fields of plan/schema.py ``FIELDS`` in their order, those
        left at their default omitted where the schema says, at the lowest plan version that
        holds them (or the plan's own, if higher)."""
        raw = {name: getattr(self, name) for name in self.__dataclass_fields__}
        for name, section in raw.items():
            if hasattr(section, "to_dict"):
                raw[name] = section.to_dict()
        raw["mesh"] = asdict(self.mesh)
        raw["units"] = [{k: v for k, v in asdict(unit).items()
                         if k != "mixed_precision" or v is not None} for unit in self.units]
        doc = copy.deepcopy({f.name: raw[f.name] for f in FIELDS if f.written(raw)})
        doc["fsdp_plan_version"] = max(self.fsdp_plan_version, needed_version(doc))
        return doc

    @classmethod
    def from_dict(cls, raw: Any, where: str = "plan") -> Plan:
        """Validate a plan document (``fsdp_plan.plan.schema``) and build the dataclasses."""
        checked = check_plan_document(raw, where)
        checked["mesh"] = Mesh(**checked["mesh"])
        checked["units"] = [Unit(modules=modules, reshard_after_forward=reshard,
                                 mixed_precision=precision)
                            for modules, reshard, precision in checked["units"]]
        return cls(**checked)


def plan_to_yaml(plan: Plan) -> str:
    return yaml.safe_dump(plan.to_dict(), sort_keys=False, default_flow_style=None, width=100)


def write_plan(plan: Plan, path: str) -> None:
    atomic_write_text(path, plan_to_yaml(plan))


def read_plan(path: str) -> Plan:
    """Read a plan file as untrusted data (size, encoding, tags and aliases are checked before
    anything is built; ``yaml.CSafeLoader`` only), then validate every field."""
    return Plan.from_dict(read_plan_document(path), where=f"plan file {path!r}")
