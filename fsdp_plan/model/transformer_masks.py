"""Let PyTorch's own ``nn.Transformer*`` modules run on fake tensors: the causal-mask check.

[Note: causal masks on fake tensors]
Given a float attention mask and no ``is_causal`` hint (the tutorials' way:
``tgt_mask=nn.Transformer.generate_square_subsequent_mask(n)``), ``nn.TransformerEncoder`` and
``nn.TransformerDecoder`` ask ``torch.nn.modules.transformer._detect_is_causal_mask`` whether
the mask equals the causal one, by comparing values: ``bool((mask == causal).all())``, which
fake tensors cannot answer (``DataDependentOutputException``). The answer matters: a causal
mask lets attention drop the mask and run causal SDPA, another keeps the mask.

While the planner traces (analysis.py) or measures (measure/memory.py) on fake tensors,
``transformer_masks_traceable`` answers from how the mask was made instead of from its
values. A mask made as ``torch.triu(torch.full((n, n), -inf), diagonal=1)`` (what
``generate_square_subsequent_mask`` does, and how such masks are written by hand) is causal,
and so is any copy, cast, ``detach`` or same-shape view of one; a dispatch mode records those
tensors as they are made. Other fake masks (built from data, or in ways not recognised) are
answered "not causal", and the planner says so in its notes: passing ``is_causal`` (or
``tgt_is_causal``) makes the plan certain. Real tensors, and a hint given, go to torch's own
check unchanged, and only torch's transformer module is patched: a user's own ``.item()``
still fails with the planner's clear message. ``transformers``' mask builder has a check of
the same kind, answered the same way while this block runs ([Note: packed-sequence detection
on fake tensors] in hf.py).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

from fsdp_plan.model.hf import hf_masks_as_trained

aten = torch.ops.aten

UNKNOWN_MASK_NOTE = (
    "nn.Transformer attention masks: a float mask given without is_causal was not made by "
    "torch.triu(torch.full((n, n), -inf), diagonal=1) (generate_square_subsequent_mask), so the "
    "planner, which cannot read mask values, treated it as not causal (attention keeps the "
    "mask). Pass is_causal=True / tgt_is_causal=True with a causal mask to plan the causal "
    "kernel for certain.")

# Ops that give back the same values as their first input (same shape checked separately).
_VALUE_PRESERVING = {aten._to_copy.default, aten.clone.default, aten.detach.default,
                     aten.alias.default, aten.view.default, aten._unsafe_view.default,
                     aten.contiguous.default, aten.lift_fresh.default,
                     aten.lift_fresh_copy.default}


class MaskOrigins(TorchDispatchMode):
    """Records which square tensors hold ``-inf`` everywhere (``full``) or above the diagonal
    and ``0`` elsewhere (``triu(diagonal=1)`` of such a tensor), as they are made."""

    # A checkpointed compiled block's graphs call higher-order ops (run_and_save_rng_state),
    # which a mode without this flag refuses; they run through ``__torch_dispatch__`` unchanged.
    supports_higher_order_operators = True

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        """Off while Dynamo compiles a block (``--compile`` measured by verify): a dispatch mode
        that is not would make ``fullgraph=True`` find no compiled frames. Masks are made
        outside the compiled blocks, so none goes unseen."""
        return True

    def __init__(self) -> None:
        super().__init__()
        self.filled = WeakTensorKeyDictionary()
        self.causal = WeakTensorKeyDictionary()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.record(func, args, kwargs, out)
        return out

    def record(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Note ``out`` when ``func`` made it a mask of -inf or a causal one (the mode's own
        dispatch, or a caller's mode that watches for it: ``watch=False``)."""
        if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.shape[0] != out.shape[1]:
            return
        if not out.is_floating_point():
            return
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if func is aten.full.default:
            fill = args[1] if len(args) > 1 else kwargs.get("fill_value")
            if isinstance(fill, (int, float)) and math.isinf(fill) and fill < 0:
                self.filled[out] = True
        elif func is aten.triu.default and source is not None and source in self.filled:
            diagonal = args[1] if len(args) > 1 else kwargs.get("diagonal", 0)
            if diagonal == 1:
                self.causal[out] = True
        elif (func in _VALUE_PRESERVING and source is not None and source in self.causal
              and source.shape == out.shape):
            self.causal[out] = True


def _is_fake(value: Any) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(value, FakeTensor)


@contextlib.contextmanager
def transformer_masks_traceable(notes: list[str] | None = None, *, watch: bool = True
                                ) -> Iterator[MaskOrigins]:
    """Within the block, ``nn.Transformer*`` decide a fake mask's causality from how it was
    made ([Note: causal masks on fake tensors]); ``notes`` gets ``UNKNOWN_MASK_NOTE`` once if a
    mask had to be taken as not causal. Enter it inside the ``FakeTensorMode`` before the
    inputs are made, so masks made there are seen. It gives the origins it reads:
    ``watch=False`` does not enter them as a mode, and the caller's own mode then feeds
    ``MaskOrigins.record`` every op from the inputs on (facts/analysis.py [Note: one
    dispatch mode per pass])."""
    from torch.nn.modules import transformer

    origins = MaskOrigins()
    torch_check = transformer._detect_is_causal_mask

    def detect(mask: torch.Tensor | None, is_causal: bool | None = None,
               size: int | None = None) -> bool:
        if is_causal is not None or mask is None or not _is_fake(mask):
            return torch_check(mask, is_causal, size)
        n = size if size is not None else mask.size(-2)
        if tuple(mask.shape) != (n, n):
            return False  # torch compares sizes first: not causal, no values needed
        if mask in origins.causal:
            return True
        if notes is not None and UNKNOWN_MASK_NOTE not in notes:
            notes.append(UNKNOWN_MASK_NOTE)
        return False

    transformer._detect_is_causal_mask = detect
    try:
        # transformers' own mask builder has a check of the same kind (hf.py)
        with origins if watch else contextlib.nullcontext(), hf_masks_as_trained():
            yield origins
    finally:
        transformer._detect_is_causal_mask = torch_check
