"""A value computed the first time it is asked for, then kept.

[Note: step times when asked]
Most plans a search evaluates never need their step time: of the 219 the 70B shape's search
on 64 GPUs evaluates at 80 GB, 162 do not fit, and ``rank`` orders those by peak alone; the
checkpointing search (``fewest_checkpointed``) asks only whether each probe fits. So the
evaluator hands each FSDP candidate its step time as a ``Deferred``: the clock's simulation
runs when the time is first read (a fitting plan's ranking, the report's rows, the frontier at
a budget where the plan fits), once, whichever copy of the candidate reads it (``judged``
copies share it). The simulation is a pure function of the layout and the evaluator's clock,
so when it runs changes no figure (``benchmarks/evaluation_identity.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Generic, TypeVar

T = TypeVar("T")
_UNSET: Any = object()


class Deferred(Generic[T]):
    """``compute()`` run on the first ``get()`` and kept; ``Deferred.known(v)`` holds ``v``.

    Copies of a dataclass holding one share it (``dataclasses.replace`` copies the
    reference), so the value is computed once for all of them. Two compare equal when their
    values do; its ``repr`` and pickling show and send the value (computing it), never the
    function."""

    __slots__ = ("_compute", "_value")

    def __init__(self, compute: Callable[[], T]) -> None:
        self._compute: Callable[[], T] | None = compute
        self._value: T = _UNSET

    @classmethod
    def known(cls, value: T) -> Deferred[T]:
        out: Deferred[T] = cls.__new__(cls)
        out._compute, out._value = None, value
        return out

    def get(self) -> T:
        if self._value is _UNSET:
            assert self._compute is not None
            self._value = self._compute()
            self._compute = None  # what it captured is freed with it
        return self._value

    @property
    def computed(self) -> bool:
        """Whether the value exists yet (tests; nothing computes it by asking)."""
        return self._value is not _UNSET

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Deferred):
            return NotImplemented
        return self is other or self.get() == other.get()

    __hash__ = None  # type: ignore[assignment]  # as the mutable dataclasses holding it

    def __reduce__(self) -> tuple[Any, tuple[T]]:
        return Deferred.known, (self.get(),)

    def __repr__(self) -> str:  # the value, as a dataclass's repr shows its fields
        return f"Deferred({self.get()!r})"
