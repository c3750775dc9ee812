"""The one table of floating dtype names a plan, a request or a hardware file may use.

``plan/check.py`` validates against it and ``cost/precision.py`` sizes elements from it; only
``policy_runtime.py`` keeps its own mapping, because a generated policy must stand alone."""

from __future__ import annotations

from fsdp_plan.common.errors import BadInput

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
"""Bytes per element of the floating dtypes a plan may name (canonical torch names)."""
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                 "float": "float32", "fp64": "float64", "double": "float64"}
PLAN_DTYPE_NAMES = ("bfloat16", "bf16", "float16", "fp16", "float32", "fp32", "float64", "fp64")
"""The dtype names a plan file may write: the ones the generated policy module maps to torch
dtypes (``policy_runtime``'s own table, which must stand alone)."""


def canonical_dtype(name: str, what: str = "dtype") -> str:
    """``bf16`` -> ``bfloat16``; ``BadInput`` naming ``what`` for anything not a float dtype."""
    key = str(name).lower().removeprefix("torch.")
    key = DTYPE_ALIASES.get(key, key)
    if key not in DTYPE_BYTES:
        raise BadInput(f"{what} {name!r} is not a floating dtype fsdp-plan knows; use one of "
                       "bf16, fp16, fp32 (or bfloat16, float16, float32, float64).")
    return key
