"""Which ops count as matrix multiplies, attention or memory-bound work, and their FLOPs.

The op classes of facts/types.py [Note: op classes], shared by the eager analysis's meter
(facts/analysis.py) and the compiled graphs' counters (facts/fused.py), so both price an op
the same way.
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import (
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
    shape_wrapper,
)


def _cpu_attention_flops(query_shape, key_shape, value_shape, *_args, out_shape=None,
                         **_kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _cpu_attention_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *_args,
                                  out_shape=None, **_kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


CPU_ATTENTION_FLOP_RULES = {
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_attention_flops,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward:
        _cpu_attention_backward_flops,
}
"""FLOP rules for the CPU flash-attention kernels, which ``flop_registry`` lacks: on CPU (and
so under fake CPU tensors) SDPA takes them, and without a rule attention counted 0 FLOPs.
Pass as ``FlopCounterMode(custom_mapping=...)`` to count the same on real tensors."""
FLOP_RULES = {**flop_registry,
              **{op: shape_wrapper(rule) for op, rule in CPU_ATTENTION_FLOP_RULES.items()}}


ATTENTION_PACKETS = {getattr(torch.ops.aten, name) for name in (
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_backward",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_cudnn_attention_backward",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention_for_cpu_backward", "_flash_attention_forward",
    "_flash_attention_backward", "_efficient_attention_forward", "_efficient_attention_backward",
) if hasattr(torch.ops.aten, name)}
BIAS_FIRST = {torch.ops.aten.addmm, torch.ops.aten.baddbmm}


def mm_class(func, args: tuple) -> str:
    """``mm_small`` / ``mm_medium`` / ``mm_large`` by the smallest GEMM dimension
    ([Note: op classes] in facts/types.py); convolutions count as medium."""
    mats = [a for a in (args[1:] if func._overloadpacket in BIAS_FIRST else args)
            if isinstance(a, torch.Tensor) and a.dim() >= 2][:2]
    if len(mats) < 2 or mats[0].dim() > 3:
        return "mm_medium"
    smallest = min(mats[0].shape[-2], mats[0].shape[-1], mats[1].shape[-1])
    return "mm_small" if smallest < 128 else "mm_medium" if smallest < 1024 else "mm_large"
