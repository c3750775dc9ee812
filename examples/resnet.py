"""A bottleneck ResNet with BatchNorm2d in plain PyTorch, for planning with fsdp-plan.

Laid out like torchvision's ``resnet50`` (``conv1``, ``bn1``, ``layer1``..``layer4`` of
``Bottleneck`` blocks, each block ``conv1/bn1``, ``conv2/bn2``, ``conv3/bn3`` and, first in
a stage, ``downsample.0/1``; then ``fc``). Parameter counts with 1000 classes:

    resnet50   (3, 4, 6, 3)    25,557,032
    resnet101  (3, 4, 23, 3)   44,549,160
    resnet152  (3, 8, 36, 3)   60,192,808

and a ``tiny`` size (width 8, 32px images, stages of 1, 3, 3 and 1 blocks, 10 classes) that
trains on a CPU in milliseconds.

What it exercises: batch norm. Its weights sit beside float32 running statistics, so a
plan that computes in bf16 must keep every ``BatchNorm2d`` in float32 (FSDP1 wraps them
separately without mixed precision by default; FSDP2 needs them as units of their own with
their own ``MixedPrecisionPolicy``), or the first real step fails with ``expected scalar
type BFloat16 but found Float``. And a model with no transformer blocks: the repeated blocks
are the later ``Bottleneck`` of each stage.

The first leaf module is a Conv2d, so this file defines ``example_inputs``: images
``[batch_size, 3, img_size, img_size]``. Its ``seq_len`` argument is IGNORED (the image size
is the model's ``img_size``: 224 for the published sizes, 32 for tiny), so ``--seq-len`` has no
effect on the plan.

    fsdp-plan examples/resnet.py --model-arg size=resnet50 --mem 16GB --world-size 8 --batch-size 64
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(kw_only=True, frozen=True)
class ResNetConfig:
    layers: tuple[int, int, int, int]
    width: int = 64          # channels of the stem and of layer1's bottleneck
    img_size: int = 224
    num_classes: int = 1000
    in_chans: int = 3


SIZES: dict[str, ResNetConfig] = {
    "tiny": ResNetConfig(layers=(1, 3, 3, 1), width=8, img_size=32, num_classes=10),
    "resnet50": ResNetConfig(layers=(3, 4, 6, 3)),
    "resnet101": ResNetConfig(layers=(3, 4, 23, 3)),
    "resnet152": ResNetConfig(layers=(3, 8, 36, 3)),
}

# The config of the model built last, so that example_inputs (which the planner calls with
# only batch_size and seq_len) makes images of the right size.
_last_config: ResNetConfig = SIZES["tiny"]


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (carrying the stride), 1x1 expand (x4), each followed by batch norm."""

    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int = 1) -> None:
        super().__init__()
        out_channels = width * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.downsample = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False),
                nn.BatchNorm2d(out_channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        return F.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, cfg: ResNetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.conv1 = nn.Conv2d(cfg.in_chans, cfg.width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(cfg.width)
        channels = cfg.width
        stages = []
        for i, depth in enumerate(cfg.layers):
            width = cfg.width * 2**i
            blocks = []
            for j in range(depth):
                blocks.append(Bottleneck(channels, width, stride=2 if i > 0 and j == 0 else 1))
                channels = width * Bottleneck.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(channels, cfg.num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn1(self.conv1(images)))
        x = F.max_pool2d(x, 3, stride=2, padding=1)
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def build_model(size: str = "resnet50", **kw) -> ResNet:
    """The ResNet ``size`` (tiny, resnet50, resnet101, resnet152).

    Keyword arguments override fields of the size's :class:`ResNetConfig` (``width=32``,
    ``num_classes=10``; ``layers`` as a comma-separated string such as ``"2,2,2,2"``).
    """
    global _last_config
    if size not in SIZES:
        raise ValueError(f"unknown ResNet size {size!r}; choose one of {', '.join(SIZES)}")
    fields = ResNetConfig.__dataclass_fields__
    unknown = sorted(set(kw) - set(fields))
    if unknown:
        raise ValueError(f"unknown ResNet option(s) {', '.join(unknown)}; "
                         f"valid: size, {', '.join(fields)}")
    values = {}
    for key, value in kw.items():
        if key == "layers":
            parts = tuple(int(v) for v in str(value).split(",")) if isinstance(value, str) \
                else tuple(int(v) for v in value)
            if len(parts) != 4 or min(parts) < 1:
                raise ValueError(f"layers={value!r} must be four block counts of at least 1")
            values[key] = parts
        else:
            values[key] = int(value)
    cfg = replace(SIZES[size], **values)
    _last_config = cfg
    return ResNet(cfg)


def example_inputs(batch_size: int, seq_len: int | None = None,
                   size: str | None = None) -> tuple[torch.Tensor]:
    """Images ``[batch_size, 3, img_size, img_size]``; ``seq_len`` is ignored (see above).

    The image size is that of ``size`` if given, else of the model ``build_model`` built last
    (the planner builds before it asks for inputs). Works on meta and under FakeTensorMode.
    """
    del seq_len  # the image size is the model's
    cfg = SIZES[size] if size is not None else _last_config
    return (torch.randn(batch_size, cfg.in_chans, cfg.img_size, cfg.img_size),)


def loss_fn(logits: torch.Tensor) -> torch.Tensor:
    """Classification cross entropy against a fixed target (keeps the logits' grad real)."""
    return F.cross_entropy(logits.float(), torch.zeros(
        logits.shape[0], dtype=torch.long, device=logits.device))
