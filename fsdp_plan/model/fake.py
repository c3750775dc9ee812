"""Give a meta-device model fake storage, so it can run forward/backward with no real memory.

Building directly under ``FakeTensorMode`` fails for data-dependent init
(``nn.init.trunc_normal_``), so models are built on ``meta`` and then every parameter and
buffer is replaced by an empty fake tensor of the same shape and dtype. Shared (tied)
parameters stay shared: FSDP requires them in one unit and the analysis must count them once.
"""

from __future__ import annotations

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode


def new_fake_mode() -> FakeTensorMode:
    """A fake mode that also accepts real (e.g. meta-built CPU constant) tensors as inputs."""
    return FakeTensorMode(allow_non_fake_inputs=True)


def materialize_fake(model: nn.Module, fake_mode: FakeTensorMode,
                     device: torch.device | str = "cpu") -> nn.Module:
    """Replace every parameter and buffer of ``model`` in place by a fake tensor on ``device``."""
    memo: dict[int, torch.Tensor] = {}
    with fake_mode:
        for module in model.modules():
            for name, param in list(module._parameters.items()):
                if param is None:
                    continue
                if id(param) not in memo:
                    memo[id(param)] = nn.Parameter(
                        torch.empty(param.shape, dtype=param.dtype, device=device),
                        requires_grad=param.requires_grad,
                    )
                module._parameters[name] = memo[id(param)]
            for name, buf in list(module._buffers.items()):
                if buf is None:
                    continue
                if id(buf) not in memo:
                    memo[id(buf)] = torch.empty(buf.shape, dtype=buf.dtype, device=device)
                module._buffers[name] = memo[id(buf)]
    return model
