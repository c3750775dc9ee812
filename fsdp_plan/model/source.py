"""Where the model comes from: ``ModelSource`` and the ``--model-arg`` parser (no torch import).

A ``ModelSource`` names the model (a file, ``package.module:attr`` or a Hugging Face config),
its keyword arguments and the input shape. It is what the plan file records under ``model``,
so ``verify`` and ``bench`` rebuild exactly the model that was planned. Kept free of torch so
plan files can be read and validated cheaply.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any

import yaml

from fsdp_plan.common.arguments import require_type
from fsdp_plan.common.errors import BadInput
from fsdp_plan.common.limits import MAX_BATCH_SIZE, MAX_SEQ_LEN, MAX_TOKENS  # noqa: F401 - re-exported

KINDS = ("file", "import", "hf-config")


@dataclass(kw_only=True)
class ModelSource:
    """Where the model comes from and how it is fed; serialised into the plan file's ``model`` key."""

    source: str
    """A path to a ``.py`` file, ``package.module:attr``, or a Hugging Face ``config.json``."""
    entry: str = "build_model"
    """The factory's name inside a model file."""
    args: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the factory (``--model-arg k=v``)."""
    batch_size: int = 1
    seq_len: int = 4096
    kind: str = "file"
    """``file``, ``import`` (``package.module:attr``) or ``hf-config``."""

    def __post_init__(self) -> None:
        require_type(self.source, str, "ModelSource.source")  # [Note: API arguments]
        if not self.source:
            raise BadInput("ModelSource.source is empty; give a model file, "
                           "package.module:attr or a Hugging Face config.json.")
        require_type(self.entry, str, "ModelSource.entry")
        if not self.entry.isidentifier():
            raise BadInput(f"ModelSource.entry {self.entry!r} is not a Python function name.")
        require_type(self.args, dict, "ModelSource.args")
        for key in self.args:
            if not isinstance(key, str) or not key.isidentifier():
                raise BadInput(f"ModelSource.args key {key!r} is not a Python identifier (the "
                               "args are the factory's keyword arguments).")
        require_type(self.kind, str, "ModelSource.kind")
        check_count(self.batch_size, "--batch-size", MAX_BATCH_SIZE,
                    "samples in one micro-batch on one GPU")
        check_count(self.seq_len, "--seq-len", MAX_SEQ_LEN, "tokens per sample")
        if self.batch_size * self.seq_len > MAX_TOKENS:
            raise BadInput(f"--batch-size {self.batch_size} x --seq-len {self.seq_len} is "
                           f"{self.batch_size * self.seq_len:,} tokens per micro-batch, more than "
                           f"{MAX_TOKENS:,}; no GPU holds such a micro-batch. Use a smaller "
                           "--batch-size with gradient accumulation.")
        if self.kind not in KINDS:
            raise BadInput(f"model kind {self.kind!r} is not one of {', '.join(KINDS)}.")
        check_text_path(self.source, "MODEL" if self.kind != "hf-config" else "--hf-config")

    def to_plan_dict(self) -> dict[str, Any]:
        """The plan file's ``model`` mapping (without ``params`` and ``digest``, which the
        planner adds after building the model)."""
        return {"source": self.source, "entry": self.entry, "args": dict(self.args),
                "batch_size": self.batch_size, "seq_len": self.seq_len, "kind": self.kind}

    @classmethod
    def from_plan_dict(cls, raw: Any, where: str = "plan") -> ModelSource:
        """Validate a plan file's ``model`` mapping and build the source (extra keys ignored)."""
        if not isinstance(raw, dict):
            raise BadInput(f"{where}: the model key must be a mapping with source, entry, args, "
                           f"batch_size and seq_len; got {type(raw).__name__}.")
        source = raw.get("source")
        if not isinstance(source, str) or not source:
            raise BadInput(f"{where}: model.source must be the model's path or "
                           f"package.module:attr, got {source!r}.")
        entry = raw.get("entry") or "build_model"
        if not isinstance(entry, str) or not entry.isidentifier():
            raise BadInput(f"{where}: model.entry {entry!r} is not a Python function name.")
        args = raw.get("args") or {}
        if not isinstance(args, dict) or not all(isinstance(k, str) and k.isidentifier()
                                                 for k in args):
            raise BadInput(f"{where}: model.args must map Python identifiers to values, "
                           f"got {args!r}.")
        for key, value in args.items():
            _check_scalar(key, value, where=f"{where}: model.args.{key}")
        kind = raw.get("kind") or source_kind(source)
        return cls(source=source, entry=entry, args=dict(args),
                   batch_size=_plan_int(raw.get("batch_size", 1), f"{where}: model.batch_size"),
                   seq_len=_plan_int(raw.get("seq_len", 4096), f"{where}: model.seq_len"),
                   kind=str(kind))


def check_text_path(path: str, flag: str) -> None:
    """A path the plan file records must be text: a name with bytes that are not UTF-8 (an
    argument such as ``$'m\\xff.py'``) reaches Python as lone surrogates, which no YAML, JSON
    or hash of the name can hold (issue 21, S3-24: an internal UnicodeEncodeError)."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError as e:
        shown = repr(os.fsencode(path))[1:] if isinstance(path, str) else repr(path)
        raise BadInput(f"{flag} path {shown} is not valid text: byte(s) in its name are not "
                       "UTF-8, and the plan file records the model's path as text. Rename the "
                       "file (or its folder) to a UTF-8 name.") from e


def check_count(value: Any, flag: str, maximum: int, meaning: str) -> None:
    """``value`` is an int in 1..maximum, else ``BadInput`` naming ``flag`` and the range."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadInput(f"{flag} must be a whole number ({meaning}), got {value!r}.")
    if not 1 <= value <= maximum:
        raise BadInput(f"{flag} {value} is outside 1..{maximum:,} ({meaning}).")


def _plan_int(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadInput(f"{where} must be a whole number, got {value!r}.")
    return value


# Plain YAML 1.1 scalars, as SPEC 1 promises: int, float, bool, null, str. Anything else a
# YAML loader would construct (dates, binary, sets, tagged values) keeps the text the user typed.
_NULLS = ("~", "null", "Null", "NULL")


def parse_model_arg_value(key: str, value: str) -> Any:
    """One ``--model-arg`` value as a YAML scalar: ``4`` -> 4, ``true`` -> True, ``~`` -> None.

    ``KEY=`` is the empty string. Text that YAML would turn into something other than a plain
    scalar (a date, ``!!binary``, any ``!tag``, a list or mapping, several lines) stays the
    exact string typed. ``.nan`` and ``.inf`` are refused: a model size is never infinite, and
    they cannot be written to the plan file and read back equal.
    """
    if not value.strip():
        return value  # KEY= is "", and blanks stay as typed (YAML would read them as null)
    if value.strip() in _NULLS:
        return None
    if "\n" in value or "\r" in value or value.lstrip().startswith(("!", "&", "*")):
        return value
    try:
        parsed = yaml.safe_load(value)
    except yaml.YAMLError:
        return value
    except ValueError as e:  # an integer past Python's int-from-text limit (4,300 digits)
        shown = value if len(value) <= 40 else f"{value[:20]}...{value[-8:]}"
        reason = str(e).split(";")[0]  # without Python's set_int_max_str_digits() hint
        raise BadInput(f"--model-arg {key}={shown} is a number of {len(value.strip()):,} "
                       f"characters, too long for Python to read as an integer ({reason}); no "
                       "model argument is that large. Give a smaller value, or quote it to pass "
                       f"it as text (--model-arg {key}='\"...\"').") from e
    if isinstance(parsed, float) and not math.isfinite(parsed):
        raise BadInput(f"--model-arg {key}={value} reads as {parsed!r}, which is not a usable "
                       "model argument; give a finite number, or quote it as text "
                       f"(--model-arg {key}='\"{value}\"').")
    if isinstance(parsed, int | float) and not isinstance(parsed, bool) and ":" in value:
        return value  # YAML 1.1 sexagesimal: 1:30 would read as 90
    if parsed is None or isinstance(parsed, bool | int | float | str):
        return parsed
    return value


def parse_model_args(pairs: list[str] | None) -> dict[str, Any]:
    """``["size=70b", "n_layers=4"]`` -> ``{"size": "70b", "n_layers": 4}`` (values as YAML scalars)."""
    parsed: dict[str, Any] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise BadInput(
                f"--model-arg {pair!r} is not KEY=VALUE with KEY a Python identifier; "
                "write it like --model-arg size=70b."
            )
        if key in parsed:
            raise BadInput(f"--model-arg {key} is given twice; give each argument once "
                           f"(e.g. --model-arg {pair}).")
        parsed[key] = parse_model_arg_value(key, value)
    return parsed


def _check_scalar(key: str, value: Any, where: str) -> None:
    """A plan file's model argument: a plain scalar, or (hand-written plans) lists and mappings
    of them, as ``plan/check.py`` accepts."""
    if value is None or isinstance(value, bool | int | str):
        return
    if isinstance(value, float) and math.isfinite(value):
        return
    if isinstance(value, list):
        for i, item in enumerate(value):
            _check_scalar(key, item, f"{where}[{i}]")
        return
    if isinstance(value, dict):
        for k, item in value.items():
            _check_scalar(key, item, f"{where}.{k}")
        return
    raise BadInput(f"{where} is {value!r} ({type(value).__name__}); model arguments are plain "
                   "YAML scalars (int, finite float, bool, null or string), or lists and "
                   "mappings of them.")


def source_kind(source: str) -> str:
    """Tell a model file from ``package.module:attr`` and from a Hugging Face config."""
    if source.endswith(".json"):
        return "hf-config"
    if source.endswith(".py") or os.sep in source or not _looks_importable(source):
        return "file"
    return "import"


TORCHTITAN_SHORTHAND = "torchtitan:"
TORCHTITAN_ENTRY = "fsdp_plan.model.torchtitan_models:build_model"
"""``torchtitan:NAME:FLAVOR`` names ``TORCHTITAN_ENTRY`` with ``name=NAME, flavor=FLAVOR``
(model/torchtitan_models.py); the plan file records the entry and its arguments."""


def torchtitan_shorthand(model: str | None) -> dict[str, str] | None:
    """``torchtitan:NAME:FLAVOR`` as ``{"name": NAME, "flavor": FLAVOR}``; None for any other
    MODEL."""
    if not model or not model.startswith(TORCHTITAN_SHORTHAND):
        return None
    name, _, flavor = model[len(TORCHTITAN_SHORTHAND):].partition(":")
    if not name.isidentifier() or not flavor or ":" in flavor:
        raise BadInput(f"MODEL {model!r}: write torchtitan:NAME:FLAVOR, e.g. "
                       "torchtitan:llama3:debugmodel (NAME and FLAVOR as torchtitan's model "
                       "registry names them).")
    return {"name": name, "flavor": flavor}


def model_input_files(model: str | None, hf_config: str | None) -> list[tuple[str, str]]:
    """``(flag, path)`` of the files the model is read from, for ``outputs.check_outputs``.

    For ``package.module:attr`` the module's file is found on ``sys.path`` without importing
    anything (importing runs user code, which must wait until every input is checked)."""
    files: list[tuple[str, str]] = []
    if hf_config:
        files.append(("--hf-config", hf_config))
    if torchtitan_shorthand(model):
        model = TORCHTITAN_ENTRY
    if model:
        if source_kind(model) == "import":
            found = _module_file(model.partition(":")[0])
            if found:
                files.append((f"module of MODEL {model}", found))
        else:
            files.append(("MODEL", model))
    return files


def _module_file(module: str) -> str | None:
    parts = module.split(".")
    for entry in sys.path:
        base = os.path.join(entry or os.getcwd(), *parts)
        for candidate in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(candidate):
                return candidate
    return None


def _looks_importable(source: str) -> bool:
    module, _, attr = source.partition(":")
    return bool(attr) and all(part.isidentifier() for part in module.split(".")) and attr.isidentifier()


def source_digest(source: ModelSource) -> str:
    """A short hash of the model's code (the file's bytes, or the import path) and its arguments."""
    h = hashlib.sha256()
    if source.kind in ("file", "hf-config") and os.path.isfile(source.source):
        with open(source.source, "rb") as f:
            h.update(f.read())
    else:
        h.update(source.source.encode())
    h.update(json.dumps(source.args, sort_keys=True, default=str).encode())
    h.update(source.entry.encode())
    return h.hexdigest()[:16]
