"""A rank's trace as a timeline of device work, each piece with its kind, phase and step.

Input: ``RawTrace`` (trace_read.py). Output: ``Timeline``, the activities (GPU kernels,
copies and memsets; or, on a CPU run, the outermost ``aten::`` ops and gloo's collectives)
and the profiler steps with the window of device time each owns.

[Note: steps, phases and activities]
- Steps are the ``ProfilerStep#N`` annotations ``torch.profiler``'s ``step()`` writes. A GPU
  activity belongs to the step in which the host launched it: its kernel shares
  ``correlation`` with a ``cuda_runtime`` launch, whose time falls in one step. A CPU
  activity belongs to the step its own start falls in.
- Step N's device window runs from the end of step N-1's device work to the end of its own
  (never before its annotation's end), so windows tile the device's time: a collective that
  runs on into the next step's forward is that step's time, as a step timer sees it.
- The first step is dropped (warm-up: allocator, NCCL communicators, DDP's bucket rebuild),
  and the last one when the trace cut it off: a launch in it has no kernel in the trace.
- Phase of a launch (or CPU op): ``backward`` on the autograd engine's own threads (those that
  run ``autograd::engine::evaluate_function`` ops and hold no ``ProfilerStep``) or inside
  such an op; ``optimizer`` inside an ``Optimizer.step#...`` annotation; ``forward`` otherwise.
- On a CPU trace no activity of a step ends after the next step's annotation starts
  (``_end_by_next_step``): the host is the device, and a late end is gloo's thread closing
  its record late.
- Communication: NCCL kernels on a GPU (kind from ``args["Collective name"]`` or the kernel's
  name, bytes ``In msg nelems`` x the dtype's size); ``gloo:*`` events on a CPU (bytes from
  their input dims and type), launched by the ``c10d::`` op of the same kind that preceded
  them. Every other activity is compute. On a CPU, ``aten::`` ops inside a ``c10d::`` call
  are the collective's own bookkeeping, not compute.
"""

from __future__ import annotations

import bisect
import math
import re
from dataclasses import dataclass, field
from typing import Any

from fsdp_plan.common.errors import BadInput
from fsdp_plan.measure.intervals import Cover, union
from fsdp_plan.measure.trace_read import RawTrace, TraceEvent

_STEP = re.compile(r"^ProfilerStep#(\d+)$")
_FSDP_UNIT = re.compile(r"^FSDP::(?:all_gather|post_backward_reduce|pre_forward|pre_backward|"
                        r"post_forward|post_backward)(?: \((.*)\))?$")
"""FSDP2's ``record_function`` names carry their unit, ``FSDP::all_gather (layers.0)``; the
root's have none (its FQN is empty): ``FSDP::all_gather``."""
_GLOO_RUNS = {"all_reduce": ("reduce_scatter",)}
"""c10d kinds gloo runs as another collective: its reduce-scatter is an all-reduce."""
_NCCL_KIND = re.compile(r"nccl(?:Dev)?Kernel_([A-Za-z]+)")
_LAUNCHES = ("LaunchKernel", "MemcpyAsync", "MemsetAsync", "LaunchCooperativeKernel")
DTYPE_BYTES = {"float": 4, "float32": 4, "int": 4, "int32": 4, "uint32": 4, "double": 8,
               "float64": 8, "long": 8, "int64": 8, "long int": 8, "half": 2, "float16": 2,
               "bfloat16": 2, "c10::bfloat16": 2, "c10::half": 2, "short": 2, "int16": 2,
               "char": 1, "int8": 1, "uint8": 1, "unsigned char": 1, "bool": 1, "byte": 1,
               "float8_e4m3fn": 1, "float8_e5m2": 1, "signed char": 1}


@dataclass(slots=True)
class Activity:
    """One piece of device work (microseconds, as in the trace)."""

    name: str
    start: float
    end: float
    comm: bool
    compute: bool
    """A compute kernel (or CPU op); copies and memsets are neither compute nor comm."""
    step: int | None
    """The index in ``Timeline.steps`` of the step that launched it."""
    phase: str
    launch: float | None = None
    """When the host launched it (GPU), or called the collective (gloo); None when unknown."""
    kind: str | None = None
    """A collective's kind in c10d's words (``all_reduce``, ``all_gather``, ...)."""
    nbytes: int | None = None
    stream: Any = None
    unit: str | None = None
    """The FSDP unit (module FQN) whose ``FSDP::... (fqn)`` annotation issued a collective."""


@dataclass(kw_only=True)
class Step:
    number: int
    index: int
    """Its place in ``Timeline.steps``."""
    annotation: tuple[float, float]
    window: tuple[float, float] = (0.0, 0.0)
    complete: bool = True


@dataclass(kw_only=True)
class Timeline:
    rank: int | None
    world_size: int | None
    device: str
    source: str
    """``gpu`` (kernels) or ``cpu`` (aten ops and gloo threads)."""
    activities: list[Activity]
    steps: list[Step]
    stable: list[Step] = field(default_factory=list)


_KINDS = {"allreduce": "all_reduce", "allgather": "all_gather", "reducescatter": "reduce_scatter",
          "alltoall": "all_to_all", "alltoallv": "all_to_all", "sendrecv": "send_recv"}


def collective_kind(name: str) -> str:
    """A collective's kind in c10d's words, from a kernel's ``AllReduce``, a profiler's
    ``allreduce`` or ``_allgather_base``, or gloo's ``all_reduce``: ``all_reduce``,
    ``all_gather``, ``reduce_scatter``, ``all_to_all``, ``broadcast``, ``send_recv``, ..."""
    key = name.lower().strip("_")
    for suffix in ("_coalesced", "_into_tensor", "_tensor", "_base", "_single", "_"):
        key = key.removesuffix(suffix)
    key = key.replace("_", "")
    return _KINDS.get(key, key)


def _nbytes(nelems: Any, dtype: Any) -> int | None:
    size = DTYPE_BYTES.get(str(dtype).lower()) if dtype is not None else None
    if isinstance(nelems, int) and size:
        return nelems * size
    return None


def _gloo_bytes(args: dict[str, Any] | None) -> int | None:
    """Bytes of a gloo event's (or a ``c10d::`` op's) first tensor input."""
    dims, types = (args or {}).get("Input Dims"), (args or {}).get("Input type")
    while isinstance(dims, list) and dims and isinstance(dims[0], list) and dims[0] and \
            isinstance(dims[0][0], list):
        dims = dims[0]
    if not (isinstance(dims, list) and dims and isinstance(dims[0], list) and types):
        return None
    kind = str(types[0]).lower()
    if kind == "tensorlist":
        return None
    numel = math.prod(int(d) for d in dims[0]) if all(isinstance(d, int) for d in dims[0]) else None
    return _nbytes(numel, kind)


class _Phases:
    """The phase of a host timestamp on a thread ([Note: steps, phases and activities])."""

    def __init__(self, events: list[TraceEvent], step_threads: set[Any]) -> None:
        backward: dict[Any, list] = {}
        for e in events:
            if e.name.startswith("autograd::engine::evaluate_function"):
                backward.setdefault((e.pid, e.tid), []).append((e.ts, e.end))
        self.engine_threads = set(backward) - step_threads
        self.backward = {t: Cover(union(v)) for t, v in backward.items()}
        self.optimizer = Cover(union((e.ts, e.end) for e in events
                                     if e.name.startswith("Optimizer.step#")))
        fsdp: dict[Any, list[tuple[float, float, str]]] = {}
        for e in events:
            m = _FSDP_UNIT.match(e.name)
            if m:
                fsdp.setdefault((e.pid, e.tid), []).append((e.ts, e.end, m.group(1) or ""))
        self.fsdp = {t: sorted(v) for t, v in fsdp.items()}
        self.fsdp_starts = {t: [x[0] for x in v] for t, v in self.fsdp.items()}

    def unit(self, thread: Any, ts: float) -> str | None:
        """The unit of the innermost ``FSDP::<what> (<fqn>)`` annotation around ``ts`` (they
        nest properly on a thread: the latest-starting one that contains ``ts``)."""
        spans = self.fsdp.get(thread)
        if not spans:
            return None
        i = bisect.bisect_right(self.fsdp_starts[thread], ts) - 1
        while i >= 0:
            start, end, fqn = spans[i]
            if end >= ts:
                return fqn
            i -= 1
        return None

    def at(self, thread: Any, ts: float) -> str:
        if thread in self.engine_threads:
            return "backward"
        cover = self.backward.get(thread)
        if cover is not None and cover.overlaps(ts, ts):
            return "backward"
        return "optimizer" if self.optimizer.overlaps(ts, ts) else "forward"


def _steps(events: list[TraceEvent], path: str) -> tuple[list[Step], set[Any]]:
    marks = sorted(((int(m.group(1)), e) for e in events
                    if e.cat == "user_annotation" and (m := _STEP.match(e.name))),
                   key=lambda p: p[1].ts)
    if not marks:
        raise BadInput(f"trace {path!r} has no ProfilerStep#N annotations, so its steps cannot "
                       "be told apart: call prof.step() once per training step inside the "
                       "torch.profiler.profile context (or use its schedule=).")
    threads = {(e.pid, e.tid) for _, e in marks}
    return [Step(number=n, index=i, annotation=(e.ts, e.end))
            for i, (n, e) in enumerate(marks)], threads


def build_timeline(raw: RawTrace) -> Timeline:
    """The activities and steps of one rank's trace (see [Note: steps, phases and activities])."""
    events = raw.events
    steps, step_threads = _steps(events, raw.path)
    starts = [s.annotation[0] for s in steps]

    def step_at(ts: float) -> int | None:
        i = bisect.bisect_right(starts, ts) - 1
        return i if i >= 0 else None
    phases = _Phases(events, step_threads)
    device = [e for e in events if e.is_device]
    if device:
        acts, unmatched = gpu_activities(events, device, phases, step_at)
        source, name = "gpu", raw.device or "gpu"
    else:
        acts, unmatched = cpu_activities(events, phases, step_at), set()
        source, name = "cpu", "cpu"
        _end_by_next_step(acts, steps)
    if not acts:
        raise BadInput(f"trace {raw.path!r} holds no GPU kernels and no CPU operators "
                       "(aten::*): record it with activities=[ProfilerActivity.CPU, "
                       "ProfilerActivity.CUDA] around real training steps.")
    _set_windows(steps, acts, unmatched)
    timeline = Timeline(rank=raw.rank, world_size=raw.world_size, device=name, source=source,
                        activities=acts, steps=steps)
    timeline.stable = [s for s in steps[1:] if s.complete]
    return timeline


def gpu_activities(events: list[TraceEvent], device: list[TraceEvent], phases,
                   step_at) -> tuple[list[Activity], set[int | None]]:
    """The GPU work of ``device`` events with its launches' phase (``phases.at(thread, ts)``)
    and step (``step_at(ts)``); and the steps holding a launch whose kernel is not in the
    trace."""
    launches = {e.correlation: e for e in events
                if e.cat in ("cuda_runtime", "cuda_driver") and e.correlation is not None}
    acts = []
    seen = set()
    for e in device:
        launch = launches.get(e.correlation) if e.correlation is not None else None
        seen.add(e.correlation)
        ts = launch.ts if launch is not None else e.ts
        phase = phases.at((launch.pid, launch.tid), ts) if launch is not None else "forward"
        args = e.args or {}
        is_comm = e.cat == "kernel" and "nccl" in e.name.lower()
        kind = nbytes = None
        if is_comm:
            named = args.get("Collective name")
            match = _NCCL_KIND.search(e.name)
            kind = collective_kind(str(named) if named else (match.group(1) if match else "nccl"))
            nbytes = _nbytes(args.get("In msg nelems"), args.get("dtype"))
        acts.append(Activity(e.name, e.ts, e.end, is_comm, e.cat == "kernel" and not is_comm,
                             step_at(ts), phase,
                             launch.ts if launch is not None else None, kind, nbytes,
                             args.get("stream", e.tid),
                             phases.unit((launch.pid, launch.tid), ts)
                             if is_comm and launch is not None else None))
    unmatched = {step_at(e.ts) for c, e in launches.items()
                 if c not in seen and any(k in e.name for k in _LAUNCHES)}
    return acts, unmatched


def cpu_activities(events: list[TraceEvent], phases, step_at) -> list[Activity]:
    """A CPU run's compute (outermost ``aten::`` ops outside collectives) and gloo's
    collectives, with phase and step as in ``gpu_activities``."""
    gloo = sorted((e for e in events if e.name.startswith("gloo:")), key=lambda e: e.ts)
    comm_threads = {(e.pid, e.tid) for e in gloo}
    calls: dict[Any, list[TraceEvent]] = {}
    c10d: dict[Any, list] = {}
    for e in sorted(events, key=lambda e: e.ts):
        if e.name.startswith("c10d::") and (e.pid, e.tid) not in comm_threads:
            c10d.setdefault((e.pid, e.tid), []).append((e.ts, e.end))
            calls.setdefault(collective_kind(e.name.removeprefix("c10d::")), []).append(e)
    inside = {t: Cover(union(v)) for t, v in c10d.items()}
    acts = []
    by_thread: dict[Any, list[TraceEvent]] = {}
    for e in events:
        if e.name.startswith("aten::") and (e.pid, e.tid) not in comm_threads:
            cover = inside.get((e.pid, e.tid))
            if cover is None or not cover.overlaps(e.ts, e.end):
                by_thread.setdefault((e.pid, e.tid), []).append(e)
    for thread, items in by_thread.items():
        items.sort(key=lambda e: (e.ts, -e.dur))
        reach = float("-inf")
        for e in items:  # the outermost ops only: nested ones are inside their caller's time
            if e.ts >= reach:
                acts.append(Activity(e.name, e.ts, e.end, False, True, step_at(e.ts),
                                     phases.at(thread, e.ts), e.ts, stream=thread[1]))
                reach = e.end
    taken: dict[str, int] = {}
    for e in gloo:  # each gloo collective was called by the next unclaimed c10d op of its kind
        kind = collective_kind(e.name.removeprefix("gloo:"))
        heads = [(calls[k][taken.get(k, 0)].ts, k) for k in (kind, *_GLOO_RUNS.get(kind, ()))
                 if taken.get(k, 0) < len(calls.get(k, ()))
                 and calls[k][taken.get(k, 0)].ts <= e.end]
        call = None
        if heads:
            _, k = min(heads)
            call, kind = calls[k][taken.get(k, 0)], k
            taken[k] = taken.get(k, 0) + 1
        caller = call if call is not None else e
        at = caller.ts
        phase = phases.at((caller.pid, caller.tid), at)
        acts.append(Activity(e.name, e.ts, e.end, True, False, step_at(at), phase, at, kind,
                             _gloo_bytes(e.args), e.tid, phases.unit((caller.pid, caller.tid), at)))
    return acts


def _end_by_next_step(acts: list[Activity], steps: list[Step]) -> None:
    """On a CPU trace the host is the device: once the next ``ProfilerStep`` has begun, the
    host had every result its step waited for, so no work of a step ends after the next one
    starts. Gloo's thread closes a collective's record only when it is scheduled again after
    marking the work done, which under load is milliseconds after the waiting thread moved on
    (measured: 3.9 ms past, which would have put the next step's whole forward in this
    step's window)."""
    for a in acts:
        if a.step is not None and a.step + 1 < len(steps):
            a.end = max(a.start, min(a.end, steps[a.step + 1].annotation[0]))


def _set_windows(steps: list[Step], acts: list[Activity], unmatched: set[int | None]) -> None:
    """Each step's device window and completeness ([Note: steps, phases and activities])."""
    ends = [s.annotation[1] for s in steps]
    for a in acts:
        if a.step is not None and a.end > ends[a.step]:
            ends[a.step] = a.end
    previous = steps[0].annotation[0]
    for i, step in enumerate(steps):
        end = max(ends[i], previous)
        step.window = (previous, end)
        previous = end
    if steps and (len(steps) - 1) in unmatched:
        steps[-1].complete = False
