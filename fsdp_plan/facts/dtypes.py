"""Catch, in a fake-tensor dry run, the dtype mismatches a real device would refuse.

Meta and fake kernels of ``mm``/``addmm``/``bmm``/convolution accept a float32 input with
bfloat16 weights; CPU and CUDA kernels raise ``mat1 and mat2 must have the same dtype``. With
FSDP2 mixed precision this happens when a float32 tensor that no ``fully_shard`` unit casts
(a float32 buffer added to activations inside a unit, for instance) reaches a matmul whose
weights were gathered in ``param_dtype``. Without this check ``verify`` would pass a plan that
crashes on its first real step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fsdp_plan.common.errors import BadInput

aten = torch.ops.aten

# Ops whose CPU/CUDA kernels require every floating-point operand to share one dtype.
SAME_DTYPE_OPS = {
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
    aten.mv.default, aten.addmv.default, aten.dot.default, aten.convolution.default,
}


# Batch norm (input, weight, bias, running_mean, running_var, ...): CPU and CUDA kernels need
# weight, bias and running statistics in one dtype, and an input in another dtype only when
# those are float32 ("expected scalar type BFloat16 but found Float" when bf16 weights meet
# float32 running statistics: FSDP2 gathered a batch norm in bf16). Fake kernels accept both.
BATCH_NORM_OPS = {aten.native_batch_norm.default, aten._native_batch_norm_legit.default,
                  aten._native_batch_norm_legit_no_training.default, aten.cudnn_batch_norm.default}


def _batch_norm_dtypes(args: tuple) -> list[str] | None:
    """The clashing dtypes of a batch norm call (input first), or None when it would run."""
    tensors = [t for t in args[:5] if isinstance(t, torch.Tensor) and t.is_floating_point()]
    params = {t.dtype for t in tensors[1:]}
    if not tensors or (len(params) <= 1 and params <= {tensors[0].dtype, torch.float32}):
        return None
    return sorted({str(t.dtype).removeprefix("torch.") for t in tensors})


class DtypeChecker(TorchDispatchMode):
    """Records (does not raise) the first mismatches, with the modules running at the time."""

    def __init__(self, where: Callable[[], str] | None = None, limit: int = 3) -> None:
        super().__init__()
        self.where = where
        self.limit = limit
        self.mismatches: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        if any(t == DTensor for t in types):
            return NotImplemented  # check the local ops DTensor desugars into
        self.check(func, args, kwargs)
        return func(*args, **kwargs)

    def check(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Record a mismatch of ``func``'s operands (the mode's own dispatch, or a pass's one
        mode that runs the check: facts/analysis.py [Note: one dispatch mode per pass])."""
        if func in SAME_DTYPE_OPS and len(self.mismatches) < self.limit:
            flat, _ = tree_flatten((args, kwargs))
            # Integer operands count too: int64 token ids fed to nn.Linear pass on fake tensors
            # and fail on a real device the same way.
            dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in flat
                             if isinstance(t, torch.Tensor)})
            if len(dtypes) > 1:
                place = f" in {self.where()}" if self.where else ""
                self.mismatches.append(f"{func.name()} got {' and '.join(dtypes)}{place}")
        if func in BATCH_NORM_OPS and len(self.mismatches) < self.limit:
            dtypes = _batch_norm_dtypes(tuple(args))
            if dtypes:
                place = f" in {self.where()}" if self.where else ""
                self.mismatches.append(
                    f"{func.name()} got {' and '.join(dtypes)}{place} (batch norm weights must "
                    "match their float32 running statistics: re-plan, so that each batch norm is "
                    "a float32 unit of its own)")

    def raise_if_mismatched(self) -> None:
        """``BadInput`` naming the ops, modules and dtypes when any mismatch was recorded."""
        if not self.mismatches:
            return
        raise BadInput(
            f"the model's forward mixes dtypes in ops whose real kernels need one dtype "
            f"({'; '.join(self.mismatches)}), which a real GPU or CPU refuses (\"expected mat1 "
            "and mat2 to have the same dtype\")"
            " although fake tensors let it pass. Feed integer ids through an nn.Embedding (or "
            ".to(weight.dtype) them) before a Linear, and cast float32 buffers to the parameters' "
            "dtype where they meet the weights (FSDP mixed precision casts parameters, not buffers)."
        )


def running_modules(mod_tracker: Any) -> Callable[[], str]:
    """The innermost module a ``ModTracker`` is in (its longest parent name), as a plan FQN."""
    def where() -> str:
        parents = [p for p in getattr(mod_tracker, "parents", ()) if p != "Global"]
        if not parents:
            return "the loss (outside the model)"
        # Tracker names start with the root's class name (``FSDPLlama.layers.0``).
        _, _, fqn = max(parents, key=len).partition(".")
        return repr(fqn.replace("._checkpoint_wrapped_module", "")) if fqn else "the root"
    return where
