"""An old bench result read as untrusted data, before a run is compared with it (``--compare``).

[Note: checking a result file]
A result is checked as a plan file is (issue 31): ``read_result`` reads a regular file of at
most ``MAX_RESULT_BYTES`` (common/reading.py [Note: reading input files]: a FIFO or
``/dev/zero`` is refused without being opened, S4-08 and S4-19), and ``check_result``
requires every field ``compare`` and the report read, of its kind, and no number anywhere
that is not finite. Step times must be positive: all-zero ``per_rank`` times once raised
``ZeroDivisionError`` after the whole run (S4-03), and ``Infinity`` or ``median_s: 0`` turned a
+10,450,492% regression into "within noise (±inf%)" (S4-04). Every refusal is one ``BadInput``
paragraph naming the field and its value, before any worker starts.
"""

from __future__ import annotations

import json
import math
from typing import Any

from fsdp_plan.common.errors import BadInput
from fsdp_plan.common.reading import read_input_bytes

RESULT_VERSION = 1
"""``fsdp_plan_bench_version`` of the result files bench writes (bench/results.py)."""


def is_number(value: Any) -> bool:
    """A finite int or float (not a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


_FIELD_KINDS = {
    "text": "a string",
    "mapping": "an object",
    "counts": "an object of collective counts (non-negative integers)",
    "seconds": "a non-negative number of seconds",
    "step seconds": "a positive, finite number of seconds (a step takes time)",
    "per rank": "a list of objects, one per rank, each with steps_s: a non-empty list of "
                "positive, finite step times in seconds",
    "seconds or null": "a non-negative number of seconds, or null",
    "signed seconds": "a number of seconds (negative allowed: a difference)",
    "bytes or null": "a non-negative integer of bytes, or null",
}
_REQUIRED_FIELDS = (
    ("plan.hash", "text"), ("run", "mapping"), ("collectives.measured", "counts"),
    ("step_time.median_s", "step seconds"), ("step_time.p99_s", "step seconds"),
    ("memory", "mapping"),
    ("comm.rank0", "mapping"),
)
"""What ``compare`` and the report read from an old result (``--compare``)."""
_OPTIONAL_FIELDS = (("memory.peak_bytes", "bytes or null"),
                    ("comm.rank0.exposed_s", "seconds or null"),
                    ("step_time.per_rank", "per rank"),
                    # --baseline no-overlap (bench/overlap.py); results before it lack them
                    ("overlap", "mapping"),
                    ("overlap.backward_overlapped_s", "seconds"),
                    ("overlap.backward_held_s", "seconds"),
                    ("overlap.compute_overlapped_s", "seconds"),
                    ("overlap.compute_held_s", "seconds"),
                    ("overlap.hidden_s", "seconds"),
                    ("overlap.contention_s", "signed seconds"),
                    ("overlap.saved_s", "signed seconds"),
                    ("overlap.predicted_contention_s", "seconds or null"),
                    ("overlap.verdict", "text"))
MAX_RESULT_BYTES = 256 * 2**20
"""A result of 8 ranks and 20 steps is about 30 kB (100,000 steps on 64 ranks about 150 MB);
a larger file is not a result, and reading it would only cost memory (issue 31, S4-19)."""


def _fits(kind: str, value: Any) -> bool:
    if kind.endswith(" or null") and value is None:
        return True
    if kind == "text":
        return isinstance(value, str)
    if kind == "mapping":
        return isinstance(value, dict)
    if kind == "counts":
        return isinstance(value, dict) and all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
            for k, v in value.items())
    if kind == "signed seconds":
        return is_number(value)
    if kind.startswith("seconds"):
        return is_number(value) and value >= 0
    if kind == "step seconds":
        return is_number(value) and value > 0
    if kind == "per rank":
        return isinstance(value, list) and bool(value) and all(
            isinstance(r, dict) and isinstance(r.get("steps_s"), list) and r["steps_s"]
            and all(_fits("step seconds", t) for t in r["steps_s"]) for r in value)
    if kind.startswith("bytes"):
        return isinstance(value, int) and not isinstance(value, bool) and value >= 0
    raise ValueError(kind)


_MISSING = object()


def _field(doc: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if not isinstance(doc, dict) or part not in doc:
            return _MISSING
        doc = doc[part]
    return doc


def check_result(result: Any, where: str) -> None:
    """Refuse a result document that lacks a field ``compare`` reads, holds a wrong type, or
    holds a number that is not finite anywhere (``Infinity``, ``NaN``: issue 31, S4-04)."""
    fix = "pass a .json result written by fsdp-plan bench (not its .trace.json)."
    if not isinstance(result, dict) or result.get("fsdp_plan_bench_version") != RESULT_VERSION:
        raise BadInput(f"{where} is not an fsdp-plan bench result (fsdp_plan_bench_version "
                       f"{RESULT_VERSION}); {fix}")
    for dotted, kind in _REQUIRED_FIELDS + _OPTIONAL_FIELDS:
        value = _field(result, dotted)
        if value is _MISSING:
            if (dotted, kind) in _OPTIONAL_FIELDS:
                continue
            raise BadInput(f"{where} lacks the field {dotted} ({_FIELD_KINDS[kind]}), so it is "
                           f"not a complete fsdp-plan bench result; {fix}")
        if not _fits(kind, value):
            raise BadInput(f"{where}: the field {dotted} is {_shown(value)}, not "
                           f"{_FIELD_KINDS[kind]}; {fix}")
    found = _non_finite(result)
    if found is not None:
        dotted, value = found
        raise BadInput(f"{where}: the field {dotted} is {value!r}, not a finite number; a "
                       f"result holds measured figures, which are finite. {fix}")


def _shown(value: Any) -> str:
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def _non_finite(doc: Any) -> tuple[str, float] | None:
    """The dotted path and value of the first number in ``doc`` that is not finite."""
    stack: list[tuple[str, Any]] = [("", doc)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return path or "(the document)", value
        if isinstance(value, dict):
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in enumerate(value))
    return None


def read_result(path: str) -> dict[str, Any]:
    """A result file written by ``write_result``, checked field by field (for ``--compare``,
    before any worker starts): a regular file of at most ``MAX_RESULT_BYTES``
    (common/reading.py [Note: reading input files])."""
    where = f"--compare {path!r}"
    data = read_input_bytes(path, where, MAX_RESULT_BYTES,
                            hint="Pass a .json result written by fsdp-plan bench.",
                            too_large="a result of 8 ranks and 20 steps is about 30 kB, so this "
                                      "is not a bench result")
    try:
        result = json.loads(data.decode("utf-8-sig"))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError and JSONDecodeError too
        raise BadInput(f"{where} is not a readable JSON result: "
                       f"{' '.join(str(e).split())[:300]}.") from e
    check_result(result, where)
    return result
