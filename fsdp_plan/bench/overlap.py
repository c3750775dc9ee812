"""``fsdp-plan bench --baseline no-overlap``: what overlapping communication with the backward
bought, from the plan run twice on the same workers.

[Note: the overlap verdict]
The plan is profiled as written, then again with its gradient communication held off the
backward's compute (measure/no_overlap.py [Note: holding communication until compute is
done]). From the median profiled step of each (measure/profile.py):

- backward duration = the backward phase plus the communication tail after it (``backward_s +
  comm_tail_s``): from the first backward op to the end of the last gradient collective;
- backward compute = wall time with a backward compute op running;
- hidden = the overlapped run's backward communication with backward compute beside it;
- contention = backward compute with overlap minus backward compute without it: how much the
  compute slowed down for sharing the machine with the collectives.

Overlap saves ``hidden - contention``: hiding communication takes it off the critical path,
and the slower compute puts some of it back. Compute that ran faster beside communication
(a negative contention) is the run's noise, not a gain of overlap: the verdict counts it as no
contention and says so, and ``contention_s`` keeps the measured difference. The verdict says so in one sentence,
"overlap saves 12 ms of 80" (of the backward without overlap) or "overlap costs 3 ms: backward
slowed 9 ms to hide 6". It is a pure function of ``OverlapFigures``, so it is tested without a
run. The planner's backward contention (cost/step_time.py ``StepTime.backward_contention_s``,
from the hardware's ``contention``) is printed beside the measured contention.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

BASELINES = ("no-overlap",)
"""The values ``--baseline`` takes."""


def held_refusal(plan: Any) -> tuple[str, str] | None:
    """Why measure/no_overlap.py cannot hold this plan's communication, and the plan field
    whose removal would let it; None when it can. It holds a DDP plan's buckets with a
    communication hook of its own, and DDP takes one hook: a plan with its own ``comm_hook``,
    or stepping its optimizer in backward (DDP's hook too), has no held twin. (FSDP1, which
    ``bench --fsdp1`` runs, is refused by the caller.)"""
    if plan.strategy != "ddp":
        return None
    hook = plan.ddp.comm_hook if plan.ddp else None
    if hook:
        why = (f"already has ddp.comm_hook: {hook} (DDP takes one hook, and a baseline without "
               f"{hook} would be another plan)")
        return why, "comm_hook"
    if plan.optimizer_overlap:
        why = ("steps its optimizer in backward (optimizer_overlap), which is DDP's "
               "communication hook already (DDP takes one)")
        return why, "optimizer_overlap"
    return None


@dataclass(frozen=True, kw_only=True)
class OverlapFigures:
    """One plan's backward measured with overlap and with communication held (seconds)."""

    backward_overlapped_s: float
    """Backward plus its communication tail, as the plan runs."""
    backward_held_s: float
    """The same with communication held until compute is done."""
    compute_overlapped_s: float
    """Backward compute with communication beside it."""
    compute_held_s: float
    """Backward compute alone."""
    hidden_s: float
    """Backward communication hidden behind backward compute, as the plan runs."""
    predicted_contention_s: float | None = None
    """The cost model's ``StepTime.backward_contention_s`` for the plan (None: not
    predicted)."""

    @property
    def contention_s(self) -> float:
        """What overlap cost the compute: ``compute_overlapped_s - compute_held_s``."""
        return self.compute_overlapped_s - self.compute_held_s

    @property
    def saved_s(self) -> float:
        """Net gain of overlap: ``hidden_s - contention_s``, a negative contention counted as
        none (negative: overlap costs time)."""
        return self.hidden_s - max(0.0, self.contention_s)

    def to_dict(self) -> dict[str, Any]:
        return {**{k: (round(v, 9) if isinstance(v, float) else v)
                   for k, v in asdict(self).items()},
                "contention_s": round(self.contention_s, 9), "saved_s": round(self.saved_s, 9),
                "verdict": verdict(self)}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}"


def verdict(figures: OverlapFigures) -> str:
    """One sentence on whether overlap paid ([Note: the overlap verdict])."""
    if figures.saved_s >= 0:
        noise = (f" (backward compute measured {_ms(-figures.contention_s)} ms faster beside "
                 "communication: noise of the run, counted as no contention)"
                 if figures.contention_s < 0 else "")
        return (f"overlap saves {_ms(figures.saved_s)} ms of {_ms(figures.backward_held_s)}"
                + noise)
    return (f"overlap costs {_ms(-figures.saved_s)} ms: backward slowed "
            f"{_ms(figures.contention_s)} ms to hide {_ms(figures.hidden_s)}")


def overlap_figures(overlapped: dict[str, Any], held: dict[str, Any],
                    predicted_contention_s: float | None = None) -> OverlapFigures:
    """The figures of rank 0's two profiled runs, each ``{"comm": CommTiming.to_dict(),
    "phases_s": {...}}`` as the bench worker returns them."""
    def backward(run: dict[str, Any]) -> float:
        phases = run.get("phases_s") or {}
        return float(phases.get("backward", 0.0)) + float(phases.get("tail", 0.0))
    return OverlapFigures(
        backward_overlapped_s=backward(overlapped), backward_held_s=backward(held),
        compute_overlapped_s=float(overlapped["comm"].get("backward_compute_s", 0.0)),
        compute_held_s=float(held["comm"].get("backward_compute_s", 0.0)),
        hidden_s=float(overlapped["comm"].get("backward_hidden_s", 0.0)),
        predicted_contention_s=predicted_contention_s)


def report_lines(overlap: dict[str, Any]) -> list[str]:
    """The report's lines for a result's ``overlap`` block (``OverlapFigures.to_dict``)."""
    def secs(key: str) -> str:
        value = overlap.get(key)
        return "-" if value is None else f"{value * 1e3:.2f} ms"
    predicted = overlap.get("predicted_contention_s")
    return [
        f"baseline no-overlap ({overlap.get('how', 'communication held')}):",
        (f"  backward with overlap {secs('backward_overlapped_s')}, without "
         f"{secs('backward_held_s')} (backward + communication tail, profiled step)"),
        (f"  backward compute with overlap {secs('compute_overlapped_s')}, without "
         f"{secs('compute_held_s')}; hidden communication {secs('hidden_s')}"),
        (f"  contention: measured {secs('contention_s')}, predicted "
         + ("-" if predicted is None else f"{predicted * 1e3:.2f} ms")
         + " (the cost model's backward contention)"),
        f"verdict: {overlap.get('verdict')}",
    ]
