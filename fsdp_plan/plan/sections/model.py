"""The plan's ``model`` section: how to rebuild the planned model (SPEC 3), checked and typed.

``ModelRecipe`` is what ``model/source.py`` ``ModelSource.to_plan_dict`` writes plus what the
planner adds after building the model (``params``, ``digest``, ``notes``); a field left out of
the file stays None and is left out again when the plan is written, so a plan reads back as
it was written.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

from fsdp_plan.common.limits import MAX_BATCH_SIZE, MAX_BYTES, MAX_SEQ_LEN, MAX_TOKENS
from fsdp_plan.plan.checker import Checker, field, show

MODEL_KINDS = ("file", "import", "hf-config")
DEFAULT_BATCH_SIZE = 1
DEFAULT_SEQ_LEN = 4096


@dataclass(frozen=True, kw_only=True)
class ModelRecipe:
    """The plan's ``model`` mapping. Its fields, in this order, are the keys a plan may hold."""

    source: str
    """The model file's path, ``package.module:attr``, a config.json or ``torchtitan:NAME``."""
    entry: str | None = None
    """The factory's name in the model file (None: ``build_model``)."""
    args: dict[str, Any] | None = None
    """The factory's keyword arguments (None: none written)."""
    batch_size: int = DEFAULT_BATCH_SIZE
    """Samples in one micro-batch, per rank."""
    seq_len: int = DEFAULT_SEQ_LEN
    kind: str | None = None
    """``file``, ``import`` or ``hf-config`` (None: from the source's form)."""
    params: int | None = None
    """The planned model's parameter count: verify, bench and the policy check it."""
    digest: str | None = None
    """The model code's digest when planned: a changed model is reported."""
    notes: tuple[str, ...] | None = None
    """What the planner noted about the model (heads, blocks it could not analyse...)."""
    grad_accum_steps: int | None = None
    """Read from plans written before accumulation was a top-level field; only 1."""

    def to_dict(self) -> dict[str, Any]:
        """The mapping as written: fields left None are left out."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                out[f.name] = list(value) if f.name == "notes" else value
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelRecipe:
        """The recipe of an already checked mapping (``check_model``), or one the planner
        built (``ModelSource.to_plan_dict``)."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in raw.items() if k in known and v is not None}
        if "notes" in values:
            values["notes"] = tuple(values["notes"])
        return cls(**values)

    def with_notes(self, notes: list[str]) -> ModelRecipe:
        return replace(self, notes=tuple(notes))


MODEL_KEYS = tuple(f.name for f in fields(ModelRecipe))


def _plain_arg(check: Checker, value: Any, path: str) -> Any:
    """A model argument: a scalar, or a list/mapping of them (as ``--model-arg`` and YAML give)."""
    if isinstance(value, float) and not math.isfinite(value):
        raise check.fail(path, f"is {show(value)}", "a model argument is a finite number; quote "
                         "it to pass text")
    if value is None or isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, list):
        return [_plain_arg(check, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {k: _plain_arg(check, v, field(path, k))
                for k, v in check.mapping(value, path, "use names as keys").items()}
    raise check.fail(path, f"is {show(value)}", "model arguments are strings, numbers, booleans, "
                     "null, or lists and mappings of them")


def check_model(check: Checker, value: Any, out: dict) -> ModelRecipe:
    if isinstance(value, ModelRecipe):
        value = value.to_dict()
    fix = ("model records how to rebuild the planned model: {source: path/to/model.py, entry: "
           "build_model, args: {...}, batch_size: 1, seq_len: 4096}")
    model = check.mapping(value, "model", fix)
    check.keys(model, "model", MODEL_KEYS)
    if "source" not in model:
        raise check.fail("model", "has no source", "add source: path/to/model.py (the model "
                         "file the plan was made for), or pass the model as MODEL")
    check.string(model["source"], "model.source", "give the model file's path, e.g. "
                 "examples/llama.py")
    entry = model.get("entry", "build_model")
    if (not isinstance(entry, str) or not entry.isidentifier()
            or entry.startswith("__") and entry.endswith("__")):
        # Dunders name Python's machinery (__class__, __loader__), never a model factory.
        raise check.fail("model.entry", f"is {show(entry)}, not a model factory's name",
                         "name the factory function in the model file, e.g. build_model")
    if "kind" in model and model["kind"] is not None:
        check.choice(model["kind"], "model.kind", MODEL_KINDS,
                     "file for a .py model file, hf-config for a config.json")
    args = check.mapping(model.get("args"), "model.args", "write the factory's keyword "
                         "arguments as a mapping, e.g. args: {size: 70b}", optional=True)
    for key in args:
        if not key.isidentifier():
            raise check.fail(field("model.args", key), "is not a Python keyword-argument name",
                             "use identifiers such as size or n_layers")
    args = _plain_arg(check, args, "model.args")
    batch = check.integer(model.get("batch_size", DEFAULT_BATCH_SIZE), "model.batch_size", 1,
                          MAX_BATCH_SIZE, f"batch_size is the samples in one micro-batch: a "
                          f"whole number from 1 to {MAX_BATCH_SIZE}, e.g. batch_size: 1")
    seq = check.integer(model.get("seq_len", DEFAULT_SEQ_LEN), "model.seq_len", 1, MAX_SEQ_LEN,
                        f"seq_len is the tokens per sample: a whole number from 1 to "
                        f"{MAX_SEQ_LEN}, e.g. seq_len: 4096")
    if batch * seq > MAX_TOKENS:
        raise check.fail("model.batch_size", f"{batch} x model.seq_len {seq} is {batch * seq:,} "
                         f"tokens per micro-batch, more than {MAX_TOKENS:,}",
                         "no GPU holds such a micro-batch; lower batch_size or seq_len")
    if model.get("params") is not None:
        check.integer(model["params"], "model.params", 0, MAX_BYTES,
                      "params is the planned model's parameter count; remove it to skip the check")
    if model.get("digest") is not None:
        check.string(model["digest"], "model.digest", "digest is written by fsdp-plan; remove it "
                     "to skip the model-code check")
    notes = check.sequence(model.get("notes"), "model.notes", "notes is a list of strings",
                           optional=True)
    for i, note in enumerate(notes):
        check.string(note, f"model.notes[{i}]", "notes is a list of strings", allow_empty=True)
    if model.get("grad_accum_steps") not in (None, 1):
        raise check.fail("model.grad_accum_steps", f"is {show(model['grad_accum_steps'])}",
                         "this fsdp-plan cannot apply gradient accumulation yet; remove it or "
                         "set it to 1")
    # absent batch_size and seq_len are the defaults above; every reader may rely on both
    return ModelRecipe.from_dict({**model, "args": args if "args" in model else None,
                                  "batch_size": batch, "seq_len": seq,
                                  "notes": notes if "notes" in model else None})
