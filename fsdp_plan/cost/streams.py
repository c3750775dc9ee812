"""The two-stream clock that FSDP's step (``cost/step_time.simulate_step``, unit by unit) and
DDP's step (``cost/ddp_buckets.ddp_step_time``, bucket by bucket) both run on.

[Note: two streams]
One compute stream and one communication stream share a clock. A collective is issued at a
time and starts when the communication stream is free (collectives run in issue order). Compute
that overlaps running collectives slows by ``hardware.contention`` times the share of its
duration that overlaps (collectives take SMs and HBM bandwidth). Compute standing still for
communication is a ``wait`` span. After backward, what the communication stream still runs is
the tail, ``max(0, comm_finish - backward_finish)``; then the optimizer runs. Spans are
``(lane, label, start, end)`` with lanes ``compute``, ``comm``, ``wait`` and ``host`` ([Note:
the host floor]), read by the report, the Chrome trace and the pictures. The strategies decide *when* they issue and wait
([Note: two-stream simulation] in step_time.py, [Note: DDP buckets] in ddp_buckets.py); this
module is the one place that keeps the streams.

[Note: the host floor]
A third timeline, the host, issues the device's work: each stretch of compute (a unit's pass,
or DDP's backward up to a bucket) costs the host ``host_s`` seconds to issue, its ops'
dispatch and kernel launch plus FSDP's per-unit hooks, copy-in/copy-out issue and stream
waits, its per-parameter bookkeeping, and a checkpointed block's wrapper in the backward that
replays it (cost/step_time.py ``issue_time``). The host issues in program order, as soon as it has
issued what came before: FSDP2 makes streams wait on events, never the host, so it runs ahead
of the device when the device is the slower (asynchronous launch), and the device never runs
ahead of it. A stretch therefore starts no earlier than the host began issuing it and ends no
earlier than the host finished: ``end = max(start + device seconds, host end)``, and a step of
many small ops takes at least what the host needs to issue it (ops x ``op_overhead_s`` + 2
passes x (units x ``unit_overhead_s`` + parameter tensors x ``param_overhead_s``) +
checkpointed blocks x ``checkpoint_overhead_s``). A stretch's device seconds keep their own floor,
max(work, ops x ``op_overhead_s``) (step_time.py [Note: per-op compute time]), so where the
host is never behind the step is what it was without this timeline, to the bit; what the
timeline adds is FSDP's per-unit host cost and a host lag carried from unit to unit, which a
slow unit later absorbs. The device standing still for the host is ``host_wait_s`` (part of
compute: no collective is exposed by it); the host's issuing is the ``host`` lane. Where the
host computes in line (a CPU, ``async_launch: false``) the callers pass ``host_s = 0`` and the
per-op and per-unit costs are device seconds already.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from fsdp_plan.common.deferred import Deferred
from fsdp_plan.cost.hardware import Hardware

Span = tuple[str, str, float, float]
"""(lane, label, start, end): [Note: two streams]."""


class Streams:
    """A compute and a communication stream on one clock, and the spans they ran."""

    def __init__(self, hw: Hardware, *, record_spans: bool = True) -> None:
        self.hw = hw
        self.spans: list[Span] = []
        self.record_spans = record_spans
        """Whether ``spans`` is kept (off: the search's clock, [Note: spans when read])."""
        self.comm_free = 0.0
        """When the communication stream finishes what was issued so far."""
        self._starts: list[float] = []
        """Where each collective started, in issue order (``_ends``: where it ended)."""
        self._ends: list[float] = []
        self._busy_s = 0.0
        """The communication stream's busy seconds so far (``finish``'s total, summed as the
        collectives are issued, in the same order)."""
        self._beside_starts: list[float] = []
        """Work on a stream of its own beside the collectives: the optimizer stepped in
        backward on a GPU ([Note: optimizer overlap in the models] in
        cost/optimizer_overlap.py)."""
        self._beside_ends: list[float] = []
        self._in_line_s = 0.0
        """Optimizer seconds the host stepped in line (``step_in_backward`` on a CPU)."""
        self.host_free = 0.0
        """When the host has issued everything so far ([Note: the host floor])."""
        self.host_wait_s = 0.0
        """Seconds the device stood still waiting for the host to issue its work."""

    def copy(self) -> Streams:
        """These streams as they stand, to run on from twice (lists copied, not shared)."""
        other = Streams.__new__(Streams)
        other.__dict__.update(self.__dict__)
        for name in ("spans", "_starts", "_ends", "_beside_starts", "_beside_ends"):
            setattr(other, name, list(getattr(self, name)))
        return other

    # The clock runs ``issue`` and ``compute`` for every unit of every candidate the search
    # evaluates: each takes the larger or smaller of two floats by a conditional, where
    # ``max()``/``min()`` of two arguments cost the search's whole clock a quarter more
    # (CPython 3.11). The values are those ``max``/``min`` give (``noqa: FURB136``).

    def issue(self, label: str, at: float, seconds: float) -> float:
        """A collective issued at ``at``; returns when it finishes."""
        free = self.comm_free
        start = at if at > free else free  # noqa: FURB136
        self.comm_free = end = start + seconds
        self._starts.append(start)
        self._ends.append(end)
        self._busy_s += end - start
        if self.record_spans:
            self.spans.append(("comm", label, start, end))
        return end

    def step_in_backward(self, label: str, now: float, reduced: float, seconds: float
                         ) -> tuple[float, float, float]:
        """An optimizer step of ``seconds`` over gradients reduced at ``reduced``, compute
        standing at ``now`` ([Note: optimizer overlap in the models]): on a GPU on a stream of
        its own after what that stream runs already (it slows the compute it overlaps as a
        collective does, but is no communication); where the host computes in line, on the
        compute stream once the reduction is done. Returns (compute's new time, seconds it
        waited for the reduction, its contention slowdown)."""
        if self.hw.async_launch:
            start = max(reduced, self._beside_ends[-1] if self._beside_ends else 0.0)
            self._beside_starts.append(start)
            self._beside_ends.append(start + seconds)
            if self.record_spans:
                self.spans.append(("comm", label, start, start + seconds))
            return now, 0.0, 0.0
        start = max(now, reduced)
        if start > now:
            self.wait(f"wait for the reduction before {label}", now, start)
        end, slowdown = self.compute(label, start, seconds)
        self._in_line_s += seconds
        return end, start - now, slowdown

    def steps_left(self, after: float) -> float:
        """The optimizer seconds in backward that end the step: all that the host stepped in
        line, or what the stream beside still runs after ``after``."""
        if not self.hw.async_launch:
            return self._in_line_s
        return max(0.0, (self._beside_ends[-1] if self._beside_ends else 0.0) - after)

    def overlap(self, start: float, end: float) -> float:
        """Seconds of ``[start, end)`` the communication stream is busy, plus those the work
        beside it is (each lane's spans are sorted and disjoint: scan from the first one
        ending after ``start``)."""
        total = _busy_within(self._starts, self._ends, start, end)
        if self._beside_ends:
            total += _busy_within(self._beside_starts, self._beside_ends, start, end)
        return total

    def compute(self, label: str, start: float, seconds: float,
                host_s: float = 0.0) -> tuple[float, float]:
        """Compute of ``seconds`` ready to start at ``start``, slowed where collectives overlap
        it, whose ops the host issues in ``host_s`` seconds: it starts no earlier than the host
        began issuing it and ends no earlier than the host finished ([Note: the host floor]).
        Returns (its end, the slowdown in seconds)."""
        begin = issued = start
        record = self.record_spans
        if host_s > 0:
            free = self.host_free
            issued = free + host_s
            if record:
                self.spans.append(("host", "issue " + label, free, issued))
            if free > start:
                begin = free
            self.host_free = issued
        floor = seconds if seconds > 1e-12 else 1e-12  # noqa: FURB136
        # ``overlap``, in line (the clock's most frequent call); nothing to scan where the
        # last collective ended before ``begin`` (they end in issue order)
        ends = self._ends
        share = (_busy_within(self._starts, ends, begin, begin + seconds)
                 if ends and ends[-1] > begin else 0.0)
        if self._beside_ends:
            share += _busy_within(self._beside_starts, self._beside_ends, begin, begin + seconds)
        share /= floor
        slowed = seconds * (1 + self.hw.contention * (share if share < 1.0 else 1.0))  # noqa: FURB136
        finished = begin + slowed
        end = finished if finished > issued else issued  # noqa: FURB136
        late = issued - finished
        self.host_wait_s += (begin - start) + (late if late > 0.0 else 0.0)  # noqa: FURB136
        if record:
            self.spans.append(("compute", label, begin, end))
        return end, slowed - seconds

    def wait(self, label: str, start: float, end: float) -> None:
        """Compute standing still from ``start`` to ``end`` for communication."""
        if self.record_spans:
            self.spans.append(("wait", label, start, end))

    def finish(self, backward_end: float, optimizer_s: float) -> tuple[float, float]:
        """Close the step: the communication tail after ``backward_end``, then the optimizer.
        Returns (tail seconds, total communication seconds)."""
        # collectives run in issue order, each after the last: the last one ends last
        comm_finish = self._ends[-1] if self._ends else backward_end
        tail = max(0.0, comm_finish - backward_end)
        if tail > 0:
            self.wait("wait: communication tail", backward_end, comm_finish)
        end = backward_end + tail
        if self.record_spans:
            self.spans.append(("compute", "optimizer", end, end + optimizer_s))
        return tail, self._busy_s


class DeferredSpans(Sequence[Span]):
    """The spans of a clock run that kept none, made by ``make()`` when first read.

    [Note: spans when read]
    The search runs the clock for every plan whose step time it reads (34 on the 70B shape,
    126 of some 1,500 units each for 10,006 modules), and a plan's spans, a labelled tuple per
    collective, stretch of compute and wait, are read only for the plans a report, page or
    trace shows. So the search's clock keeps none (``Streams(record_spans=False)``): a step
    time's ``spans`` is this list, which runs the same simulation again, keeping them, when
    first read, and keeps them. The run is a pure function of the units and the hardware, so
    the spans are those the first run would have kept, to the bit. It reads as the list it
    stands for (iterating, indexing, ``len``, ``==``, ``repr``) and pickles and copies as
    that list."""

    __slots__ = ("_spans",)

    def __init__(self, make: Callable[[], list[Span]]) -> None:
        self._spans = Deferred(make)  # made once, what ``make`` captured freed then

    def _list(self) -> list[Span]:
        return self._spans.get()

    def __len__(self) -> int:
        return len(self._list())

    def __getitem__(self, index: Any) -> Any:
        return self._list()[index]

    def __iter__(self) -> Iterator[Span]:
        return iter(self._list())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DeferredSpans):
            other = other._list()
        if not isinstance(other, list):
            return NotImplemented
        return self._list() == other

    __hash__ = None  # type: ignore[assignment]  # as the list it stands for

    def __reduce__(self) -> tuple[Any, tuple[list[Span]]]:
        return list, (self._list(),)

    def __repr__(self) -> str:
        return repr(self._list())


def _busy_within(starts: list[float], ends: list[float], start: float, end: float) -> float:
    """Seconds of ``[start, end)`` covered by the spans from ``starts`` to ``ends`` (sorted,
    disjoint)."""
    total = 0.0
    for i in range(bisect.bisect_right(ends, start), len(starts)):
        s = starts[i]
        if s >= end:
            break
        e = ends[i]
        covered = (end if end <= e else e) - (start if start >= s else s)  # noqa: FURB136
        if covered > 0.0:
            total += covered
    return total
