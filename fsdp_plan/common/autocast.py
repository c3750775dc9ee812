"""Compute under ``torch.autocast``: which plans do, and the one context every step runs in.

[Note: autocast precision]
A plan computes below float32 in one of two ways (SPEC 7):
- FSDP mixed precision (``param_dtype: bfloat16``): FSDP2 all-gathers the parameters in
  bfloat16 and every op of the model runs in bfloat16;
- ``torch.autocast`` (``--autocast bf16``, recorded as ``mixed_precision.autocast_dtype``; and
  every DDP plan whose ``param_dtype`` is below float32, since DDP keeps float32 parameters):
  parameters, their all-gathers and gradients stay float32, and autocast decides each op's
  output dtype from its op lists. Matmuls and convolutions cast their inputs down; a weight's
  cast is cached for the autocast region, and autograd saves it for the matmul's backward, so
  a low-precision copy of each weight lives from its forward use until its backward (FSDP's
  resharding frees the float32 parameter, not that copy). Other ops keep float32
  (cross-entropy and the other losses on a CPU; softmax, layer norm and the losses on CUDA).
The analysis (facts/analysis.py), ``verify`` and ``bench`` (measure/runtime.py) run forward and
loss inside the same ``autocast_context``, so what autocast keeps is traced, not modelled.
The memory model then sees float32 units (``Precision.param_bytes == 4``).

The op lists differ between device types, and a CPU build cannot run CUDA's: the analysis
and the CPU measurement both use the CPU lists (they agree), and ``verify`` names the
difference for a GPU (``GPU_DIFFERENCE``).

This module is torch-free at import: the plan side reads ``plan_autocast_dtype``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from fsdp_plan.common.dtypes import canonical_dtype

AUTOCAST_DTYPES = ("bfloat16", "float16")
"""The dtypes ``torch.autocast`` computes in (canonical names)."""

GPU_DIFFERENCE = (
    "the step ran under torch.autocast with the CPU's op lists; CUDA's autocast also keeps "
    "softmax, log_softmax and layer/group norm outputs in float32 (the CPU keeps them in the "
    "autocast dtype), so a GPU can hold somewhat more activation memory where those ops save "
    "their outputs")


def plan_autocast_dtype(plan: Any) -> str | None:
    """The dtype a plan's forward and loss run under ``torch.autocast`` in, or None.

    ``plan`` is a ``Plan`` or its dict form (the policy module's ``PLAN``):
    ``mixed_precision.autocast_dtype`` when set, else for a DDP plan its ``param_dtype`` when
    that is below float32 (see [Note: autocast precision])."""
    precision = getattr(plan, "mixed_precision", None)
    raw = plan if isinstance(plan, Mapping) else {
        "mixed_precision": precision.to_dict() if hasattr(precision, "to_dict") else precision,
        "strategy": getattr(plan, "strategy", None)}
    precision = raw.get("mixed_precision") or {}
    named = precision.get("autocast_dtype")
    if named:
        return _canonical(str(named))
    param = precision.get("param_dtype")
    if raw.get("strategy") == "ddp" and param and _canonical(str(param)) in AUTOCAST_DTYPES:
        return _canonical(str(param))
    return None


def _canonical(name: str) -> str:
    return canonical_dtype(name)


@contextlib.contextmanager
def autocast_context(dtype: str | None, device_type: str = "cpu") -> Iterator[None]:
    """``torch.autocast(device_type, dtype)`` for ``dtype`` (a canonical name), or nothing.

    Its weight cache is emptied when the outermost autocast region ends, as in training."""
    if dtype is None:
        yield
        return
    import torch
    with torch.autocast(device_type, dtype=getattr(torch, dtype)):
        yield


@contextlib.contextmanager
def float32_autocast_as_on_cuda() -> Iterator[None]:
    """Within the block, ``torch.autocast("cpu", dtype=torch.float32)`` computes in float32 as
    CUDA's autocast does, instead of being disabled with a warning.

    [Note: float32 autocast regions]
    Models open float32 regions inside a lower-precision step so that a few ops compute in
    float32 whatever the parameters' dtype: torchtitan's MoE router runs its gate as
    ``torch.autocast(device_type=x.device.type, dtype=torch.float32)``. CUDA's autocast takes
    float32: the gate's matmul casts its bfloat16 input and weight up, saves the float32 copy
    of the input for backward, and returns float32 scores. ``torch.autocast``'s Python check
    allows only bfloat16 and float16 on a CPU, so on the CPU tensors every fake pass and gloo
    measurement runs, the region was disabled: the gate ran in bfloat16 and the float32 copy,
    ``batch x seq x dim x 4`` bytes a MoE layer, was missing from the plan and from verify
    alike. The dispatcher's CPU autocast does compute in float32 when asked, so within this
    block the check lets float32 through on a CPU. Nothing else changes: other dtypes and
    devices go to ``torch.autocast`` as given. Enter it around forward and backward both, so
    activation checkpointing's recompute opens the same region.
    """
    import torch
    from torch.amp import autocast_mode

    original = autocast_mode.autocast.__init__
    if getattr(original, "float32_on_cpu", False):  # already inside the block
        yield
        return

    def init(self: Any, device_type: str, dtype: Any = None, enabled: bool = True,
             cache_enabled: bool | None = None) -> None:
        float32_on_cpu = device_type == "cpu" and enabled and dtype == torch.float32
        original(self, device_type, torch.bfloat16 if float32_on_cpu else dtype, enabled,
                 cache_enabled)
        if float32_on_cpu:
            self.fast_dtype = torch.float32

    init.float32_on_cpu = True  # type: ignore[attr-defined]
    autocast_mode.autocast.__init__ = init  # type: ignore[method-assign]
    try:
        yield
    finally:
        autocast_mode.autocast.__init__ = original  # type: ignore[method-assign]


def device_type_of(value: Any) -> str:
    """The device type of the first tensor in ``value`` (inputs or a module), else ``cpu``."""
    import torch
    from torch.utils._pytree import tree_flatten

    if isinstance(value, torch.nn.Module):
        tensor = next(value.parameters(), None)
        return tensor.device.type if tensor is not None else "cpu"
    leaves, _ = tree_flatten(value)
    tensor = next((t for t in leaves if isinstance(t, torch.Tensor)), None)
    return tensor.device.type if tensor is not None else "cpu"
