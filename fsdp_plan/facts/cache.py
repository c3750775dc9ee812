"""Facts kept on disk, so a second plan of the same model (another budget, world size, GPU)
runs no tracing.

[Note: the facts cache]
``ModelFacts`` (facts/types.py) are plain data and depend only on the model and how it was
traced, never on the budget, the world size or the GPU. So the plan verb stores them, and so do
``predict``, ``verify`` and ``tune`` for the plan they read (api.py ``analyze_for_plan``, keyed by
the plan's own analysis options: its precision, selective stride and compiled blocks; ``predict``
and ``trace --plan`` then read the plan against the kept outline and build no model,
``facts_for_plan``),
one JSON file per key, under ``$FSDP_PLAN_CACHE_DIR``, else ``$XDG_CACHE_HOME/fsdp-plan/facts``, else
``~/.cache/fsdp-plan/facts``. The key is a SHA-256 over everything the facts are made from:
the model's kind, path, entry and arguments, the micro-batch shape, the analysis options
(dtypes, autocast, compiled blocks, strides, ``--exact-analysis``; whether DDP's autocast step
was traced depends on the budget, so it is recorded in the entry instead: an entry with the
step serves every budget, read without it where tracing would leave it out, and is never
replaced by one without it; an entry without it serves only budgets that leave it out), the
bytes of the model's file and of every ``.py`` file beside it (local imports), the versions of
torch and transformers, and the code of fsdp-plan's stages that build and trace a model
(``facts/``, ``model/``, ``common/``). An entry is read only when its format and stored key
match and it parses into ``ModelFacts``; anything else (a truncated, corrupt or foreign file)
is ignored and replaced, never trusted. Beside the facts, each model built for a plan or an
export leaves its outline (``ModelOutline``: the module tree, classes and parameter count) in
``<key>.outline.json``, keyed the same way without the batch shape and analysis options (the
model is built from its arguments alone); ``export`` reads a plan against it and imports no
torch. Entries are written to a temporary file and renamed over the old one, so a reader never
sees half an entry; a cache that cannot be written (a read-only home) only costs the tracing
(or the model's build) next time.

Known limitations: code the model imports from outside its own folder (an installed package
other than torch and transformers) is not part of the key; ``--no-cache`` (or
``FSDP_PLAN_NO_CACHE=1``) traces afresh. ``package.module:attr`` models are keyed by their
module file's folder when it is found on ``sys.path``, and are not cached otherwise.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.metadata
import json
import os
import tempfile
from dataclasses import dataclass
from typing import Any

from fsdp_plan.common.collector import cycle_collector_paused
from fsdp_plan.facts.types import ModelFacts, ModelOutline
from fsdp_plan.model.source import ModelSource, _module_file

FORMAT = 3
"""The entry layout (2: timelines' events as columns, ``ModelFacts.to_dict(columns=True)``;
3: their op counters as indices into a table of the distinct ones); an entry of another
format is ignored."""
DIR_ENV = "FSDP_PLAN_CACHE_DIR"
OFF_ENV = "FSDP_PLAN_NO_CACHE"
"""Set to anything but ``""``/``0`` to plan without the cache (tests/conftest.py does)."""
_OWN_CODE = ("facts", "model", "common")
"""fsdp-plan's folders whose code decides what the facts hold."""


def cache_dir() -> str | None:
    """Where entries live, or None when the cache is switched off (``FSDP_PLAN_NO_CACHE``)."""
    if os.environ.get(OFF_ENV, "") not in ("", "0"):
        return None
    if os.environ.get(DIR_ENV):
        return os.environ[DIR_ENV]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fsdp-plan", "facts")


@dataclass(kw_only=True)
class CachedFacts:
    """What an entry gives back: the facts and what planning records of the model."""

    facts: ModelFacts
    digest: str
    notes: list[str]
    path: str


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "-"


def _hash_files(h: Any, paths: list[str]) -> None:
    for path in sorted(paths):
        h.update(path.encode())
        with open(path, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())


def _python_files(folder: str) -> list[str]:
    return [os.path.join(folder, n) for n in os.listdir(folder) if n.endswith(".py")]


_OWN_DIGEST: list[str] = []


def _own_code_digest() -> str:
    """SHA-256 of fsdp-plan's model-building and tracing code (computed once per process)."""
    if not _OWN_DIGEST:
        h = hashlib.sha256()
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        for folder in _OWN_CODE:
            for here, _, names in sorted(os.walk(os.path.join(root, folder))):
                _hash_files(h, [os.path.join(here, n) for n in names if n.endswith(".py")])
        _OWN_DIGEST.append(h.hexdigest())
    return _OWN_DIGEST[0]


def facts_key(source: ModelSource, options: dict[str, Any]) -> str | None:
    """The entry's key ([Note: the facts cache]); None when the model's code cannot be read."""
    return _key(source, {"batch_size": source.batch_size, "seq_len": source.seq_len,
                         "options": _key_options(options)})


def outline_key(source: ModelSource) -> str | None:
    """The key of the model's outline entry: what builds the model, not how it is traced (the
    model is built from its arguments alone, never from the batch shape)."""
    return _key(source, {"outline": True})


def _key(source: ModelSource, traced: dict[str, Any]) -> str | None:
    """SHA-256 over the model's recipe, code and versions and ``traced``; None when the
    model's code cannot be read."""
    try:
        if source.kind == "import":
            found = _module_file(source.source.partition(":")[0])
            if found is None:
                return None
            model_file = found
        else:
            model_file = source.source
        if not os.path.isfile(model_file):
            return None
        h = hashlib.sha256()
        h.update(json.dumps({"format": FORMAT, "kind": source.kind,
                             "source": os.path.abspath(source.source), "entry": source.entry,
                             "args": source.args, **traced, "torch": _version("torch"),
                             "transformers": _version("transformers"),
                             "fsdp_plan": _own_code_digest()},
                            sort_keys=True, default=str).encode())
        folder = os.path.dirname(os.path.abspath(model_file))
        _hash_files(h, sorted({os.path.abspath(model_file), *_python_files(folder)}))
        return h.hexdigest()
    except (OSError, ValueError, TypeError):
        return None


def _key_options(options: dict[str, Any]) -> dict[str, Any]:
    """The analysis options as the key holds them: DDP's limit only decides whether the step
    is also traced under autocast (``analyze_loaded``), which the entry records instead, so
    another budget finds the same entry."""
    out = dict(options)
    out["ddp_limit_bytes"] = out.get("ddp_limit_bytes") is not None
    return out


def _ddp_autocast(options: dict[str, Any], facts: ModelFacts) -> bool:
    """Whether ``analyze_loaded`` traces DDP's autocast step for these options (its rule)."""
    limit = options.get("ddp_limit_bytes")
    return limit is not None and 2 * facts.graph.total_param_bytes <= limit


class FactsCache:
    """Read and write entries in ``folder`` (``cache_dir()``)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    @classmethod
    def default(cls) -> FactsCache | None:
        """The cache at ``cache_dir()``, or None when switched off."""
        folder = cache_dir()
        return cls(folder) if folder else None

    def _path(self, key: str) -> str:
        return os.path.join(self.folder, f"{key}.json")

    def _outline_path(self, key: str) -> str:
        return os.path.join(self.folder, f"{key}.outline.json")

    def has(self, source: ModelSource, options: dict[str, Any]) -> bool:
        """Whether a readable entry exists for the model (without parsing it)."""
        key = facts_key(source, options)
        return key is not None and os.path.isfile(self._path(key))

    def has_outline(self, source: ModelSource) -> bool:
        """Whether an outline entry exists for the model (without parsing it)."""
        key = outline_key(source)
        return key is not None and os.path.isfile(self._outline_path(key))

    @staticmethod
    def _trusted(path: str, key: str) -> dict[str, Any] | None:
        """The entry at ``path`` when it parses and holds this format and ``key``; None
        otherwise (missing, corrupt or foreign: never trusted). Raises nothing."""
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
        except Exception:  # noqa: BLE001 - unreadable, not JSON, not text
            return None
        ok = isinstance(raw, dict) and raw.get("format") == FORMAT and raw.get("key") == key
        return raw if ok else None

    def load(self, source: ModelSource, options: dict[str, Any]) -> CachedFacts | None:
        """The entry for ``source`` traced with ``options``; None when there is none or it
        cannot be trusted (wrong format or key, unreadable, not facts)."""
        key = facts_key(source, options)
        if key is None:
            return None
        path = self._path(key)
        raw = self._trusted(path, key)
        if raw is None:
            return None
        try:
            digest, notes = raw["digest"], raw["notes"]
            if not isinstance(digest, str) or not all(isinstance(n, str) for n in notes):
                return None
            facts = ModelFacts.from_dict(raw["facts"])
            traced, wanted = raw.get("ddp_autocast"), _ddp_autocast(options, facts)
            if not isinstance(traced, bool) or (wanted and not traced):
                return None  # this budget needs DDP's autocast step, the entry lacks it
            if traced and not wanted:  # what tracing at this budget gives: the step left out
                facts = dataclasses.replace(facts, analysis=dataclasses.replace(
                    facts.analysis, ddp_analysis=None))
            return CachedFacts(facts=facts, digest=digest, notes=list(notes), path=path)
        except Exception:  # noqa: BLE001 - a corrupt or foreign entry is ignored, never trusted
            return None

    def _holds_ddp_step(self, key: str) -> bool:
        """Whether the entry at ``key`` is readable and holds DDP's autocast step."""
        raw = self._trusted(self._path(key), key)
        return raw is not None and raw.get("ddp_autocast") is True

    def store(self, source: ModelSource, options: dict[str, Any], facts: ModelFacts,
              digest: str, notes: list[str]) -> str | None:
        """Write the entry atomically; returns its path (None when it could not be written)."""
        key = facts_key(source, options)
        if key is None:
            return None
        if not _ddp_autocast(options, facts) and self._holds_ddp_step(key):
            return self._path(key)  # the entry says more (DDP's step too): keep it
        # the entry's columns are some 100,000 new tuples and strings, no cycle: [Note:
        # pausing the cycle collector] (collecting, the library's make_plan of the 70B shape
        # spent 0.25-0.27 s here instead of 0.07-0.10 s, walking torch's objects)
        with cycle_collector_paused():
            text = json.dumps({"format": FORMAT, "key": key, "digest": digest, "notes": notes,
                               "ddp_autocast": _ddp_autocast(options, facts),
                               "facts": facts.to_dict(columns=True)})
        return self._write(self._path(key), text)

    def load_outline(self, source: ModelSource) -> ModelOutline | None:
        """The model's outline (``facts.graph.model_outline``), when an entry for it can be
        trusted (the same rules as facts)."""
        key = outline_key(source)
        if key is None:
            return None
        raw = self._trusted(self._outline_path(key), key)
        if raw is None:
            return None
        try:
            return ModelOutline.from_dict(raw["outline"])
        except Exception:  # noqa: BLE001 - a corrupt or foreign entry is ignored, never trusted
            return None

    def store_outline(self, source: ModelSource, outline: ModelOutline) -> str | None:
        """Write the model's outline entry atomically; its path, or None."""
        key = outline_key(source)
        if key is None:
            return None
        return self._write(self._outline_path(key), json.dumps(
            {"format": FORMAT, "key": key, "outline": outline.to_dict()}))

    def _write(self, path: str, text: str) -> str | None:
        """``text`` as the entry at ``path``: a temporary file renamed over the old entry, so a
        reader never sees half of one; the entry's path, or None when it cannot be written."""
        tmp = None
        try:
            os.makedirs(self.folder, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".facts-", suffix=".tmp")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, path)
            return path
        except OSError:
            if tmp is not None and os.path.exists(tmp):
                os.unlink(tmp)
            return None
