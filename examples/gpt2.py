"""A GPT-2-style decoder in plain PyTorch, for planning with fsdp-plan.

Learned token and position embeddings, pre-norm blocks with LayerNorm, fused-QKV causal
attention through ``F.scaled_dot_product_attention`` and a GELU MLP, laid out like the
Hugging Face checkpoint (``wte``, ``wpe``, ``h.N``, ``ln_f``, ``lm_head``). The output head
is TIED to the input embedding (``lm_head.weight is wte.weight``), which is what this example
exercises: a planner must keep both uses of that one parameter in the same FSDP unit (or
the root) and count its bytes once. ``build_model(size=...)`` gives the published shapes;
parameter counts (tied head counted once) match the released checkpoints:

    small / 124m  124,439,808     medium  354,823,168
    large         774,030,080     xl      1,557,611,200

and a ``tiny`` size that trains on a CPU in milliseconds.

There is no dropout anywhere, attention included: with ``dropout_p > 0`` CPU attention falls
back to the math kernel and keeps the whole attention matrix, which GPU flash attention does
not, so a CPU measurement would overstate the GPU peak (see TORCH_NOTES). GPT-2 has
``n_positions`` = 1024, so plan with ``--seq-len`` at most 1024:

    fsdp-plan examples/gpt2.py --model-arg size=xl --mem 80GB --world-size 8 --seq-len 1024
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(kw_only=True, frozen=True)
class GPT2Config:
    n_layer: int
    n_embd: int
    n_head: int
    vocab_size: int = 50257
    n_positions: int = 1024
    layer_norm_epsilon: float = 1e-5
    initializer_range: float = 0.02


SIZES: dict[str, GPT2Config] = {
    "tiny": GPT2Config(n_layer=4, n_embd=64, n_head=4, vocab_size=512, n_positions=256),
    "small": GPT2Config(n_layer=12, n_embd=768, n_head=12),
    "124m": GPT2Config(n_layer=12, n_embd=768, n_head=12),
    "medium": GPT2Config(n_layer=24, n_embd=1024, n_head=16),
    "large": GPT2Config(n_layer=36, n_embd=1280, n_head=20),
    "xl": GPT2Config(n_layer=48, n_embd=1600, n_head=25),
}

# The config of the model built last, so that example_inputs (which the planner calls with
# only batch_size and seq_len) draws token ids from the right vocabulary.
_last_config: GPT2Config = SIZES["tiny"]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq_len, dim = x.shape
        q, k, v = self.c_attn(x).split(dim, dim=2)
        q, k, v = (t.view(bsz, seq_len, self.n_head, dim // self.n_head).transpose(1, 2)
                   for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=True)
        return self.c_proj(out.transpose(1, 2).reshape(bsz, seq_len, dim))


class MLP(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(nn.Module):
    def __init__(self, cfg: GPT2Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.h = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        self.lm_head.weight = self.wte.weight  # tied: one Parameter, two modules

    def _init_weights(self, module: nn.Module) -> None:
        # GPT-2's N(0, 0.02) init; normal_/zeros_ are not data-dependent, so they run on meta.
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=self.cfg.initializer_range)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq_len = tokens.shape[1]
        if seq_len > self.cfg.n_positions:
            raise ValueError(
                f"GPT-2 has n_positions={self.cfg.n_positions}; got a sequence of {seq_len} "
                f"tokens (plan with --seq-len {self.cfg.n_positions} or less)"
            )
        pos = torch.arange(seq_len, device=tokens.device)
        h = self.wte(tokens) + self.wpe(pos)[None]
        for block in self.h:
            h = block(h)
        return self.lm_head(self.ln_f(h))


def build_model(size: str = "tiny", **kw) -> GPT2:
    """The GPT-2 shape ``size`` (tiny, small/124m, medium, large, xl).

    Keyword arguments override fields of the size's :class:`GPT2Config`, e.g. ``n_layer=2``.
    """
    global _last_config
    if size not in SIZES:
        raise ValueError(f"unknown GPT-2 size {size!r}; choose one of {', '.join(SIZES)}")
    fields = GPT2Config.__dataclass_fields__
    unknown = sorted(set(kw) - set(fields))
    if unknown:
        raise ValueError(f"unknown GPT-2 option(s) {', '.join(unknown)}; "
                         f"valid: size, {', '.join(fields)}")
    cfg = replace(SIZES[size], **{k: type(getattr(SIZES[size], k))(v) for k, v in kw.items()})
    if cfg.n_embd % cfg.n_head:
        raise ValueError(f"n_embd={cfg.n_embd} is not divisible by n_head={cfg.n_head}")
    _last_config = cfg
    return GPT2(cfg)


def example_inputs(batch_size: int, seq_len: int, size: str | None = None) -> tuple[torch.Tensor]:
    """Token ids ``[batch_size, seq_len]`` over the whole vocabulary.

    The vocabulary is that of ``size`` if given, else of the model ``build_model`` built last
    (the planner builds before it asks for inputs). Works on meta and under FakeTensorMode.
    """
    cfg = SIZES[size] if size is not None else _last_config
    if seq_len > cfg.n_positions:
        raise ValueError(f"GPT-2 has n_positions={cfg.n_positions}; --seq-len {seq_len} is "
                         f"longer (use {cfg.n_positions} or less)")
    return (torch.randint(0, cfg.vocab_size, (batch_size, seq_len)),)


def loss_fn(logits: torch.Tensor) -> torch.Tensor:
    """Next-token cross entropy against a fixed target (keeps the logits' grad real)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), torch.zeros(
        logits.shape[0] * logits.shape[1], dtype=torch.long, device=logits.device))
