"""What a page and a snapshot show, gathered as plain data from a plan, its prediction and its
measurements (``gather``); html.py draws it, snapshot.py writes it.

Every verb that draws (plan, predict, verify, bench, tune) predicts its plan with
``api.predict`` first: the memory series is that prediction's timeline (series.py), so the
page's peak is the plan's ``predicted.peak_bytes`` whichever verb drew it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from fsdp_plan.common.sizes import format_bytes
from fsdp_plan.cost.step_time import StepTime
from fsdp_plan.pictures.series import (
    StepSeries,
    event_times,
    measured_curve,
    plan_timeline,
    step_series,
)
from fsdp_plan.pictures.snapshot import predicted_snapshot

if TYPE_CHECKING:
    from fsdp_plan.api import Prediction
    from fsdp_plan.facts.types import ModelFacts, ModuleGraph
    from fsdp_plan.measure.recording import MemoryRecord
    from fsdp_plan.plan.document import Plan
    from fsdp_plan.search.candidate import Candidate
    from fsdp_plan.search.frontier import Frontier


@dataclass(kw_only=True)
class Page:
    """Everything one page shows."""

    title: str
    header: list[str]
    legend: str
    budget_bytes: int
    limit_bytes: int
    series: StepSeries
    time: StepTime
    measured: tuple[list[float], list[int]] | None = None
    measured_label: str = ""
    frontier: Frontier | None = None
    measured_streams: dict[str, list[tuple[float, float]]] | None = None
    """Measured compute, communication and exposed intervals (seconds into the step)."""
    blocks: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def block_rows(candidate: Candidate, graph: ModuleGraph) -> list[dict[str, Any]]:
    """Per repeated block: the unit holding it, its checkpointing mode, the activation bytes
    that mode keeps out of memory and its recompute seconds (search.py ``BlockMode``)."""
    modes = {m.block: m for m in candidate.block_modes}
    owner: dict[str, str] = {}
    for u in candidate.units:
        for m in u.modules:
            owner[m] = "+".join(u.modules) if u.modules != [""] else "<root>"
    rows = []
    for block in graph.blocks:
        unit = owner.get(block)
        parent = block
        while unit is None and parent:
            parent = parent.rpartition(".")[0]
            unit = owner.get(parent)
        mode = modes.get(block)
        rows.append({"block": block, "unit": unit or "<root>",
                     "mode": mode.mode if mode else "none",
                     "saved_bytes": mode.saved_bytes if mode else 0,
                     "recompute_s": mode.recompute_s if mode else 0.0})
    return rows


def gather(*, title: str, plan: Plan, facts: ModelFacts, prediction: Prediction,
           header: list[str], legend: str = "", frontier: Frontier | None = None,
           record: MemoryRecord | None = None, measured_label: str = "",
           measured_streams: dict[str, list[tuple[float, float]]] | None = None,
           notes: list[str] | None = None) -> tuple[Page, Any]:
    """The page of ``plan`` as predicted (and measured, given ``record`` or the streams),
    and the memory model's timeline it was drawn from (for the snapshot)."""
    candidate = prediction.candidate
    timeline = plan_timeline(plan, facts, prediction)
    series = step_series(timeline, candidate.time)
    measured = measured_curve(record, series) if record is not None else None
    notes = list(notes or [])
    stored = (plan.predicted or {}).get("peak_bytes")
    if stored is not None and stored != series.peak_bytes:
        notes.append(f"the plan file's stored peak {format_bytes(stored)} is not what the plan "
                     f"predicts now ({format_bytes(series.peak_bytes)}); the pictures show "
                     "the prediction as it is now.")
    page = Page(title=title, header=header, legend=legend, budget_bytes=plan.budget_bytes,
                limit_bytes=plan.budget_bytes - plan.headroom_bytes, series=series,
                time=candidate.time, measured=measured, measured_label=measured_label,
                frontier=frontier, measured_streams=measured_streams,
                blocks=block_rows(candidate, facts.graph), notes=notes)
    return page, timeline


def predicted_snapshot_of(timeline: Any, time: StepTime) -> dict[str, Any]:
    """The predicted snapshot of a timeline, stamped with the predicted clock."""
    return predicted_snapshot(timeline, event_times(timeline, time))
