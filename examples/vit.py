"""A Vision Transformer (ViT) in plain PyTorch, for planning with fsdp-plan.

A Conv2d patch embedding, a class token and a learned position embedding held as
parameters directly on the ROOT module (so they can only live in the root FSDP unit),
``blocks.N`` pre-norm transformer blocks with attention through
``F.scaled_dot_product_attention`` (no dropout, so CPU and GPU attention keep the same
state), a final ``norm`` and a classification ``head``. Laid out like timm's
``VisionTransformer`` (``patch_embed.proj``, ``cls_token``, ``pos_embed``, ``blocks.N``,
``norm``, ``head``). Parameter counts with 1000 classes:

    base  (ViT-B/16, 224px)   86,567,656
    large (ViT-L/16, 224px)  304,326,632
    huge  (ViT-H/14, 224px)  632,045,800

and a ``tiny`` size (32px images, 8px patches) that trains on a CPU in milliseconds.

The first leaf module is a Conv2d, not an Embedding, so this file must (and does) define
``example_inputs``; it returns images ``[batch_size, 3, img_size, img_size]``. Its
``seq_len`` argument is IGNORED: the sequence length of a ViT is fixed by the image and
patch size ((img_size / patch_size)^2 + 1 tokens: 197 for base, 257 for huge), so
``--seq-len`` has no effect on the plan.

    fsdp-plan examples/vit.py --model-arg size=huge --mem 40GB --world-size 8 --batch-size 64
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(kw_only=True, frozen=True)
class ViTConfig:
    img_size: int
    patch_size: int
    dim: int
    depth: int
    n_heads: int
    mlp_dim: int
    num_classes: int = 1000
    in_chans: int = 3
    norm_eps: float = 1e-6


SIZES: dict[str, ViTConfig] = {
    "tiny": ViTConfig(img_size=32, patch_size=8, dim=64, depth=4, n_heads=4, mlp_dim=256,
                      num_classes=10),
    "base": ViTConfig(img_size=224, patch_size=16, dim=768, depth=12, n_heads=12, mlp_dim=3072),
    "large": ViTConfig(img_size=224, patch_size=16, dim=1024, depth=24, n_heads=16,
                       mlp_dim=4096),
    "huge": ViTConfig(img_size=224, patch_size=14, dim=1280, depth=32, n_heads=16, mlp_dim=5120),
}

# The config of the model built last, so that example_inputs (which the planner calls with
# only batch_size and seq_len) makes images of the right size.
_last_config: ViTConfig = SIZES["tiny"]


class PatchEmbed(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.proj = nn.Conv2d(cfg.in_chans, cfg.dim, kernel_size=cfg.patch_size,
                              stride=cfg.patch_size)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.proj(images).flatten(2).transpose(1, 2)  # [batch, patches, dim]


class Attention(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seq_len, dim = x.shape
        qkv = self.qkv(x).view(bsz, seq_len, 3, self.n_heads, dim // self.n_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [batch, heads, seq, head_dim]
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0)
        return self.proj(out.transpose(1, 2).reshape(bsz, seq_len, dim))


class MLP(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.dim, cfg.mlp_dim)
        self.fc2 = nn.Linear(cfg.mlp_dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.norm2 = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class VisionTransformer(nn.Module):
    def __init__(self, cfg: ViTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        n_patches = (cfg.img_size // cfg.patch_size) ** 2
        self.patch_embed = PatchEmbed(cfg)
        # Parameters directly on the root module, not inside any child.
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, n_patches + 1, cfg.dim))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.depth))
        self.norm = nn.LayerNorm(cfg.dim, eps=cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.num_classes)
        # normal_ is not data-dependent (unlike trunc_normal_ under FakeTensorMode).
        nn.init.normal_(self.cls_token, std=0.02)
        nn.init.normal_(self.pos_embed, std=0.02)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(images)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat((cls, x), dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])  # classify from the class token


def build_model(size: str = "tiny", **kw) -> VisionTransformer:
    """The ViT shape ``size`` (tiny, base, large, huge).

    Keyword arguments override fields of the size's :class:`ViTConfig`, e.g. ``depth=2`` or
    ``num_classes=21843``.
    """
    global _last_config
    if size not in SIZES:
        raise ValueError(f"unknown ViT size {size!r}; choose one of {', '.join(SIZES)}")
    fields = ViTConfig.__dataclass_fields__
    unknown = sorted(set(kw) - set(fields))
    if unknown:
        raise ValueError(f"unknown ViT option(s) {', '.join(unknown)}; "
                         f"valid: size, {', '.join(fields)}")
    cfg = replace(SIZES[size], **{k: type(getattr(SIZES[size], k))(v) for k, v in kw.items()})
    if cfg.img_size % cfg.patch_size:
        raise ValueError(f"img_size={cfg.img_size} is not a multiple of "
                         f"patch_size={cfg.patch_size}")
    if cfg.dim % cfg.n_heads:
        raise ValueError(f"dim={cfg.dim} is not divisible by n_heads={cfg.n_heads}")
    _last_config = cfg
    return VisionTransformer(cfg)


def example_inputs(batch_size: int, seq_len: int | None = None,
                   size: str | None = None) -> tuple[torch.Tensor]:
    """Images ``[batch_size, 3, img_size, img_size]``; ``seq_len`` is ignored (see above).

    The image size is that of ``size`` if given, else of the model ``build_model`` built last
    (the planner builds before it asks for inputs). Works on meta and under FakeTensorMode.
    """
    del seq_len  # a ViT's sequence length is fixed by img_size and patch_size
    cfg = SIZES[size] if size is not None else _last_config
    return (torch.randn(batch_size, cfg.in_chans, cfg.img_size, cfg.img_size),)


def loss_fn(logits: torch.Tensor) -> torch.Tensor:
    """Classification cross entropy against a fixed target (keeps the logits' grad real)."""
    return F.cross_entropy(logits.float(), torch.zeros(
        logits.shape[0], dtype=torch.long, device=logits.device))
