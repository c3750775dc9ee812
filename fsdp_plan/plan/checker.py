"""The checking toolkit a plan's field checkers share (plan/check.py): describing values read
from a plan in messages (never a huge repr, never a control character), the ``Checker`` whose
refusals name the field path and the fix, and the walk that refuses what is not YAML plain
data before any field is read."""

from __future__ import annotations

import datetime
import difflib
import math
import re
from typing import Any

from fsdp_plan.common.errors import BadInput
from fsdp_plan.common.safe_yaml import MAX_DEPTH, MAX_NODES, clip

MAX_NAME_CHARS = 4096

KEPT_AS_WRITTEN = ("model", "predicted", "hardware")
"""Sections the plan keeps as written beyond the fields checked one by one (the planner's
report, the hardware's provenance); they reach the policy module's ``PLAN`` literal, so they
must be exact Python literals too."""


# --- describing values in messages ------------------------------------------------------------

def show(value: Any) -> str:
    """A short, safe description of a value read from the plan (never a huge repr)."""
    if value is None:
        return "null (empty)"
    if isinstance(value, bool):
        return f"{str(value).lower()} (a boolean)"
    if isinstance(value, int):
        if value.bit_length() > 128:
            return f"a {value.bit_length()}-bit number"
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return ".nan (not a number)"
        if math.isinf(value):
            return ("" if value > 0 else "-") + ".inf (infinity)"
        return f"{value!r} (a decimal number)"
    if isinstance(value, str):
        return f"{clip(value)!r} (a string)"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return f"a value of type {type(value).__name__}"


def name_of(value: Any) -> str:
    """A module or key name as it appears in messages: quoted, clipped."""
    return repr(clip(value)) if isinstance(value, str) else show(value)


class Checker:
    """Raises ``BadInput("<where>: <path> <problem>; <fix>.")`` for one plan document."""

    def __init__(self, where: str) -> None:
        self.where = where

    def fail(self, path: str, problem: str, fix: str) -> BadInput:
        return BadInput(f"{self.where}: {path} {problem}; {fix}.")

    def mapping(self, value: Any, path: str, fix: str, *, optional: bool = False) -> dict:
        if value is None and optional:
            return {}
        if not isinstance(value, dict):
            raise self.fail(path, f"must be a mapping (key: value), got {show(value)}", fix)
        for key in value:
            if not isinstance(key, str):
                raise self.fail(path, f"has the key {show(key)}; keys are names (strings)", fix)
        return value

    def sequence(self, value: Any, path: str, fix: str, *, optional: bool = False) -> list:
        if value is None and optional:
            return []
        if not isinstance(value, list):
            raise self.fail(path, f"must be a list, got {show(value)}", fix)
        return value

    def keys(self, value: dict, path: str, allowed: tuple[str, ...]) -> None:
        """Refuse a key ``allowed`` does not hold, naming the closest one (issue 31, S4-10)."""
        unknown = [k for k in value if k not in allowed]
        if unknown:
            raise self.fail(field(path, unknown[0]), "is not a key fsdp-plan knows here",
                            f"{closest(unknown[0], allowed)}{path} takes only "
                            f"{', '.join(allowed)} (check the spelling)")

    def integer(self, value: Any, path: str, low: int, high: int, what: str) -> int:
        """A whole number in ``[low, high]``; ``what`` says what it counts and why the bounds."""
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(path, f"must be a whole number, got {show(value)}", what)
        if not low <= value <= high:
            raise self.fail(path, f"is {show(value)}, outside {low}..{high}", what)
        return value

    def number(self, value: Any, path: str, what: str) -> float | int:
        """A finite, non-negative int or float."""
        if (isinstance(value, bool) or not isinstance(value, (int, float))
                or isinstance(value, float) and not math.isfinite(value) or value < 0):
            raise self.fail(path, f"must be a finite number >= 0, got {show(value)}", what)
        return value

    def string(self, value: Any, path: str, fix: str, *, allow_empty: bool = False) -> str:
        if not isinstance(value, str):
            raise self.fail(path, f"must be a string, got {show(value)}", fix)
        if not value and not allow_empty:
            raise self.fail(path, "is empty", fix)
        if len(value) > MAX_NAME_CHARS or "\0" in value:
            raise self.fail(path, f"is not a name (longer than {MAX_NAME_CHARS} characters or "
                            "holding a NUL)", fix)
        return value

    def choice(self, value: Any, path: str, choices: tuple[str, ...], fix: str) -> str:
        if not isinstance(value, str) or value not in choices:
            raise self.fail(path, f"is {show(value)}, not one of {', '.join(choices)}", fix)
        return value

    def fqn(self, value: Any, path: str, *, root: bool) -> str:
        """A module FQN as ``named_modules()`` spells it (``""`` only where the root may be)."""
        fix = ("name a module by its dotted path as model.named_modules() spells it, e.g. "
               "'layers.0'" + ("; the root is ''" if root else ""))
        name = self.string(value, path, fix, allow_empty=True)
        if name == "" and not root:
            raise self.fail(path, "names the root module ''", "the root cannot be listed here; "
                            "name submodules only")
        if name and (name.startswith(".") or name.endswith(".") or ".." in name):
            raise self.fail(path, f"is {name_of(name)}, not a dotted module path", fix)
        return name


def closest(key: Any, known: tuple[str, ...] | list[str]) -> str:
    """``"did you mean X? "`` for the known name nearest a misspelt ``key`` (difflib), else ``""``."""
    near = difflib.get_close_matches(key, known, n=1, cutoff=0.6) if isinstance(key, str) else []
    return f"did you mean {near[0]}? " if near else ""


def field(path: str, key: Any) -> str:
    """``path.key`` for a plain key; ``path['odd key']`` (quoted, clipped) for any other, so a
    key from the plan never puts control characters or line breaks into a message."""
    if isinstance(key, str) and re.fullmatch(r"[A-Za-z_][\w-]{0,59}", key):
        return f"{path}.{key}" if path else key
    return f"{path}[{clip(key)!r}]" if isinstance(key, str) else f"{path}[{show(key)}]"


def _is_unicode(text: str) -> bool:
    """False for strings holding lone surrogates (YAML's "\\ud800" escapes): they cannot be
    printed or written as UTF-8."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def walk_plain(check: Checker, raw: Any) -> None:
    """Refuse values that are not YAML plain data: cycles, too deep, too many, odd types.

    In ``KEPT_AS_WRITTEN`` numbers must also be finite, dates are refused and mapping keys
    are strings; the other sections have their own checks, and unknown keys, which are
    dropped, only need to be plain. Shared sub-values are visited each
    time they appear (as every consumer would), so the count bounds the work of anything that
    walks the document."""
    count = 0
    stack: list[tuple[Any, str, int, tuple[int, ...], bool]] = [(raw, "", 0, (), False)]
    while stack:
        value, path, depth, parents, kept = stack.pop()
        count += 1
        if count > MAX_NODES:
            raise check.fail("the document", f"holds more than {MAX_NODES:,} values",
                             "a plan holds a few thousand; write it again with fsdp-plan --plan")
        if depth > MAX_DEPTH:
            raise check.fail(path or "the document", f"nests more than {MAX_DEPTH} levels deep",
                             "a plan nests 4 deep; flatten it")
        if isinstance(value, (dict, list)):
            if id(value) in parents:
                raise check.fail(path or "the document", "contains itself (a recursive alias)",
                                 "a plan is a tree of plain values; remove the alias")
            inner = (*parents, id(value))
            if isinstance(value, list):
                stack.extend((v, f"{path}[{i}]", depth + 1, inner, kept)
                             for i, v in enumerate(value))
                continue
            for key, item in value.items():
                if isinstance(key, str) and not _is_unicode(key):
                    raise check.fail(path or "the document",
                                     f"has a key that is not valid Unicode ({clip(key)!a})",
                                     "remove the \\ud800-style escape")
                if not isinstance(key, str) and kept:
                    raise check.fail(path or "the document", f"has the key {show(key)}",
                                     "keys in a plan are names (strings); quote it")
                item_path = field(path, key)
                stack.append((item, item_path, depth + 1, inner,
                              kept or (depth == 0 and key in KEPT_AS_WRITTEN)))
        elif isinstance(value, str) and not _is_unicode(value):
            raise check.fail(path, f"is not valid Unicode text ({clip(value)!a})",
                             "remove the \\ud800-style escape (a lone surrogate)")
        elif isinstance(value, float) and kept and not math.isfinite(value):
            raise check.fail(path, f"is {show(value)}", "a plan holds finite numbers only")
        elif isinstance(value, (datetime.date, datetime.datetime)) and not kept:
            continue
        elif not isinstance(value, (str, int, float, bool)) and value is not None:
            raise check.fail(path, f"is {show(value)}", "a plan holds only mappings, lists, "
                             "strings, numbers, booleans and null (quote dates)")
