"""Every rank of a profiled run: their stable steps, DDP buckets, and who kept the others
waiting. The analysis behind ``fsdp-plan trace`` (SPEC 8) and bench's profiled step.

Input: trace files or folders of them (one per rank). Output: ``TraceAnalysis``, whose
``to_document()`` is SPEC 8's JSON document.

[Note: stragglers]
A collective completes on every rank at about the same moment, so the rank that arrived last
shows the shortest kernel and every other rank's kernel is longer by the time it waited.
Collectives are matched across ranks by step, kind, bytes and their order among those of the
same kind and bytes; for each matched collective the shortest one's rank is the straggler and
is charged the others' excess durations. Durations, unlike start times, need no clock shared
between hosts. ``waited_by_others_s`` is that charge per stable step (the mean over the steps
every rank has).

[Note: DDP buckets read back]
DDP all-reduces each bucket once per backward, in the order buckets become ready. The median
stable step's backward ``all_reduce`` collectives, in launch order, are its buckets:
``bytes`` from the collective's message size, ``ready_s`` when the host issued it (the
reducer's hook fired: the bucket was ready), ``start_s`` / ``end_s`` on the device, all from
the start of the step's window.
"""

from __future__ import annotations

import os
import statistics
from dataclasses import dataclass, field
from typing import Any

from fsdp_plan.common.errors import BadInput
from fsdp_plan.measure.trace_figures import US, StepFigures, percentile, rank_steps
from fsdp_plan.measure.trace_read import read_trace
from fsdp_plan.measure.trace_steps import Activity, Timeline, build_timeline

TRACE_VERSION = 1
TRACE_SUFFIXES = (".json", ".json.gz")


@dataclass(kw_only=True)
class Bucket:
    bytes: int | None
    ready_s: float | None
    start_s: float
    end_s: float

    def to_dict(self) -> dict[str, Any]:
        def r(v: float | None) -> float | None:
            return None if v is None else round(v, 9)
        return {"bytes": self.bytes, "ready_s": r(self.ready_s), "start_s": r(self.start_s),
                "end_s": r(self.end_s)}


@dataclass(kw_only=True)
class RankFigures:
    """One rank's stable steps and what they show."""

    path: str
    rank: int
    world_size: int
    device: str
    source: str
    steps: list[StepFigures]
    ddp_buckets: list[Bucket]
    collectives_per_step: dict[str, int]
    """Collectives of each kind in the median step (its own launches)."""
    collectives_by_unit: dict[str, dict[str, int]] = field(default_factory=dict)
    """The median step's collectives per FSDP unit, where FSDP2's annotations name them."""
    timeline: Timeline = field(repr=False)
    median_step: int = 0
    activities_by_step: dict[int, list[Activity]] = field(default_factory=dict, repr=False)
    """The activities in each stable step's window (trace_figures.py ``rank_steps``)."""

    @property
    def step_s_p50(self) -> float:
        return percentile([s.step_s for s in self.steps], 0.5)

    @property
    def step_s_p99(self) -> float:
        return percentile([s.step_s for s in self.steps], 0.99)

    def median(self) -> StepFigures:
        return next(s for s in self.steps if s.step == self.median_step)

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "world_size": self.world_size, "device": self.device,
                "steps": [s.to_dict() for s in self.steps],
                "step_s_p50": round(self.step_s_p50, 9), "step_s_p99": round(self.step_s_p99, 9),
                "ddp_buckets": [b.to_dict() for b in self.ddp_buckets]}


@dataclass(kw_only=True)
class TraceAnalysis:
    ranks: list[RankFigures]
    stragglers: list[dict[str, Any]]
    bucket_cap_mb: float | None = None
    predicted: dict[str, Any] | None = None

    def to_document(self) -> dict[str, Any]:
        """SPEC 8's document."""
        return {"fsdp_plan_trace_version": TRACE_VERSION,
                "ranks": [r.to_dict() for r in self.ranks],
                "bucket_cap_mb": self.bucket_cap_mb, "stragglers": self.stragglers,
                "predicted": self.predicted}


def trace_files(paths: list[str]) -> list[str]:
    """The trace files named, each folder standing for the ``.json`` / ``.json.gz`` files in
    it (sorted)."""
    files: list[str] = []
    for path in paths:
        if os.path.isdir(path):
            found = sorted(os.path.join(path, n) for n in os.listdir(path)
                           if n.endswith(TRACE_SUFFIXES) and os.path.isfile(os.path.join(path, n)))
            if not found:
                raise BadInput(f"folder {path!r} holds no .json or .json.gz trace; give the "
                               "folder tensorboard_trace_handler wrote or the trace files.")
            files += found
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise BadInput(f"trace {path!r} does not exist; give profiler trace files "
                           "(.json, .json.gz) or folders of them.")
    return files


def _buckets(rank_steps_acts: list[Activity], window: tuple[float, float], step: int
             ) -> list[Bucket]:
    lo = window[0]
    reduces = sorted((a for a in rank_steps_acts if a.comm and a.kind == "all_reduce"
                      and a.phase == "backward" and a.step == step),
                     key=lambda a: (a.launch if a.launch is not None else a.start, a.start))
    return [Bucket(bytes=a.nbytes, ready_s=None if a.launch is None else (a.launch - lo) * US,
                   start_s=(a.start - lo) * US, end_s=(a.end - lo) * US) for a in reduces]


def analyze_rank(path: str, *, position: int = 0, count: int = 1,
                 limit: int | None = None) -> RankFigures:
    """One rank's figures from its trace file."""
    raw = read_trace(path, limit=limit)
    timeline = build_timeline(raw)
    if not timeline.stable:
        raise BadInput(f"trace {path!r} has {len(timeline.steps)} profiler step(s) and none "
                       "left once the first (warm-up) and a cut-off last step are dropped; "
                       "profile at least 3 steps (torch.profiler.schedule(active=3) or more).")
    steps, by_step = rank_steps(timeline)
    p50 = percentile([s.step_s for s in steps], 0.5)
    median = min(steps, key=lambda s: (abs(s.step_s - p50), s.step))
    window = next(s.window for s in timeline.stable if s.number == median.step)
    acts = by_step[median.step]
    kinds: dict[str, int] = {}
    units: dict[str, dict[str, int]] = {}
    for a in acts:
        if a.comm and a.step is not None and timeline.steps[a.step].number == median.step:
            kinds[a.kind or "?"] = kinds.get(a.kind or "?", 0) + 1
            if a.unit is not None:
                per = units.setdefault(a.unit, {})
                per[a.kind or "?"] = per.get(a.kind or "?", 0) + 1
    index = next(i for i, s in enumerate(timeline.steps) if s.number == median.step)
    return RankFigures(path=path, rank=raw.rank if raw.rank is not None else position,
                       world_size=raw.world_size if raw.world_size is not None else count,
                       device=timeline.device, source=timeline.source, steps=steps,
                       ddp_buckets=_buckets(acts, window, index), collectives_per_step=kinds,
                       collectives_by_unit=units, timeline=timeline,
                       median_step=median.step, activities_by_step=by_step)


def stragglers(ranks: list[RankFigures]) -> list[dict[str, Any]]:
    """Each rank's ``waited_by_others_s`` per step ([Note: stragglers]), largest first."""
    if len(ranks) < 2:
        return []
    common = set.intersection(*({s.step for s in r.steps} for r in ranks))
    if not common:
        return []
    keyed: list[dict[tuple, float]] = []
    for r in ranks:
        numbers = {i: s.number for i, s in enumerate(r.timeline.steps)}
        seen: dict[tuple, int] = {}
        mine: dict[tuple, float] = {}
        for a in sorted((a for a in r.timeline.activities if a.comm and a.step is not None
                         and numbers[a.step] in common), key=lambda a: a.start):
            sig = (numbers[a.step], a.kind, a.nbytes)
            seen[sig] = seen.get(sig, 0) + 1
            mine[sig + (seen[sig],)] = a.end - a.start
        keyed.append(mine)
    charge = {r.rank: 0.0 for r in ranks}
    for key in set.intersection(*(set(k) for k in keyed)):
        durations = [k[key] for k in keyed]
        shortest = min(durations)
        last = ranks[durations.index(shortest)].rank
        charge[last] += sum(d - shortest for d in durations)
    return [{"rank": rank, "waited_by_others_s": round(total * US / len(common), 9)}
            for rank, total in sorted(charge.items(), key=lambda kv: (-kv[1], kv[0]))]


def analyze_traces(paths: list[str], *, limit: int | None = None) -> TraceAnalysis:
    """The figures of every rank's trace under ``paths`` (files or folders)."""
    files = trace_files(paths)
    ranks = [analyze_rank(f, position=i, count=len(files), limit=limit)
             for i, f in enumerate(files)]
    worlds = {r.world_size for r in ranks}
    if len(worlds) > 1:
        listed = ", ".join(f"{os.path.basename(r.path)}: {r.world_size}" for r in ranks)
        raise BadInput(f"the traces come from runs of different world sizes ({listed}); give "
                       "the traces of one run, one file per rank.")
    by_rank: dict[int, str] = {}
    for r in ranks:
        if r.rank in by_rank:
            raise BadInput(f"traces {by_rank[r.rank]!r} and {r.path!r} are both rank {r.rank}; "
                           "give one trace per rank of one run (a folder of several profiling "
                           "cycles holds several per rank: pick one cycle).")
        by_rank[r.rank] = r.path
    ranks.sort(key=lambda r: r.rank)
    return TraceAnalysis(ranks=ranks, stragglers=stragglers(ranks))


def median_of(ranks: list[RankFigures], name: str) -> float:
    """The median over ranks of a figure of each rank's median step."""
    return statistics.median(getattr(r.median(), name) for r in ranks)
