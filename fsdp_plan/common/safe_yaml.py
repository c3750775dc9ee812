"""Parse a YAML document that anyone may have written, as plain data, with bounded work.

``load_yaml`` refuses, before building anything: binary or non-UTF-8 text, YAML tags
(``!!python/...``, ``!!binary``, ``!local``), recursive aliases, nesting deeper than the
document kind allows, anchors that expand to more values than it allows (the "billion
laughs": 416 bytes of aliases took a minute and gigabytes before, issue 21 S3-07), duplicate
keys (YAML keeps the last silently, S3-27) and values YAML cannot turn into data (integers
over Python's 4,300-digit limit, S3-09). It walks the YAML events first (no recursion, no
objects), then builds plain data with ``yaml.CSafeLoader`` (``SafeLoader`` without libyaml).
Every refusal is one ``BadInput`` paragraph (exit 2), worded for the kind of document
(``DocumentKind``): plan files (plan_read.py) and hardware files (hardware/) read through it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import yaml

from fsdp_plan.common.errors import BadInput

MAX_NODES = 1_000_000
"""YAML nodes after expanding aliases; bounds the work any consumer of a plan does."""
MAX_DEPTH = 64
"""Nesting depth; a plan needs 4, and deeper documents would exhaust the parser's stack."""


@dataclass(frozen=True, kw_only=True)
class DocumentKind:
    """What a kind of document is, for the refusals' words, and how much of it is sane."""

    text: str
    """"a plan is a YAML text file": said of binary or non-UTF-8 bytes."""
    written_by: str
    """" written by fsdp-plan --plan": how to get a good one."""
    plain: str
    """"a plan is plain data (mappings, lists, strings, numbers)"."""
    size: str
    """"a plan is a few thousand values"."""
    name: str
    """"a plan": "it is not a plan"."""
    depth: str
    """"a plan nests 4 deep"."""
    max_nodes: int = MAX_NODES
    max_depth: int = MAX_DEPTH


def clip(text: str, limit: int = 60) -> str:
    """``text`` cut to ``limit`` characters for a message (values read may be huge)."""
    text = str(text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def one_line(text: str, limit: int = 400) -> str:
    """A parser's message as one printable line (it may quote bytes of a hostile file)."""
    text = " ".join(str(text).split())
    return clip("".join(c if c.isprintable() else repr(c)[1:-1] for c in text), limit)


def _loader() -> type:
    return getattr(yaml, "CSafeLoader", None) or yaml.SafeLoader


def load_yaml(data: bytes, where: str, kind: DocumentKind) -> Any:
    """Decode and parse a document held in memory; ``None`` when it holds nothing."""
    if b"\0" in data:
        raise BadInput(f"{where} holds binary data (NUL bytes); {kind.text}.")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise BadInput(f"{where} is not UTF-8 text (byte {e.start} is not valid UTF-8); "
                       f"{kind.text}{kind.written_by}.") from e
    loader = _loader()
    try:
        _scan(text, loader, where, kind)
        return yaml.load(text, Loader=loader)  # a safe loader; tags were refused
    except BadInput:
        raise
    except yaml.constructor.ConstructorError as e:
        raise BadInput(f"{where} holds a value fsdp-plan never constructs "
                       f"({one_line(e.problem)}); {kind.plain}.") from e
    except yaml.YAMLError as e:
        raise BadInput(f"{where} cannot be read as YAML: {one_line(e)}.") from e
    except (ValueError, OverflowError, RecursionError, MemoryError) as e:
        raise BadInput(f"{where} holds a value YAML cannot turn into data "
                       f"({type(e).__name__}: {one_line(e, 120)}).") from e


def _scan(text: str, loader: type, where: str, kind: DocumentKind) -> None:
    """Walk the YAML events (no recursion, no objects built) and refuse what such a document
    never holds: tags, recursive aliases, deep nesting, alias bombs and duplicate keys."""
    sizes: dict[str, int] = {}
    open_anchors: list[str] = []
    # Frames of open collections: [anchor, expanded size, is_mapping, keys seen, items seen].
    stack: list[list[Any]] = []
    # Values written out in the text, and values its aliases repeat: the words of a refusal
    # say which made the document too large (issue 21, S3-25: a plan of plain lists was
    # blamed on "anchors and aliases repeating each other").
    written = repeated = 0

    def line(event: Any) -> str:
        mark = getattr(event, "start_mark", None)
        return f"line {mark.line + 1}" if mark is not None else "somewhere"

    def count(event: Any, *, alias_size: int = 0) -> None:
        nonlocal written, repeated
        if alias_size:
            repeated += alias_size
        else:
            written += 1
        if written > kind.max_nodes:
            raise BadInput(f"{where} holds more than {kind.max_nodes:,} values (counted up to "
                           f"{line(event)}); {kind.size}, so it is not {kind.name} and was not "
                           "read further.")
        if written + repeated > kind.max_nodes:
            raise BadInput(f"{where} expands to more than {kind.max_nodes:,} values at "
                           f"{line(event)} (anchors and aliases repeating each other); "
                           f"{kind.size}, so it was not read further.")

    def add(size: int) -> None:
        if stack:
            stack[-1][1] += size
            stack[-1][4] += 1

    for event in _events(text, loader, where, kind):
        if isinstance(event, yaml.NodeEvent):
            tag = getattr(event, "tag", None)
            if tag is not None:
                raise BadInput(f"{where} holds a YAML tag ({clip(tag)!r}) at {line(event)}; "
                               f"{kind.plain} and fsdp-plan constructs no tagged values. "
                               "Remove the tag.")
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
                               f"{line(event)} (a value that contains itself); {kind.name} is "
                               "a tree of plain values.")
            if event.anchor not in sizes:
                raise BadInput(f"{where} uses the alias *{clip(event.anchor)} at {line(event)} "
                               "before any anchor of that name.")
            count(event, alias_size=sizes[event.anchor])
            add(sizes[event.anchor])
        elif isinstance(event, yaml.ScalarEvent):
            if event.anchor is not None:
                sizes[event.anchor] = 1
            count(event)
            add(1)
        elif isinstance(event, (yaml.SequenceStartEvent, yaml.MappingStartEvent)):
            if len(stack) >= kind.max_depth:
                raise BadInput(f"{where} nests lists or mappings more than {kind.max_depth} "
                               f"deep (at {line(event)}); {kind.depth}.")
            if event.anchor is not None:
                open_anchors.append(event.anchor)
            count(event)
            stack.append([event.anchor, 1, isinstance(event, yaml.MappingStartEvent), set(), 0])
        elif isinstance(event, (yaml.SequenceEndEvent, yaml.MappingEndEvent)):
            anchor, size, _, _, _ = stack.pop()
            if anchor is not None:
                open_anchors.remove(anchor)
                sizes[anchor] = size
            add(size)


def _events(text: str, loader: type, where: str, kind: DocumentKind) -> Iterator[Any]:
    """The YAML events of ``text``. Newer libyaml builds stop at their own flow-nesting limit
    (about 1,000) while scanning ahead, before the depth check in ``_scan`` sees an event; that
    refusal is reported in the same words as ours so every build says the same thing."""
    try:
        yield from yaml.parse(text, Loader=loader)
    except yaml.YAMLError as e:
        if "nesting depth" in str(e):
            raise BadInput(f"{where} nests lists or mappings more than {kind.max_depth} deep "
                           f"({one_line(e, 120)}); {kind.depth}.") from e
        raise
