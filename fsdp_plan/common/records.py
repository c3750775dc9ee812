"""``dataclasses.replace`` for the search's small frozen records, without its per-call cost.

``dataclasses.replace`` looks every field up again on each call (whether it is a class
variable, an init field, an ``InitVar``) before it calls ``__init__``: 3.4 us for a
``Layout`` (14 fields), against 0.9 us here. The search makes some 630 copies per plan (a
layout per checkpointing count and prefetch variant, a unit's cost with its recompute).

``with_fields`` does what ``replace`` does for a dataclass whose fields are all plain init
fields kept in the instance's ``__dict__`` and that has no ``__post_init__`` (checked once
per class; anything else goes to ``replace``): it copies the instance's attributes and
changes those named, refusing a name that is not a field as ``replace`` does.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")

_PLAIN: dict[type, frozenset[str] | None] = {}
"""Per class: its field names when ``with_fields`` may copy it directly, else None."""


def with_fields(obj: T, /, **changes: Any) -> T:
    """``dataclasses.replace(obj, **changes)``."""
    cls = type(obj)
    names = _PLAIN.get(cls, ())
    if names == ():
        names = _PLAIN[cls] = _plain_fields(cls)
    if names is None:
        return dataclasses.replace(obj, **changes)
    unknown = changes.keys() - names
    if unknown:
        raise TypeError(f"{cls.__name__} has no field {min(unknown)!r}")
    copy = object.__new__(cls)
    state = copy.__dict__
    state.update(obj.__dict__)
    state.update(changes)
    return copy


def _plain_fields(cls: type) -> frozenset[str] | None:
    """The field names of ``cls`` when every one is an init field kept in the instance's
    ``__dict__`` and ``__init__`` does nothing else (no ``__post_init__``); else None."""
    if not dataclasses.is_dataclass(cls) or hasattr(cls, "__post_init__") or any(
            "__slots__" in c.__dict__ for c in cls.__mro__):
        return None  # a slot (this class's or a base's) is not in ``__dict__``
    every = cls.__dataclass_fields__.values()  # type: ignore[attr-defined]
    if any(f._field_type is dataclasses._FIELD_INITVAR for f in every):  # type: ignore[attr-defined]
        return None  # ``replace`` passes init-only variables to ``__init__``
    fields = dataclasses.fields(cls)  # the instance fields
    if any(not f.init for f in fields):
        return None
    return frozenset(f.name for f in fields)
