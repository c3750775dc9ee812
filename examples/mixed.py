"""A deliberately awkward hand-written model, for fsdp-plan's edge cases.

Nothing here is a real architecture; every piece is something a planner must not trip on:

- a parameter directly on the ROOT module (``scale``), outside any child, so it can only be
  sharded by the root unit;
- a persistent buffer (``center``, saved in the state dict) and a non-persistent one
  (``pos_table``, not saved): buffers are not sharded, but they occupy device memory;
- an ``nn.ModuleDict`` of branches (``branches.narrow``, ``branches.wide``) whose FQNs are
  dict keys, holding ``nn.Sequential`` children with parameter-free modules (GELU) in them;
- layers of very different sizes: ``branches.wide.2`` is a 256->1024 Linear (263,168
  parameters, 87% of the model) next to 16->16 Linears of 272 parameters;
- ONE module used twice in a single forward: ``shared_proj`` runs before the branches and
  again after them, so its forward (and its FSDP pre-forward all-gather hook) fires twice per
  step and its gradient accumulates from two uses;
- no ``loss_fn``: the output is a plain tensor, so the planner's default ``.sum()`` applies.

It starts with an ``nn.Embedding`` but defines ``example_inputs`` anyway (token ids of shape
``[batch_size, seq_len]``). Sizes: ``tiny`` (301,680 parameters) and ``big`` (every dimension,
the vocabulary included, times 8: 19,200,896 parameters). Sequences up to 4096 tokens.

    fsdp-plan examples/mixed.py --model-arg size=big --mem 4GB --world-size 4
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from torch import nn


@dataclass(kw_only=True, frozen=True)
class MixedConfig:
    vocab_size: int
    dim: int          # the narrow width, used by most layers
    wide_dim: int     # the wide branch's first hidden width
    big_dim: int      # the wide branch's second hidden width (the big Linear's output)
    max_seq_len: int = 4096


SIZES: dict[str, MixedConfig] = {
    "tiny": MixedConfig(vocab_size=512, dim=16, wide_dim=256, big_dim=1024),
    "big": MixedConfig(vocab_size=4096, dim=128, wide_dim=2048, big_dim=8192),
}

# The config of the model built last, so that example_inputs (which the planner calls with
# only batch_size and seq_len) draws token ids from the right vocabulary.
_last_config: MixedConfig = SIZES["tiny"]


def sinusoid_table(max_seq_len: int, dim: int) -> torch.Tensor:
    """Fixed sinusoidal positions ``[max_seq_len, dim]`` (shape-only work: fine on meta)."""
    pos = torch.arange(max_seq_len, dtype=torch.float32)[:, None]
    freqs = torch.exp(torch.arange(0, dim, 2, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(max_seq_len, dim)
    table[:, 0::2] = torch.sin(pos * freqs)
    table[:, 1::2] = torch.cos(pos * freqs)
    return table


class Mixed(nn.Module):
    def __init__(self, cfg: MixedConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.scale = nn.Parameter(torch.ones(cfg.dim))                 # root parameter
        self.register_buffer("center", torch.zeros(cfg.dim))           # persistent buffer
        self.register_buffer("pos_table", sinusoid_table(cfg.max_seq_len, cfg.dim),
                             persistent=False)                         # non-persistent buffer
        self.shared_proj = nn.Linear(cfg.dim, cfg.dim)                 # used twice in forward
        self.branches = nn.ModuleDict({
            "narrow": nn.Sequential(
                nn.Linear(cfg.dim, cfg.dim), nn.GELU(), nn.Linear(cfg.dim, cfg.dim)),
            "wide": nn.Sequential(
                nn.Linear(cfg.dim, cfg.wide_dim), nn.GELU(),
                nn.Linear(cfg.wide_dim, cfg.big_dim), nn.GELU(),         # the big layer
                nn.Linear(cfg.big_dim, cfg.dim)),
        })
        self.norm = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq_len = tokens.shape[1]
        if seq_len > self.cfg.max_seq_len:
            raise ValueError(f"mixed model takes at most {self.cfg.max_seq_len} tokens; "
                             f"got {seq_len}")
        # Buffers stay float32 under FSDP mixed precision: cast them to the compute dtype.
        x = self.embed(tokens) * self.scale + self.pos_table[:seq_len].to(self.embed.weight.dtype)
        x = self.shared_proj(x)                                        # first use
        x = x + self.branches["narrow"](x) + self.branches["wide"](x)
        x = self.norm(x - self.center.to(x.dtype))
        x = self.shared_proj(x)                                        # second use
        return self.head(x)


def build_model(size: str = "tiny", **kw) -> Mixed:
    """The mixed model at ``size`` (tiny, big); keyword arguments override :class:`MixedConfig`."""
    global _last_config
    if size not in SIZES:
        raise ValueError(f"unknown mixed-model size {size!r}; choose one of {', '.join(SIZES)}")
    fields = MixedConfig.__dataclass_fields__
    unknown = sorted(set(kw) - set(fields))
    if unknown:
        raise ValueError(f"unknown mixed-model option(s) {', '.join(unknown)}; "
                         f"valid: size, {', '.join(fields)}")
    cfg = replace(SIZES[size], **{k: int(v) for k, v in kw.items()})
    _last_config = cfg
    return Mixed(cfg)


def example_inputs(batch_size: int, seq_len: int, size: str | None = None) -> tuple[torch.Tensor]:
    """Token ids ``[batch_size, seq_len]`` over the vocabulary of ``size`` if given, else of
    the model ``build_model`` built last. Works on meta and under FakeTensorMode."""
    cfg = SIZES[size] if size is not None else _last_config
    if seq_len > cfg.max_seq_len:
        raise ValueError(f"mixed model takes at most {cfg.max_seq_len} tokens; "
                         f"--seq-len {seq_len} is longer")
    return (torch.randint(0, cfg.vocab_size, (batch_size, seq_len)),)
