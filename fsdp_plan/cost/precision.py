"""Element sizes and optimizer bytes: the rules every memory and time model shares.

[Note: optimizer bytes]
An optimizer keeps ``OPTIMIZER_STATES[optimizer]`` float32 states per parameter (AdamW:
``exp_avg`` and ``exp_avg_sq``) and, for Adam and AdamW, a float32 ``step`` per parameter
tensor. Its step reads the parameter, the gradient and every state and writes the parameter
and every state: ``(3 + 2 * states) * element_bytes`` per parameter (``step_bytes``), which
the device clock (``cost/step_time.py``), DDP's clock (``cost/ddp_buckets.py``) and CPU
offload (``search/offload.py``) all time from this one rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from fsdp_plan.common.dtypes import DTYPE_BYTES, canonical_dtype
from fsdp_plan.cost.units import UnitSpec

Optimizer = Literal["adamw", "adam", "sgd", "none"]
OPTIMIZERS: tuple[str, ...] = get_args(Optimizer)
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0, "none": 0}
"""Optimizer states per parameter, each the size of the fp32 shard (AdamW: exp_avg, exp_avg_sq)."""


def optimizer_state_bytes(optimizer: str, numel: int, num_tensors: int,
                          element_bytes: int = 4) -> int:
    """Bytes of optimizer state for ``numel`` parameters in ``num_tensors`` tensors
    ([Note: optimizer bytes]): the per-parameter states and Adam's per-tensor ``step``."""
    per_tensor = 4 * num_tensors if optimizer in ("adamw", "adam") else 0
    return OPTIMIZER_STATES.get(optimizer, 0) * numel * element_bytes + per_tensor


def step_bytes(optimizer: str, numel: int, element_bytes: int = 4) -> int:
    """Bytes one optimizer step moves over ``numel`` parameters ([Note: optimizer bytes])."""
    return numel * element_bytes * (3 + 2 * OPTIMIZER_STATES.get(optimizer, 0))


@dataclass(kw_only=True, frozen=True)
class Precision:
    """Element sizes: the stored (sharded) parameters, the compute copy, the gradient reduction."""

    orig_bytes: int = 4
    param_bytes: int = 2
    reduce_bytes: int = 4
    reduce_dtype: str = "float32"
    """The reduction's dtype by name (float16 and bfloat16 have one size, not one hook)."""

    @classmethod
    def of(cls, param_dtype: str, reduce_dtype: str) -> Precision:
        """Element sizes for a plan's mixed precision (parameters are stored in fp32)."""
        return cls(orig_bytes=4, param_bytes=DTYPE_BYTES[canonical_dtype(param_dtype)],
                   reduce_bytes=DTYPE_BYTES[canonical_dtype(reduce_dtype)],
                   reduce_dtype=canonical_dtype(reduce_dtype))

    @property
    def lowers_precision(self) -> bool:
        """Whether the plan computes in a dtype smaller than the stored parameters."""
        return self.param_bytes < self.orig_bytes

    def unit_param_bytes(self, unit: UnitSpec) -> int:
        """The unit's gathered parameters and unsharded gradients: ``param_bytes``, or the
        stored ``orig_bytes`` for batch norm kept in full precision (see units.py)."""
        if unit.full_precision and self.param_bytes < self.orig_bytes:
            return self.orig_bytes
        return self.param_bytes
