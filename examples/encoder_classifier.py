"""A text classifier on PyTorch's own ``nn.TransformerEncoder``, with a key padding mask.

Token embeddings, ``nn.TransformerEncoder`` of ``nn.TransformerEncoderLayer`` (``batch_first``,
``enable_nested_tensor`` left at its default, True), mean pooling over the tokens that are not
padding, and a linear head. The inputs carry ``src_key_padding_mask`` (True at padding: the
last quarter of every sequence here). In training the encoder skips its nested-tensor fast
path (it needs eval mode and no gradients), so the step planned is the one that trains.

Sizes: ``small`` (d_model 64, 2 layers, vocabulary 512, 4 classes) trains on a CPU in
seconds; ``base`` is BERT-base-shaped (d_model 768, 12 layers, 12 heads, feed-forward 3072,
vocabulary 30,522, 2 classes).

    fsdp-plan examples/encoder_classifier.py --model-arg size=base --mem 16GB --world-size 8 \\
        --batch-size 32 --seq-len 512
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(kw_only=True, frozen=True)
class ClassifierConfig:
    d_model: int
    nhead: int
    num_layers: int
    dim_feedforward: int
    vocab_size: int
    num_classes: int
    dropout: float = 0.0


SIZES = {
    "small": ClassifierConfig(d_model=64, nhead=4, num_layers=2, dim_feedforward=128,
                              vocab_size=512, num_classes=4),
    "base": ClassifierConfig(d_model=768, nhead=12, num_layers=12, dim_feedforward=3072,
                             vocab_size=30522, num_classes=2),
}
_last_config = SIZES["small"]


class EncoderClassifier(nn.Module):
    def __init__(self, cfg: ClassifierConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        layer = nn.TransformerEncoderLayer(cfg.d_model, cfg.nhead, cfg.dim_feedforward,
                                           dropout=cfg.dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, cfg.num_layers)
        self.head = nn.Linear(cfg.d_model, cfg.num_classes)

    def forward(self, tokens: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(self.embed(tokens), src_key_padding_mask=padding_mask)
        keep = (~padding_mask).unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * keep).sum(1) / keep.sum(1).clamp(min=1.0)
        return self.head(pooled)


def build_model(size: str = "small") -> EncoderClassifier:
    """The shape ``size`` (small, base)."""
    global _last_config
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    _last_config = SIZES[size]
    return EncoderClassifier(_last_config)


def example_inputs(batch_size: int, seq_len: int) -> dict[str, torch.Tensor]:
    """Token ids ``[batch_size, seq_len]`` and the key padding mask (True at the last quarter
    of each sequence, where padding sits)."""
    tokens = torch.randint(0, _last_config.vocab_size, (batch_size, seq_len))
    padding_mask = torch.zeros(batch_size, seq_len, dtype=torch.bool)
    padding_mask[:, seq_len - seq_len // 4:] = True
    return {"tokens": tokens, "padding_mask": padding_mask}


def loss_fn(logits: torch.Tensor) -> torch.Tensor:
    """Classification cross entropy against a fixed target (keeps the logits' grad real)."""
    return F.cross_entropy(logits.float(), torch.zeros(
        logits.shape[0], dtype=torch.long, device=logits.device))
