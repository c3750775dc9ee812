"""Read a plan file as untrusted data, and find the files a plan names.

``read_plan_document`` refuses, before building anything: files over ``MAX_PLAN_BYTES``,
binary or non-UTF-8 text, YAML tags (``!!python/...``, ``!!binary``, ``!local``), recursive
aliases, nesting deeper than ``MAX_DEPTH``, anchors that expand to more than ``MAX_NODES``
values (the "billion laughs") and duplicate keys. It walks the YAML events first (no
recursion, no objects), then builds plain data with ``yaml.CSafeLoader`` (``SafeLoader``
without libyaml). Every refusal is one ``BadInput`` paragraph (exit 2). The fields are
checked afterwards by ``fsdp_plan.plan.check``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import yaml

from fsdp_plan.common.errors import BadInput

MAX_PLAN_BYTES = 16 * 2**20
"""A plan for a 405B model is about 25 kB; a file this large is not a plan and parsing it
would only cost time and memory."""
MAX_NODES = 1_000_000
"""YAML nodes after expanding aliases; bounds the work any consumer of the document does."""
MAX_DEPTH = 64
"""Nesting depth; a plan needs 4, and deeper documents would exhaust the parser's stack."""


def clip(text: str, limit: int = 60) -> str:
    """``text`` cut to ``limit`` characters for a message (plan values may be huge)."""
    text = str(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def one_line(text: str, limit: int = 400) -> str:
    """A parser's message as one printable line (it may quote bytes of a hostile file)."""
    text = " ".join(str(text).split())
    return clip("".join(c if c.isprintable() else repr(c)[1:-1] for c in text), limit)


def _loader() -> type:
    return getattr(yaml, "CSafeLoader", None) or yaml.SafeLoader


def read_plan_document(path: str) -> Any:
    """The plan file's YAML as plain data; every way a file can fail to be a plan is a ``BadInput``."""
    where = f"plan file {path!r}"
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PLAN_BYTES + 1)
    except FileNotFoundError as e:
        raise BadInput(f"{where} does not exist; give the path of a plan written by "
                       "fsdp-plan --plan.") from e
    except IsADirectoryError as e:
        raise BadInput(f"{where} is a folder; give the path of a plan file.") from e
    except OSError as e:
        raise BadInput(f"{where} cannot be read ({e.strerror or e}).") from e
    if len(data) > MAX_PLAN_BYTES:
        raise BadInput(f"{where} is larger than {MAX_PLAN_BYTES // 2**20} MiB; a plan for a 405B "
                       "model is about 25 kB, so this is not a plan file (it was not parsed).")
    return parse_plan_text(data, where)


def parse_plan_text(data: bytes, where: str = "plan") -> Any:
    """Decode and parse a plan document held in memory (see ``read_plan_document``)."""
    if b"\0" in data:
        raise BadInput(f"{where} holds binary data (NUL bytes); a plan is a YAML text file.")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise BadInput(f"{where} is not UTF-8 text (byte {e.start} is not valid UTF-8); a plan "
                       "is a YAML text file written by fsdp-plan --plan.") from e
    loader = _loader()
    try:
        _scan(text, loader, where)
        raw = yaml.load(text, Loader=loader)  # a safe loader; tags were refused
    except BadInput:
        raise
    except yaml.constructor.ConstructorError as e:
        raise BadInput(f"{where} holds a value fsdp-plan never constructs "
                       f"({one_line(e.problem)}); a plan is plain data (mappings, "
                       "lists, strings, numbers).") from e
    except yaml.YAMLError as e:
        raise BadInput(f"{where} cannot be read as YAML: {one_line(e)}.") from e
    except (ValueError, OverflowError, RecursionError, MemoryError) as e:
        raise BadInput(f"{where} holds a value YAML cannot turn into data "
                       f"({type(e).__name__}: {one_line(e, 120)}).") from e
    if raw is None:
        raise BadInput(f"{where} is empty; write a plan with fsdp-plan --plan.")
    return raw


def _scan(text: str, loader: type, where: str) -> None:
    """Walk the YAML events (no recursion, no objects built) and refuse what a plan never holds:
    tags, recursive aliases, deep nesting, alias bombs and duplicate mapping keys."""
    sizes: dict[str, int] = {}
    open_anchors: list[str] = []
    # Frames of open collections: [anchor, expanded size, is_mapping, keys seen, items seen].
    stack: list[list[Any]] = []
    total = 0

    def line(event: Any) -> str:
        mark = getattr(event, "start_mark", None)
        return f"line {mark.line + 1}" if mark is not None else "somewhere"

    def add(size: int, event: Any) -> None:
        nonlocal total
        if stack:
            stack[-1][1] += size
            stack[-1][4] += 1
            if stack[-1][1] > MAX_NODES:
                raise BadInput(f"{where} expands to more than {MAX_NODES:,} values at {line(event)} "
                               "(anchors and aliases repeating each other); a plan is a few "
                               "thousand values, so it was not read further.")
        else:
            total += size
            if total > MAX_NODES:
                raise BadInput(f"{where} holds more than {MAX_NODES:,} values; it is not a plan.")

    for event in _events(text, loader, where):
        if isinstance(event, yaml.NodeEvent):
            tag = getattr(event, "tag", None)
            if tag is not None:
                raise BadInput(f"{where} holds a YAML tag ({clip(tag)!r}) at {line(event)}; a plan "
                               "is plain data (mappings, lists, strings, numbers) and fsdp-plan "
                               "constructs no tagged values. Remove the tag.")
            in_mapping_key = bool(stack) and stack[-1][2] and stack[-1][4] % 2 == 0
            if in_mapping_key and not isinstance(event, (yaml.ScalarEvent, yaml.AliasEvent)):
                raise BadInput(f"{where} has a list or mapping used as a mapping key at "
                               f"{line(event)}; keys are plain names.")
            if in_mapping_key and isinstance(event, yaml.ScalarEvent):
                keys = stack[-1][3]
                if event.value in keys:
                    raise BadInput(f"{where} has the key {clip(event.value)!r} twice in one "
                                   f"mapping (at {line(event)}); YAML would keep only the last. "
                                   "Remove one of them.")
                keys.add(event.value)
        if isinstance(event, yaml.AliasEvent):
            if event.anchor in open_anchors:
                raise BadInput(f"{where} has a recursive alias *{clip(event.anchor)} at "
                               f"{line(event)} (a value that contains itself); a plan is a tree "
                               "of plain values.")
            if event.anchor not in sizes:
                raise BadInput(f"{where} uses the alias *{clip(event.anchor)} at {line(event)} "
                               "before any anchor of that name.")
            add(sizes[event.anchor], event)
        elif isinstance(event, yaml.ScalarEvent):
            if event.anchor is not None:
                sizes[event.anchor] = 1
            add(1, event)
        elif isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            if len(stack) >= MAX_DEPTH:
                raise BadInput(f"{where} nests lists or mappings more than {MAX_DEPTH} deep (at "
                               f"{line(event)}); a plan nests 4 deep.")
            if event.anchor is not None:
                open_anchors.append(event.anchor)
            stack.append([event.anchor, 1, isinstance(event, yaml.MappingStartEvent), set(), 0])
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            anchor, size, _, _, _ = stack.pop()
            if anchor is not None:
                open_anchors.remove(anchor)
                sizes[anchor] = size
            add(size, event)


def _events(text: str, loader: type, where: str) -> Iterator[Any]:
    """The YAML events of ``text``. Newer libyaml builds stop at their own flow-nesting limit
    (about 1,000) while scanning ahead, before the depth check in ``_scan`` sees an event; that
    refusal is reported in the same words as ours so every build says the same thing."""
    try:
        yield from yaml.parse(text, Loader=loader)
    except yaml.YAMLError as e:
        if "nesting depth" in str(e):
            raise BadInput(f"{where} nests lists or mappings more than {MAX_DEPTH} deep "
                           f"({one_line(e, 120)}); a plan nests 4 deep.") from e
        raise


def resolve_candidates(source: str, plan_path: str | None) -> list[str]:
    """Where a relative model path in a plan is looked for, in order: the plan file's folder,
    the working folder (plans written before this rule), then the plan folder's parents (a plan
    written into ``policies/`` from the project root records paths from the root)."""
    if os.path.isabs(source):
        return [source]
    found = []
    if plan_path is not None:
        found.append(os.path.join(os.path.dirname(os.path.abspath(plan_path)), source))
    found.append(os.path.abspath(source))
    if plan_path is not None:
        folder = os.path.dirname(os.path.abspath(plan_path))
        while os.path.dirname(folder) != folder:
            folder = os.path.dirname(folder)
            found.append(os.path.join(folder, source))
    return list(dict.fromkeys(os.path.normpath(p) for p in found))
