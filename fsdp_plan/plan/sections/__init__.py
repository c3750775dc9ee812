"""The plan's sections (SPEC 3, 6-8), each a small module with its frozen type and its checker:
plan/schema.py ``FIELDS`` names the checker of every top-level field, plan/check.py holds the
checkers of the sections that stay plain lists and mappings (units, checkpointing, prefetch)."""

from fsdp_plan.plan.sections.blocks import CompiledBlocks, Offload, check_compile, check_offload
from fsdp_plan.plan.sections.cluster import (
    DEFAULT_GPUS_PER_NODE,
    check_gpus_per_node,
    check_world_size,
)
from fsdp_plan.plan.sections.ddp import DDP_FLAGS, check_ddp, check_ddp_strategy
from fsdp_plan.plan.sections.model import MODEL_KEYS, MODEL_KINDS, ModelRecipe, check_model
from fsdp_plan.plan.sections.precision import (
    AUTOCAST_DTYPE_NAMES,
    PlanPrecision,
    check_plan_precision,
    check_unit_precision,
)
from fsdp_plan.plan.sections.predicted import PREDICTED_KEYS, check_predicted

__all__ = ["AUTOCAST_DTYPE_NAMES", "DDP_FLAGS", "DEFAULT_GPUS_PER_NODE",
           "MODEL_KEYS", "MODEL_KINDS", "PREDICTED_KEYS", "CompiledBlocks", "ModelRecipe",
           "Offload", "PlanPrecision", "check_compile", "check_ddp", "check_ddp_strategy",
           "check_gpus_per_node", "check_model", "check_offload", "check_plan_precision",
           "check_predicted", "check_unit_precision", "check_world_size"]
