"""The plan's ``mixed_precision`` section (SPEC 3, 7) and a unit's own, checked and typed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fsdp_plan.common.dtypes import PLAN_DTYPE_NAMES
from fsdp_plan.cost.precision import Precision
from fsdp_plan.plan.checker import Checker

AUTOCAST_DTYPE_NAMES = ("bfloat16", "bf16", "float16", "fp16")
PLAN_PRECISION_KEYS = ("param_dtype", "reduce_dtype", "autocast_dtype")
UNIT_PRECISION_KEYS = ("param_dtype", "reduce_dtype", "output_dtype")


@dataclass(frozen=True, kw_only=True)
class PlanPrecision:
    """FSDP's ``MixedPrecisionPolicy`` dtypes for every unit, and the autocast dtype.

    None is FSDP's own reading of an absent key: parameters stay in their dtype, gradients
    reduce in the parameter dtype (``precision``)."""

    param_dtype: str | None = None
    reduce_dtype: str | None = None
    autocast_dtype: str | None = None
    """``torch.autocast``'s dtype (version 2); parameters are then float32."""

    def to_dict(self) -> dict[str, str | None]:
        """As written: ``{}`` when nothing is set, the autocast dtype only when set."""
        if self == PlanPrecision():
            return {}
        out = {"param_dtype": self.param_dtype, "reduce_dtype": self.reduce_dtype}
        if self.autocast_dtype is not None:
            out["autocast_dtype"] = self.autocast_dtype
        return out

    @property
    def precision(self) -> Precision:
        """The memory model's and the clock's dtypes: absent ones are float32, an absent
        reduce dtype is the param dtype (as FSDP2's ``MixedPrecisionPolicy`` reads them)."""
        return Precision.of(self.param_dtype or "float32",
                            self.reduce_dtype or self.param_dtype or "float32")

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> PlanPrecision:
        return cls(**{k: v for k, v in (raw or {}).items() if k in PLAN_PRECISION_KEYS})


def check_precision(check: Checker, value: Any, path: str, keys: tuple[str, ...]
                    ) -> dict[str, str | None]:
    """A ``mixed_precision`` mapping: the plan's, or a unit's own (``output_dtype`` too)."""
    fix = "mixed_precision is {param_dtype: bfloat16, reduce_dtype: float32} (null keeps fp32)"
    mapping = check.mapping(value, path, fix, optional=True)
    check.keys(mapping, path, keys)
    out: dict[str, str | None] = {}
    for key, dtype in mapping.items():
        if dtype is not None:
            check.choice(dtype, f"{path}.{key}", PLAN_DTYPE_NAMES,
                         "FSDP casts to floating dtypes only: use bfloat16, float16 or float32, "
                         "or null to keep the parameters' dtype")
        out[key] = dtype
    return out


def check_plan_precision(check: Checker, value: Any, out: dict) -> PlanPrecision:
    """The plan's ``mixed_precision``; its ``autocast_dtype`` (SPEC 7, version 2) is a dtype
    autocast computes in, with float32 parameters (FSDP keeps them; autocast casts per op)."""
    if isinstance(value, PlanPrecision):
        value = value.to_dict()
    precision = check_precision(check, value, "mixed_precision", PLAN_PRECISION_KEYS)
    dtype = precision.get("autocast_dtype")
    if dtype is not None:
        check.choice(dtype, "mixed_precision.autocast_dtype", AUTOCAST_DTYPE_NAMES,
                     "torch.autocast computes in bfloat16 or float16; remove the key to compute "
                     "in float32")
        param = precision.get("param_dtype")
        if param not in (None, "float32", "fp32"):
            raise check.fail("mixed_precision.param_dtype", f"is {param!r} beside "
                             f"autocast_dtype {dtype!r}", "under autocast FSDP keeps float32 "
                             "parameters: write param_dtype: float32 (autocast casts per op)")
    return PlanPrecision.from_dict(precision)


def check_unit_precision(check: Checker, value: Any, path: str) -> dict[str, str | None] | None:
    """A unit's own ``mixed_precision`` over the plan's; None when absent."""
    return None if value is None else check_precision(check, value, path, UNIT_PRECISION_KEYS)
