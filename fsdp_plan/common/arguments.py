"""Arguments of the public Python API, checked at the edge (issue 31, S4-15).

[Note: API arguments]
The command line reaches the library with values argparse already typed; a Python caller can
pass anything. ``make_plan(None)`` once failed deep inside with ``AttributeError``, and
``PlanRequest(world_size=0)`` with ``ZeroDivisionError`` in the search. So each public entry
point checks its arguments before any work, as Python's own functions do: a value of the
wrong type is a ``TypeError`` naming the argument and the type expected; a value of the right
type outside its range is a ``BadInput`` (exit 2 on the command line) naming the argument and
the range.
"""

from __future__ import annotations

from typing import Any

from fsdp_plan.common.errors import BadInput


def _names(expected: type | tuple[type, ...]) -> str:
    kinds = expected if isinstance(expected, tuple) else (expected,)
    return " or ".join("None" if k is type(None) else k.__name__ for k in kinds)


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def require_type(value: Any, expected: type | tuple[type, ...], what: str) -> None:
    """``TypeError`` naming ``what`` unless ``value`` is an instance of ``expected`` (a bool
    is not accepted where an int is asked for)."""
    kinds = expected if isinstance(expected, tuple) else (expected,)
    if isinstance(value, bool) and bool not in kinds:
        ok = False
    else:
        ok = isinstance(value, kinds)
    if not ok:
        raise TypeError(f"{what} must be of type {_names(expected)}, got {type(value).__name__} "
                        f"({_shown(value)}).")


def require_whole(value: Any, what: str, low: int, high: int) -> int:
    """``value`` is an int (not a bool) in ``low..high``: ``TypeError`` for another type,
    ``BadInput`` naming ``what`` and the range for a value outside it."""
    require_type(value, int, what)
    if not low <= value <= high:
        shown = f"a {value.bit_length()}-bit number" if value.bit_length() > 64 else str(value)
        raise BadInput(f"{what} is {shown}; it must be a whole number from {low:,} to "
                       f"{high:,}.")
    return value


def require_choice(value: Any, what: str, choices: tuple[str, ...]) -> str:
    """``value`` is one of the strings ``choices``."""
    require_type(value, str, what)
    if value not in choices:
        raise BadInput(f"{what} is {_shown(value)}, not one of {', '.join(choices)}.")
    return value
