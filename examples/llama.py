"""A Llama-3-style decoder in plain PyTorch, for planning with fsdp-plan.

RMSNorm, rotary attention with grouped key/value heads, a SwiGLU MLP, and an untied
embedding and output head, laid out like torchtitan's Llama (``tok_embeddings``,
``layers.N``, ``norm``, ``output``). ``build_model(size=...)`` gives the published
Llama 3 shapes, so the parameter counts match the released checkpoints exactly:

    8b   8,030,261,248      70b  70,553,706,496      405b  405,853,388,800
    llama2-13b  13,015,864,320      llama2-70b  68,976,648,192

and ``tiny`` / ``small`` sizes that train on a CPU in seconds.

    fsdp-plan examples/llama.py --model-arg size=70b --mem 80GB --world-size 64
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(kw_only=True)
class LlamaConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    vocab_size: int = 128256
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_seq_len: int = 8192


SIZES: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=192,
                        vocab_size=512),
    "small": LlamaConfig(dim=256, n_layers=8, n_heads=8, n_kv_heads=4, ffn_dim=768,
                         vocab_size=4096),
    "1b": LlamaConfig(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192),
    "8b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336),
    "70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672),
    "405b": LlamaConfig(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, ffn_dim=53248),
    # Llama 2 (32,000-token vocabulary, 4,096-token context): the shapes torchtitan's first
    # published FSDP2 runs trained (benchmarks/published_runs.py).
    "llama2-13b": LlamaConfig(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_dim=13824,
                              vocab_size=32000, rope_theta=10000.0, max_seq_len=4096),
    "llama2-70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
                              vocab_size=32000, rope_theta=10000.0, max_seq_len=4096),
}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # one float32 copy, saved once for both uses (as torchtitan's)
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rotary_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.outer(torch.arange(max_seq_len).float(), freqs)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., ::2], x[..., 1::2]) of a [batch, seq, heads, head_dim] tensor."""
    x_even, x_odd = x[..., 0::2], x[..., 1::2]
    cos = cos[None, :, None, :].to(x.dtype)
    sin = sin[None, :, None, :].to(x.dtype)
    rotated = torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1)
    return rotated.flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.n_kv_heads = cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        bsz, seq_len, _ = x.shape
        q = self.wq(x).view(bsz, seq_len, self.n_heads, self.head_dim)
        k = self.wk(x).view(bsz, seq_len, self.n_kv_heads, self.head_dim)
        v = self.wv(x).view(bsz, seq_len, self.n_kv_heads, self.head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        repeats = self.n_heads // self.n_kv_heads
        k = k.repeat_interleave(repeats, dim=2)
        v = v.repeat_interleave(repeats, dim=2)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(bsz, seq_len, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rotary_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq_len = tokens.shape[1]
        cos, sin = self.rope_cos[:seq_len], self.rope_sin[:seq_len]
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


def build_model(size: str = "tiny", n_layers: int | None = None) -> Llama:
    """The Llama shape ``size`` (tiny, small, 1b, 8b, 70b, 405b, llama2-13b, llama2-70b);
    ``n_layers`` overrides depth."""
    if size not in SIZES:
        raise ValueError(f"unknown Llama size {size!r}; choose one of {', '.join(SIZES)}")
    cfg = SIZES[size]
    if n_layers is not None:
        cfg = LlamaConfig(**{**cfg.__dict__, "n_layers": int(n_layers)})
    return Llama(cfg)


def loss_fn(logits: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy against a fixed target, as training does (keeps logits' grad real)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), torch.zeros(
        logits.shape[0] * logits.shape[1], dtype=torch.long, device=logits.device))
