"""Load the user's model per SPEC section 1: build it on ``meta``, make its inputs, turn output into a loss.

A ``ModelSource`` names where the model comes from (a file, ``package.module:attr`` or a
Hugging Face config) with its keyword arguments and input shape; it is what the plan file
records, so ``verify`` and ``bench`` rebuild exactly the model that was planned.
Every failure becomes a ``BadInput`` whose message names the problem and the fix.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
import traceback
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from fsdp_plan.errors import BadInput
from fsdp_plan.source import (  # noqa: F401  (re-exported: callers import these from load)
    ModelSource,
    parse_model_args,
    source_digest,
    source_kind,
)


@dataclass
class LoadedModel:
    """A model built on ``meta`` plus the user's input and loss hooks."""

    source: ModelSource
    model: nn.Module
    make_inputs: Callable[[int, int], tuple[tuple[Any, ...], dict[str, Any]]]
    compute_loss: Callable[[Any], torch.Tensor]
    factory: Callable[..., nn.Module]
    notes: list[str] = field(default_factory=list)
    """Assumptions the planner made to build or trace the model (stated in the report and plan)."""


def _user_frame_hint(error: BaseException, path: str | None) -> str:
    """The line of the user's file where ``error`` came from, for a one-paragraph message."""
    if isinstance(error, SyntaxError):
        line = (error.text or "").strip()
        return f" (line {error.lineno}: {line!r})" if error.lineno else ""
    frames = traceback.extract_tb(error.__traceback__)
    if path:
        real = os.path.realpath(path)
        frames = [f for f in frames if os.path.realpath(f.filename) == real] or frames
    if not frames:
        return ""
    last = frames[-1]
    return f" (at {os.path.basename(last.filename)} line {last.lineno}: {(last.line or '').strip()!r})"


def import_model_file(path: str) -> types.ModuleType:
    """Import the user's model file under a private module name."""
    if not os.path.exists(path):
        raise BadInput(f"model file {path!r} does not exist; pass the path to a .py file that "
                       "defines build_model(**kwargs).")
    if not os.path.isfile(path) or not os.access(path, os.R_OK):
        raise BadInput(f"model file {path!r} is not a readable file.")
    name = "fsdp_plan_user_model_" + hashlib.sha1(os.path.realpath(path).encode()).hexdigest()[:10]
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise BadInput(f"model file {path!r} cannot be imported as Python; it must be a .py file.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    folder = os.path.dirname(os.path.abspath(path))
    added = folder not in sys.path
    if added:
        sys.path.insert(0, folder)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        sys.modules.pop(name, None)
        raise BadInput(f"model file {path!r} has a syntax error: {e.msg}{_user_frame_hint(e, path)}. "
                       "Fix the file and run again.") from e
    except Exception as e:  # the user's module-level code can raise anything
        sys.modules.pop(name, None)
        raise BadInput(f"importing model file {path!r} failed with {type(e).__name__}: {e}"
                       f"{_user_frame_hint(e, path)}. Fix the file (or install what it imports) "
                       "and run again.") from e
    finally:
        if added and folder in sys.path:
            sys.path.remove(folder)
    return module


def _resolve_factory(source: ModelSource) -> tuple[Callable[..., nn.Module], types.ModuleType | None]:
    if source.kind == "import":
        module_name, _, attr = source.source.partition(":")
        try:
            module = importlib.import_module(module_name)
        except Exception as e:
            raise BadInput(f"cannot import {module_name!r} for model {source.source!r}: "
                           f"{type(e).__name__}: {e}. Check the package is installed and on PYTHONPATH.") from e
        factory = getattr(module, attr, None)
        if factory is None or not callable(factory):
            raise BadInput(f"{module_name!r} has no callable {attr!r}; MODEL must be "
                           "package.module:factory where factory(**kwargs) returns an nn.Module.")
        return factory, module
    module = import_model_file(source.source)
    factory = getattr(module, source.entry, None)
    if factory is None or not callable(factory):
        raise BadInput(f"model file {source.source!r} defines no function {source.entry!r}; add "
                       f"`def {source.entry}(**kwargs) -> nn.Module` or name yours with --entry.")
    return factory, module


_META_HINTS = (
    "The planner builds the model under torch.device('meta'), where tensors have no values: "
    "avoid .item(), .tolist(), data-dependent control flow and loading weights in the constructor "
    "(load them after sharding instead)."
)


def build_on_meta(factory: Callable[..., nn.Module], source: ModelSource) -> nn.Module:
    """Call the factory under ``torch.device('meta')`` and check it returned an ``nn.Module``."""
    try:
        with torch.device("meta"):
            model = factory(**source.args)
    except TypeError as e:
        raise BadInput(f"{source.entry}({_fmt_args(source.args)}) failed: {e}. Check the "
                       "--model-arg names against the factory's parameters.") from e
    except BadInput:
        raise
    except Exception as e:
        meta_related = "meta" in str(e).lower() or "item" in str(e).lower() or isinstance(
            e, (NotImplementedError, RuntimeError))
        hint = " " + _META_HINTS if meta_related else ""
        if isinstance(e, OSError):
            hint = (" The constructor reads a file, but the planner needs only shapes: load "
                    "weights after building (in the training script, after sharding), or skip "
                    "the load when parameters are on the meta device (if "
                    "next(self.parameters()).device.type != 'meta').")
        raise BadInput(f"building the model with {source.entry}({_fmt_args(source.args)}) raised "
                       f"{type(e).__name__}: {e}{_user_frame_hint(e, _file_of(source))}.{hint}") from e
    if not isinstance(model, nn.Module):
        raise BadInput(f"{source.entry}(...) returned {type(model).__name__}, not a torch.nn.Module.")
    return model


def _file_of(source: ModelSource) -> str | None:
    return source.source if source.kind == "file" else None


def _fmt_args(args: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in args.items())


def _first_leaf(model: nn.Module) -> nn.Module | None:
    for module in model.modules():
        if not list(module.children()) and (list(module.parameters(recurse=False))
                                            or isinstance(module, nn.Embedding)):
            return module
    return None


def _default_inputs_for(model: nn.Module, source: ModelSource):
    from fsdp_plan.hf import hf_default_inputs, is_hf_model
    if is_hf_model(model):
        return hf_default_inputs(model, source.source)
    leaf = _first_leaf(model)
    if not isinstance(leaf, nn.Embedding):
        kind = type(leaf).__name__ if leaf is not None else "no parameterised layer"
        raise BadInput(f"model {source.source!r} has no example_inputs(batch_size, seq_len) and its "
                       f"first layer is {kind}, not an nn.Embedding, so the planner cannot guess its "
                       "inputs; define example_inputs(batch_size, seq_len) returning a tuple of "
                       "tensors (or a dict of keyword inputs) for one micro-batch.")
    vocab = leaf.num_embeddings

    def make(batch_size: int, seq_len: int):
        return (torch.randint(0, vocab, (batch_size, seq_len)),), {}
    return make


def _wrap_example_inputs(fn: Callable[..., Any], source: ModelSource):
    def make(batch_size: int, seq_len: int):
        try:
            value = fn(batch_size, seq_len)
        except Exception as e:
            raise BadInput(f"example_inputs({batch_size}, {seq_len}) in {source.source!r} raised "
                           f"{type(e).__name__}: {e}{_user_frame_hint(e, _file_of(source))}.") from e
        if isinstance(value, dict):
            return (), dict(value)
        if isinstance(value, torch.Tensor):
            return (value,), {}
        if isinstance(value, (tuple, list)):
            return tuple(value), {}
        raise BadInput(f"example_inputs must return a tuple of tensors or a dict of keyword inputs, "
                       f"got {type(value).__name__}.")
    return make


def default_loss(output: Any) -> torch.Tensor:
    """SPEC 1: a tensor is summed; a tuple uses its first item; a dict/ModelOutput uses loss, else logits."""
    if isinstance(output, torch.Tensor):
        return output.sum() if output.dim() else output
    if isinstance(output, dict) or hasattr(output, "keys"):
        for key in ("loss", "logits"):
            value = output.get(key) if hasattr(output, "get") else None
            if isinstance(value, torch.Tensor):
                return default_loss(value)
        first = next(iter(output.values()), None) if hasattr(output, "values") else None
        if isinstance(first, torch.Tensor):
            return default_loss(first)
    if isinstance(output, (tuple, list)) and output:
        return default_loss(output[0])
    raise BadInput(f"cannot turn the model output ({type(output).__name__}) into a scalar loss; "
                   "define loss_fn(output) in the model file.")


def load_model(source: ModelSource) -> LoadedModel:
    """Build the model on ``meta`` and resolve its inputs and loss, per SPEC section 1."""
    if source.kind == "hf-config":
        from fsdp_plan.hf import hf_factory
        factory, user_module = hf_factory(source.source), None
    else:
        factory, user_module = _resolve_factory(source)
    model = build_on_meta(factory, source)
    notes = list(getattr(factory, "fsdp_plan_notes", None) or [])
    user_inputs = getattr(user_module, "example_inputs", None) if user_module else None
    user_loss = getattr(user_module, "loss_fn", None) if user_module else None
    make_inputs = (_wrap_example_inputs(user_inputs, source) if callable(user_inputs)
                   else _default_inputs_for(model, source))
    compute_loss = user_loss if callable(user_loss) else default_loss
    return LoadedModel(source=source, model=model, make_inputs=make_inputs,
                       compute_loss=compute_loss, factory=factory, notes=notes)


def rebuild_meta(loaded: LoadedModel) -> nn.Module:
    """A fresh meta copy of the same model (verify and the analysis each consume one)."""
    return build_on_meta(loaded.factory, loaded.source)
