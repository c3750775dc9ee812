"""torchtitan's own models as a planner MODEL (``fsdp_plan.model.torchtitan_models:build_model``,
or the shorthand ``torchtitan:NAME:FLAVOR``): built from torchtitan's registry on ``meta``, so
the plan names torchtitan's modules (``tok_embeddings``, ``layers.N``, ``norm``, ``lm_head``)
and ``--framework torchtitan`` finds the units its ``apply_fsdp_to_decoder`` makes.

[Note: torchtitan attention under analysis] (read in torchtitan 0.3.0, torch 2.13)
torchtitan's language models attend with FlexAttention (``attn_backend="flex"``, the only
backend its configs allow besides varlen), and ``flex_attention`` refuses a backward on a CPU
tensor before dispatching anything (``_validate_device``: "FlexAttention does not support
backward on CPU"), fake CPU tensors included, so neither the analysis nor an FSDPMemTracker
measurement can run torchtitan's call (``torch.compile(flex_attention)``). Its higher-order
op alone does run forward and backward on fake CPU tensors; tests/test_torchtitan_models.py
compares the two saved sets with it. ``build_model`` therefore replaces each block's ``FlexAttention``
(no parameters, no buffers) with torchtitan's own ``ScaledDotProductAttention`` (causal,
``enable_gqa`` as the block passes it). No parameter, buffer or FQN changes, so units,
parameter bytes, collectives and the exported configuration are torchtitan's. What changes:

- Saved for backward, per block: both save q, k (and v) at their key/value head count, the
  output and a float32 logsumexp of ``[batch, heads, seq]`` (the CPU flash kernel saves
  exactly these; GPU flash adds an RNG state of a few bytes). FlexAttention's autograd also
  saves ``max_scores`` (float32 ``[batch, heads, seq]``, one more logsumexp-sized tensor)
  and the BlockMask's int32 block tables (``[batch, 1, seq/128, seq/128]`` at most, made
  once per step and shared by every block); the analysis leaves both out: at the 8B shape,
  batch 1 x 8192, 1 MiB a block and 16 KiB a table. Neither is O(seq^2).
- FLOPs: the dense L x L attention FLOPs fsdp-plan counts for any SDPA (``flop_registry``);
  FlexAttention with the causal BlockMask skips the blocks above the diagonal (about half
  the attention FLOPs), so the step time's attention share is an overestimate.
- The mask: causal only. torchtitan's trainer masks packed documents as well
  (``get_attention_masks``), which removes more blocks but saves the same tensors.

The RoPE cache: every block holds its own ``[max_seq_len, head_dim / 2]`` complex64 buffer,
which torchtitan's trainer sizes to ``training.seq_len`` (``Decoder.Config.update_from_config``);
``build_model(seq_len=N)`` does the same (the shorthand passes ``--seq-len``), else the
flavour's 131,072 positions are kept (64 MiB a block at the 8B shape).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

import torch
from torch import nn

from fsdp_plan.common.errors import BadInput

NOTE = ("torchtitan's FlexAttention is analysed as its causal ScaledDotProductAttention "
        "(FlexAttention has no backward on a CPU, fake tensors included): the same saved "
        "q/k/v, output and logsumexp, without flex's max_scores and block tables, and the "
        "dense attention FLOPs (see fsdp_plan/model/torchtitan_models.py)")


def _registry(name: str) -> Any:
    """torchtitan's ``model_registry`` of model ``name`` (``torchtitan.models.NAME``)."""
    try:
        models = importlib.import_module("torchtitan.models")
    except ImportError as e:
        raise BadInput("planning a torchtitan model needs torchtitan installed (pip install "
                       "torchtitan, or the frameworks extra).") from e
    supported = sorted(getattr(models, "_supported_models", ()))
    if name not in supported:
        raise BadInput(f"torchtitan has no model {name!r}; its models are "
                       f"{', '.join(supported)}.")
    module = importlib.import_module(f"torchtitan.models.{name}")
    registry = getattr(module, "model_registry", None)
    if registry is None:
        raise BadInput(f"torchtitan.models.{name} has no model_registry; fsdp-plan reads "
                       "torchtitan 0.3's registry.")
    return module, registry


def flavors(name: str) -> list[str]:
    """The flavour names torchtitan's config registry gives model ``name``."""
    module, _ = _registry(name)
    tables = [v for k, v in vars(module).items() if k.endswith("_configs") and isinstance(v, dict)]
    return sorted({f for table in tables for f in table})


def build_model(name: str = "llama3", flavor: str = "debugmodel",
                seq_len: int | None = None) -> nn.Module:
    """torchtitan's ``NAME`` model at ``FLAVOR`` (``model_registry(flavor).model.build()``),
    its FlexAttention swapped for causal SDPA ([Note: torchtitan attention under analysis]);
    ``seq_len``: the RoPE caches sized as torchtitan's trainer sizes them."""
    _, registry = _registry(name)
    known = flavors(name)
    if known and flavor not in known:
        raise BadInput(f"torchtitan's {name} has no flavor {flavor!r}; its flavors are "
                       f"{', '.join(known)}.")
    config = registry(flavor).model
    if seq_len is not None:
        _size_rope(config, int(seq_len))
    model = config.build()
    swap_flex_attention(model)
    _refuse_varlen_attention(model, name, flavor)
    return model


build_model.fsdp_plan_notes = [NOTE]  # type: ignore[attr-defined]  (load.py reads them)


def _size_rope(config: Any, seq_len: int) -> None:
    """What ``Decoder.Config.update_from_config`` does with ``training.seq_len``."""
    if seq_len < 1:
        raise BadInput(f"seq_len {seq_len} sizes no RoPE cache; it must be 1 or more.")
    for layer in getattr(config, "layers", []) or []:
        attention = getattr(layer, "attention", None)
        rope = getattr(attention, "rope", None)
        if rope is not None and hasattr(rope, "max_seq_len"):
            if seq_len > rope.max_seq_len:
                raise BadInput(f"--seq-len {seq_len} exceeds the flavour's RoPE maximum "
                               f"{rope.max_seq_len}, which torchtitan refuses too.")
            attention.rope = dataclasses.replace(rope, max_seq_len=seq_len)


def swap_flex_attention(model: nn.Module) -> int:
    """Replace every ``FlexAttention`` module with torchtitan's causal
    ``ScaledDotProductAttention``, in place; returns how many were replaced."""
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    swapped = 0
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, FlexAttention):
                setattr(parent, child_name, ScaledDotProductAttention(
                    ScaledDotProductAttention.Config()))
                swapped += 1
    return swapped


def _refuse_varlen_attention(model: nn.Module, name: str, flavor: str) -> None:
    """A model attending through torchtitan's ``VarlenAttention`` (gpt_oss by default: its
    attention sinks and sliding windows ride on the kernel's logsumexp) cannot run here: the
    varlen kernels are CUDA flash attention, fed per-document metadata the trainer builds, and
    causal SDPA in its place would drop the sinks' gradient. Refused with what to do."""
    from torchtitan.models.common.attention import VarlenAttention
    if any(isinstance(m, VarlenAttention) for m in model.modules()):
        raise BadInput(f"torchtitan's {name} ({flavor}) attends through VarlenAttention (CUDA "
                       "flash-attention varlen kernels fed per-document metadata, which carry "
                       "its attention sinks and sliding windows), and fsdp-plan analyses "
                       "torchtitan's FlexAttention models only. Plan it from a model file whose attention runs on a CPU "
                       "(e.g. a Hugging Face GptOss config with --hf-config).")


def example_inputs(batch_size: int, seq_len: int) -> tuple[torch.Tensor, ...]:
    """Token ids ``[batch_size, seq_len]`` (no positions, no mask: causal attention). The
    vocabulary does not change the step's memory, so ids 0 stand for any token."""
    return (torch.zeros(batch_size, seq_len, dtype=torch.long),)



def base_config(name: str, flavor: str) -> str | None:
    """torchtitan's own training config for ``name`` at ``flavor``
    (``torchtitan.models.NAME.config_registry:NAME_FLAVOR``, e.g. ``llama3_8b``), when its
    config registry defines one; the export starts from it."""
    module = f"torchtitan.models.{name}.config_registry"
    function = f"{name}_{flavor.lower()}"
    try:
        registry = importlib.import_module(module)
    except ImportError:
        return None
    return f"{module}:{function}" if callable(getattr(registry, function, None)) else None


def flex_differences(name: str, flavor: str, batch_size: int, seq_len: int,
                     rope_sized: bool = True) -> list[str]:
    """What torchtitan's FlexAttention run keeps beyond the plan's SDPA analysis ([Note:
    torchtitan attention under analysis]), in bytes for this model and micro-batch;
    ``rope_sized``: the plan's RoPE caches were sized to ``seq_len`` as the trainer sizes them."""
    _, registry = _registry(name)
    config = registry(flavor).model
    layers = list(getattr(config, "layers", []) or [])
    attention = [getattr(layer, "attention", None) for layer in layers]
    heads = [a.n_heads for a in attention if a is not None and hasattr(a, "n_heads")]
    if not heads:
        return []
    per_block = batch_size * heads[0] * seq_len * 4  # max_scores: float32 [batch, heads, seq]
    blocks = -(-seq_len // 128)
    tables = batch_size * blocks * blocks * 4  # an int32 [batch, 1, seq/128, seq/128] table
    lines = []
    ropes = [getattr(a, "rope", None) for a in attention if a is not None]
    ropes = [r for r in ropes if r is not None and hasattr(r, "max_seq_len") and hasattr(r, "dim")]
    if not rope_sized and ropes and ropes[0].max_seq_len != seq_len:
        width = ropes[0].dim // 2 * 8  # complex64 [max_seq_len, dim / 2]
        extra = (ropes[0].max_seq_len - seq_len) * width * len(ropes)
        lines.append(f"Buffers: the plan kept the flavour's RoPE caches of "
                     f"{ropes[0].max_seq_len:,} positions; torchtitan's trainer sizes them to "
                     f"training.seq_len {seq_len:,}, {extra:,} bytes fewer in all (plan with "
                     f"torchtitan:{name}:{flavor}, or --model-arg seq_len={seq_len}, to match).")
    return lines + [
        (f"Attention: the plan was analysed with torchtitan's causal ScaledDotProductAttention "
        f"in place of its FlexAttention (FlexAttention has no backward on a CPU, where "
        f"fsdp-plan analyses). Both save q, k, v, the output and a float32 logsumexp per "
        f"block; FlexAttention also saves max_scores, {per_block:,} bytes a block at batch "
        f"{batch_size} x {seq_len} ({len(heads)} blocks: up to {per_block * len(heads):,} bytes "
        f"more at the end of forward without checkpointing), and the BlockMask's block tables "
        f"(up to {tables:,} bytes each, made once per step). The predicted peak leaves these "
        "out."),
        ("Compute: the plan counts dense attention FLOPs; FlexAttention's causal BlockMask "
        "skips the blocks above the diagonal (about half the attention FLOPs), so the "
        "predicted step time overstates attention."),
        ("Mask: the plan's attention is causal; torchtitan's trainer also masks packed "
        "documents, which saves the same tensors."),
    ]
