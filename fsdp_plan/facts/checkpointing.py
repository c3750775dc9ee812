"""Activation checkpointing per block: the three modes, the saved-op list, block -> mode maps.

[Note: checkpointing modes]
Each repeated block runs in one of three modes:
- ``none``: every tensor its forward saves stays until its backward;
- ``selective``: per-op selective checkpointing
  (``torch.utils.checkpoint.create_selective_checkpoint_contexts``): the outputs of the ops in
  the plan's ``selective_ops`` are kept, every other op is replayed in backward; with
  ``selective_mm_stride`` k only the 1st, (k+1)th, ... ``aten.mm`` of each block call is kept
  (torchtitan's "op" policy is its save list with k = 2: a fresh counter per checkpointed call,
  counting forward and recompute apart; ``policy_runtime.selective_policy``);
- ``full``: only the block's input is kept and the whole forward is replayed in backward.
The analysis runs three passes (no checkpointing, every block full, every block selective);
each block's timeline segment comes from the pass of its mode (timeline.py), and the
recompute FLOPs of a mode are the extra backward FLOPs of its pass over the plain one, per
block (for ``full``: the block's forward; for ``selective``: the ops not saved). The selective
pass runs at one stride (a plan's ``selective_mm_stride``, 1 for the search); planning adds a
pass at torchtitan's stride 2 for its recipe row (``Analysis.selective_variants``).

Selective mode is offered only for block classes whose selective pass replays: the analysis
pass is the probe. A replay fails when the recompute issues different ops than the forward
did (SAC hands saved outputs back by op and invocation index); the one such case known,
a block writing a KV cache, is handled at run time by the policy ([Note: selective
checkpointing and KV caches] in policy_runtime.py).

This module is torch-free: the search and the plan read it.
"""

from __future__ import annotations

MODES = ("none", "selective", "full")

DEFAULT_SELECTIVE_OPS = [
    "aten.mm.default",
    "aten.addmm.default",
    "aten.bmm.default",
    "aten.linear.default",
    "aten.convolution.default",
    "aten._scaled_dot_product_flash_attention.default",
    "aten._scaled_dot_product_efficient_attention.default",
    "aten._scaled_dot_product_cudnn_attention.default",
    "aten._scaled_dot_product_flash_attention_for_cpu.default",
    "aten.max.default",
    "_c10d_functional.reduce_scatter_tensor.default",
]
"""torchtitan's saved ops (torchtitan/distributed/activation_checkpoint.py): the
compute-intensive ops (matmuls, convolution, every SDPA kernel: flash, memory-efficient and
cuDNN on GPU, ``_scaled_dot_product_flash_attention_for_cpu`` on CPU and so under fake CPU
tensors), the ``max`` reduction of low-precision scaling, and reduce-scatter (never repeat a
collective). The search saves every matmul (stride 1); the torchtitan recipe row and
hand-written plans may save every second one (``selective_mm_stride: 2``)."""

TORCHTITAN_MM_STRIDE = 2
"""torchtitan's op policy saves every second ``aten.mm`` (the 1st, 3rd, ... of a block)."""


def mode_sets(n_full: int, n_selective: int) -> tuple[frozenset[int], frozenset[int]]:
    """Block indices for ``n_full`` fully and ``n_selective`` selectively checkpointed blocks
    of a stack: the first blocks first (full, then selective), as the search chooses them."""
    full = frozenset(range(n_full))
    return full, frozenset(range(n_full, n_full + n_selective))


def modes_mapping(blocks: list[str], full: list[str], selective: list[str]) -> dict[str, str]:
    """``{FQN: full | selective}`` in block order (the plan's version-2 form)."""
    chosen = {**{b: "full" for b in full}, **{b: "selective" for b in selective}}
    order = {b: i for i, b in enumerate(blocks)}
    return {b: chosen[b] for b in sorted(chosen, key=lambda b: (order.get(b, len(order)), b))}


def describe_counts(n_full: int, n_selective: int) -> str:
    """``8 full + 24 selective`` (``none`` for no checkpointing)."""
    parts = [f"{n_full} full"] if n_full else []
    parts += [f"{n_selective} selective"] if n_selective else []
    return " + ".join(parts) or "none"
