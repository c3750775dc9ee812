"""The two-stream clock that FSDP's step (``cost/step_time.simulate_step``, unit by unit) and
DDP's step (``cost/ddp_buckets.ddp_step_time``, bucket by bucket) both run on.

[Note: two streams]
One compute stream and one communication stream share a clock. A collective is issued at a
time and starts when the communication stream is free (collectives run in issue order). Compute
that overlaps running collectives slows by ``hardware.contention`` times the share of its
duration that overlaps (collectives take SMs and HBM bandwidth). Compute standing still for
communication is a ``wait`` span. After backward, what the communication stream still runs is
the tail, ``max(0, comm_finish - backward_finish)``; then the optimizer runs. Spans are
``(lane, label, start, end)`` with lanes ``compute``, ``comm`` and ``wait``, read by the report,
the Chrome trace and the pictures. The strategies decide *when* they issue and wait
([Note: two-stream simulation] in step_time.py, [Note: DDP buckets] in ddp_buckets.py); this
module is the one place that keeps the streams.
"""

from __future__ import annotations

import bisect

from fsdp_plan.cost.hardware import Hardware


class Streams:
    """A compute and a communication stream on one clock, and the spans they ran."""

    def __init__(self, hw: Hardware) -> None:
        self.hw = hw
        self.spans: list[tuple[str, str, float, float]] = []
        self.comm_free = 0.0
        """When the communication stream finishes what was issued so far."""
        self._busy: list[tuple[float, float]] = []
        self._ends: list[float] = []

    def issue(self, label: str, at: float, seconds: float) -> float:
        """A collective issued at ``at``; returns when it finishes."""
        start = max(at, self.comm_free)
        self.comm_free = start + seconds
        self._busy.append((start, self.comm_free))
        self._ends.append(self.comm_free)
        self.spans.append(("comm", label, start, self.comm_free))
        return self.comm_free

    def overlap(self, start: float, end: float) -> float:
        """Seconds of ``[start, end)`` the communication stream is busy (its spans are sorted
        and disjoint: scan from the first one ending after ``start``)."""
        total = 0.0
        i = bisect.bisect_right(self._ends, start)
        while i < len(self._busy) and self._busy[i][0] < end:
            s, e = self._busy[i]
            total += max(0.0, min(end, e) - max(start, s))
            i += 1
        return total

    def compute(self, label: str, start: float, seconds: float) -> tuple[float, float]:
        """Compute of ``seconds`` started at ``start``, slowed where collectives overlap it;
        returns (its end, the slowdown in seconds)."""
        slowed = seconds * (1 + self.hw.contention * min(
            1.0, self.overlap(start, start + seconds) / max(seconds, 1e-12)))
        self.spans.append(("compute", label, start, start + slowed))
        return start + slowed, slowed - seconds

    def wait(self, label: str, start: float, end: float) -> None:
        """Compute standing still from ``start`` to ``end`` for communication."""
        self.spans.append(("wait", label, start, end))

    def finish(self, backward_end: float, optimizer_s: float) -> tuple[float, float]:
        """Close the step: the communication tail after ``backward_end``, then the optimizer.
        Returns (tail seconds, total communication seconds)."""
        comm_finish = max([e for _, e in self._busy], default=backward_end)
        tail = max(0.0, comm_finish - backward_end)
        if tail > 0:
            self.wait("wait: communication tail", backward_end, comm_finish)
        end = backward_end + tail
        self.spans.append(("compute", "optimizer", end, end + optimizer_s))
        return tail, sum(e - s for s, e in self._busy)
