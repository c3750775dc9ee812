"""PyTorch's own ``nn.Transformer`` as its tutorials train it, for planning with fsdp-plan.

Token embeddings for source and target, ``nn.Transformer`` (encoder-decoder, ``batch_first``)
and a generator to the vocabulary. The target mask is the tutorials' float causal mask,
``nn.Transformer.generate_square_subsequent_mask(n)``, passed WITHOUT ``tgt_is_causal``: torch
then compares it with a causal mask value by value, which the planner answers from how the
mask was made ([Note: causal masks on fake tensors] in fsdp_plan/transformer_masks.py).

Sizes: ``small`` (d_model 64, 2 + 2 layers, vocabulary 512) trains on a CPU in seconds;
``base`` is the "Attention is all you need" base model (d_model 512, 6 + 6 layers, 8 heads,
feed-forward 2048) over a 32,000-token shared vocabulary.

    fsdp-plan examples/seq2seq_transformer.py --model-arg size=base --mem 16GB --world-size 8 \\
        --batch-size 8 --seq-len 512
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(kw_only=True, frozen=True)
class Seq2SeqConfig:
    d_model: int
    nhead: int
    num_encoder_layers: int
    num_decoder_layers: int
    dim_feedforward: int
    vocab_size: int
    dropout: float = 0.0


SIZES = {
    "small": Seq2SeqConfig(d_model=64, nhead=4, num_encoder_layers=2, num_decoder_layers=2,
                           dim_feedforward=128, vocab_size=512),
    "base": Seq2SeqConfig(d_model=512, nhead=8, num_encoder_layers=6, num_decoder_layers=6,
                          dim_feedforward=2048, vocab_size=32000),
}
_last_config = SIZES["small"]


class Seq2SeqTransformer(nn.Module):
    def __init__(self, cfg: Seq2SeqConfig) -> None:
        super().__init__()
        self.src_embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.tgt_embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.transformer = nn.Transformer(
            d_model=cfg.d_model, nhead=cfg.nhead, num_encoder_layers=cfg.num_encoder_layers,
            num_decoder_layers=cfg.num_decoder_layers, dim_feedforward=cfg.dim_feedforward,
            dropout=cfg.dropout, batch_first=True)
        self.generator = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor, tgt_mask: torch.Tensor) -> torch.Tensor:
        out = self.transformer(self.src_embed(src), self.tgt_embed(tgt), tgt_mask=tgt_mask)
        return self.generator(out)


def build_model(size: str = "small") -> Seq2SeqTransformer:
    """The shape ``size`` (small, base)."""
    global _last_config
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")
    _last_config = SIZES[size]
    return Seq2SeqTransformer(_last_config)


def example_inputs(batch_size: int, seq_len: int) -> tuple[torch.Tensor, ...]:
    """Source and target token ids ``[batch_size, seq_len]`` and the float causal target mask
    ``[seq_len, seq_len]`` of the tutorials (no ``tgt_is_causal``)."""
    vocab = _last_config.vocab_size
    src = torch.randint(0, vocab, (batch_size, seq_len))
    tgt = torch.randint(0, vocab, (batch_size, seq_len))
    return src, tgt, nn.Transformer.generate_square_subsequent_mask(seq_len)


def loss_fn(logits: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy against a fixed target (keeps the logits' grad real)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), torch.zeros(
        logits.shape[0] * logits.shape[1], dtype=torch.long, device=logits.device))
