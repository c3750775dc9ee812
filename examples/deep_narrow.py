"""A deep, narrow residual MLP in plain PyTorch: a step of many small ops, for the clock's floor.

``blocks.N`` residual blocks, each ``x + fc2(gelu(fc1(norm(x))))`` with every layer ``width``
wide, between a token embedding and an output head. At ``base`` (48 blocks of width 128) and
a few tokens (2 x 16) every matrix multiply is a few hundred kFLOP: the step is set by the
host issuing its ~700 ops and FSDP's per-unit hooks, not by arithmetic, which is what
``benchmarks/closed_loop.py --models "deep narrow"`` checks the clock against (issue 18
item 5). Parameter counts (vocabulary 256):

    tiny   (4 blocks of width 32)      25,152
    base   (48 blocks of width 128) 1,663,232

    fsdp-plan examples/deep_narrow.py --mem 1GB --world-size 2 --batch-size 2 --seq-len 16
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(kw_only=True, frozen=True)
class DeepNarrowConfig:
    n_blocks: int
    width: int
    vocab_size: int = 256


SIZES: dict[str, DeepNarrowConfig] = {
    "tiny": DeepNarrowConfig(n_blocks=4, width=32),
    "base": DeepNarrowConfig(n_blocks=48, width=128),
}


class Block(nn.Module):
    """One pre-norm residual MLP block: seven ops forward (norm, two matmuls with bias adds,
    GELU, the residual add)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, width)
        self.fc2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class DeepNarrow(nn.Module):
    def __init__(self, cfg: DeepNarrowConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.width)
        self.blocks = nn.ModuleList(Block(cfg.width) for _ in range(cfg.n_blocks))
        self.norm = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


def build_model(size: str = "base", n_blocks: int | None = None,
                width: int | None = None) -> DeepNarrow:
    """The shape ``size`` (tiny, base); ``n_blocks`` and ``width`` override it."""
    if size not in SIZES:
        raise ValueError(f"unknown deep_narrow size {size!r}; choose one of {', '.join(SIZES)}")
    cfg = SIZES[size]
    cfg = DeepNarrowConfig(n_blocks=int(n_blocks or cfg.n_blocks), width=int(width or cfg.width),
                           vocab_size=cfg.vocab_size)
    return DeepNarrow(cfg)


def loss_fn(logits: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy against a fixed target (keeps the logits' gradient real)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), torch.zeros(
        logits.shape[0] * logits.shape[1], dtype=torch.long, device=logits.device))
