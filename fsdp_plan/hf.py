"""Build a Hugging Face ``transformers`` model from a ``config.json`` with no download (optional extra)."""

from __future__ import annotations

import json
import os
from typing import Callable

from torch import nn

from fsdp_plan.errors import BadInput


def hf_factory(config_path: str) -> Callable[..., nn.Module]:
    """A factory that builds the config's architecture (``architectures[0]``) from the config alone.

    Keyword arguments override config fields (``--model-arg num_hidden_layers=4``).
    """
    try:
        import transformers
    except ImportError as e:
        raise BadInput("--hf-config needs the optional Hugging Face extra: "
                       "pip install 'fsdp-plan[hf]' (transformers).") from e
    if not os.path.isfile(config_path):
        raise BadInput(f"Hugging Face config {config_path!r} does not exist.")
    try:
        with open(config_path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise BadInput(f"Hugging Face config {config_path!r} is not readable JSON: {e}.") from e
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise BadInput(f"Hugging Face config {config_path!r} has no 'model_type'; it must be a "
                       "transformers config.json.")

    def build(**overrides) -> nn.Module:
        fields = {**raw, **overrides}
        model_type = fields.pop("model_type")
        try:
            config = transformers.AutoConfig.for_model(model_type, **fields)
        except (ValueError, KeyError) as e:
            raise BadInput(f"transformers does not know model_type {model_type!r}: {e}.") from e
        arch = (getattr(config, "architectures", None) or [None])[0]
        cls = getattr(transformers, arch, None) if arch else None
        if cls is None:
            cls = transformers.AutoModelForCausalLM if arch is None or "CausalLM" in arch \
                else transformers.AutoModel
            return cls.from_config(config)
        return cls(config)

    return build
