"""DDP plans: gradient buckets, memory and step time from the same facts and clock as FSDP.

When the unsharded model states and the activations fit on one GPU, plain
``DistributedDataParallel`` gathers no parameters: its only collective is the gradient
all-reduce, one per bucket, issued during backward. Its knob is ``bucket_cap_mb``: small
buckets start early but pay launch and latency per all-reduce; large ones start late and
leave a tail after backward. This module predicts the buckets exactly as DDP builds them,
when each becomes ready, the all-reduce schedule on the communication stream, the per-rank
memory, and picks the cap with the lowest step time. Pure functions over ``ModelFacts``.

[Note: DDP buckets] (read in torch 2.13 ``nn/parallel/distributed.py`` and the C++ reducer;
checked on gloo with 2 processes by ``fsdp_plan.measure.ddp`` for tiny Llama, GPT-2 with
tied embeddings, a ResNet and a model with an unused parameter)
- Parameters: ``named_modules()`` order, each module's ``named_parameters(recurse=False)``,
  a tied parameter once, at its first owner (``_build_params_for_reducer``); ``ModuleInfo``
  keeps exactly that (``param_shapes`` at the first owner).
- The first iteration uses one bucket (``static_graph`` or not ``find_unused_parameters``) or
  reverse parameter order. At the end of the first backward the reducer records the order in
  which gradients became ready, and at the start of the second forward it rebuilds the buckets
  over that order with ``compute_bucket_assignment_by_size``: a greedy walk that closes a
  bucket as soon as its bytes reach the limit (``>=``, the parameter that crosses the limit
  included), the first bucket against ``first_bucket_bytes_cap``, every later one against
  ``bucket_bytes_cap``. Buckets are kept per dtype; this model has one gradient dtype.
- The first bucket's cap is ``dist._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB) only when
  ``bucket_cap_mb`` is left at its default (None, 25 MiB); an explicit ``bucket_cap_mb``
  makes the first bucket as large as the others. Any other pair needs
  ``bucket_cap_mb_list=[first, cap]`` (torch >= 2.13), whose list is used for both bucketings.
- With ``find_unused_parameters`` (and no ``static_graph``) the reducer never rebuilds
  (``should_rebuild_buckets``): the buckets stay the first bucketing, which walks the
  parameters in order with the same limits and reverses the bucket list (the first-defined
  parameters, whose gradients come last, end in the last, smallest-capped bucket); the
  logged ``bucket_sizes`` is then the truth. After the last bucket the reducer all-reduces
  its used-parameter map (one more ``allreduce_``).
- ``rebuilt_bucket_sizes`` in ``_get_ddp_logging_data()`` lists each bucket's bytes
  (numel x element size, no padding) in that order; that is ``predicted.buckets``.

[Note: gradient ready order]
A parameter's gradient is ready when its ``AccumulateGrad`` node runs, right after the last
backward op that uses it (autograd runs accumulation nodes first). From the analysis
timeline: the module's last ``pre_bw`` (its backward ops start there; a module called twice
is ready after its earlier call's backward), a parameter registered on a container (not a
leaf) at the container's last ``post_bw``, a tied parameter at the latest of its modules,
and a parameter whose modules never ran backward is unused. Within one module, ``Linear``
(and ``Conv1D``) gives its bias first (the add's backward runs before the matmul's), while
fused kernels (norms, convolutions with bias) accumulate in registration order.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from fsdp_plan.cost.hardware import Hardware
from fsdp_plan.cost.memory import OPTIMIZER_STATES, MemoryEstimate, Precision
from fsdp_plan.cost.step_time import StepTime, collective_time, ranks_per_node_in
from fsdp_plan.cost.units import build_units
from fsdp_plan.facts.types import Analysis, Event, ModuleGraph
from fsdp_plan.search.fsdp import Candidate, SearchSettings

MIB = 1 << 20
DEFAULT_BUCKET_CAP_MB = 25
"""DDP's ``bucket_cap_mb`` default (``_DEFAULT_BUCKET_CAP_MB``), MiB."""
DEFAULT_FIRST_BUCKET_MB = 1
"""``dist._DEFAULT_FIRST_BUCKET_BYTES`` (1 MiB): the first bucket's cap under the default."""
CAP_GRID_MB = (1, 2, 5, 10, 25, 50, 100, 200, 400)
"""Bucket caps the search tries (MiB)."""
BIAS_FIRST_CLASSES = frozenset({"Linear", "NonDynamicallyQuantizableLinear", "LazyLinear",
                                "Conv1D"})
"""Module classes whose bias gradient is ready before the weight's ([Note: gradient ready
order])."""


@dataclass(kw_only=True, frozen=True)
class DDPConfig:
    """The ``DistributedDataParallel`` arguments a plan sets (SPEC 6 ``ddp``)."""

    bucket_cap_mb: int = DEFAULT_BUCKET_CAP_MB
    first_bucket_mb: int = DEFAULT_FIRST_BUCKET_MB
    gradient_as_bucket_view: bool = True
    """Gradients are views into the buckets: no second copy of them."""
    static_graph: bool = False
    find_unused_parameters: bool = False
    comm_hook: str | None = None
    """``bf16_compress`` (``default_hooks.bf16_compress_hook``: half the bytes) or None."""

    @property
    def limits(self) -> list[int]:
        """The reducer's bucket size limits at the rebuild, bytes."""
        return [self.first_bucket_mb * MIB, self.bucket_cap_mb * MIB]

    def to_dict(self) -> dict[str, Any]:
        out = {"bucket_cap_mb": self.bucket_cap_mb, "first_bucket_mb": self.first_bucket_mb,
               "gradient_as_bucket_view": self.gradient_as_bucket_view,
               "static_graph": self.static_graph,
               "find_unused_parameters": self.find_unused_parameters}
        if self.comm_hook:
            out["comm_hook"] = self.comm_hook
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> DDPConfig:
        raw = dict(raw or {})
        return cls(**{k: raw[k] for k in ("bucket_cap_mb", "first_bucket_mb",
                                          "gradient_as_bucket_view", "static_graph",
                                          "find_unused_parameters", "comm_hook") if k in raw})


@dataclass(kw_only=True)
class GradParam:
    """One parameter as DDP's reducer sees it."""

    index: int
    """Its index in DDP's parameter list."""
    module: str
    position: int
    """Its place among the parameters registered directly on ``module``."""
    numel: int
    nbytes: int
    ready_event: int | None = None
    """Timeline event that orders it among the ready gradients; None when it gets none."""
    ready_at: int | None = None
    """Timeline event whose time is when its gradient is ready (after its module's ops)."""


@dataclass(kw_only=True)
class Bucket:
    """One gradient bucket after DDP's rebuild."""

    params: list[int]
    nbytes: int
    ready_event: int
    """The latest ``ready_at`` event of its parameters: its all-reduce may start there."""


@dataclass(kw_only=True)
class DDPEvaluation:
    """Buckets, memory and time of one DDP configuration."""

    config: DDPConfig
    buckets: list[Bucket]
    memory: MemoryEstimate
    time: StepTime
    collectives: dict[str, int]
    unused: list[int] = field(default_factory=list)
    ready_s: list[float] = field(default_factory=list)
    """When each bucket's last gradient is ready (seconds from the step's start)."""


# --- parameters, ready order, buckets ---------------------------------------------------------

def ddp_parameters(graph: ModuleGraph) -> list[GradParam]:
    """DDP's parameter list: ``named_modules()`` order, direct parameters, tied ones once."""
    out: list[GradParam] = []
    for fqn, info in graph.modules.items():
        if not info.param_shapes:
            continue
        total_bytes = sum(info.direct_bytes_by_dtype.values())
        element = max(1, round(total_bytes / info.direct_numel)) if info.direct_numel else 4
        for position, shape in enumerate(info.param_shapes):
            numel = 1
            for dim in shape:
                numel *= int(dim)
            out.append(GradParam(index=len(out), module=fqn, position=position, numel=numel,
                                 nbytes=numel * element))
    return out


def _module_ready_events(graph: ModuleGraph, events: list[Event]
                         ) -> dict[str, tuple[int, int]]:
    """Per module with parameters: (the event ordering its gradients, the event at whose time
    they are ready); absent when its backward never ran. See [Note: gradient ready order]."""
    backward_start = next((i for i, e in enumerate(events) if e.kind == "pre_bw"), len(events))
    last_pre: dict[str, int] = {}
    last_post: dict[str, int] = {}
    for i in range(backward_start, len(events)):
        ev = events[i]
        if ev.kind == "pre_bw":
            last_pre[ev.module] = i
        elif ev.kind == "post_bw":
            last_post[ev.module] = i
    ready: dict[str, tuple[int, int]] = {}
    for fqn, info in graph.modules.items():
        if info.children and fqn in last_post:
            ready[fqn] = (last_post[fqn], last_post[fqn])
        elif fqn in last_pre:
            ready[fqn] = (last_pre[fqn], _after_own_ops(events, last_pre[fqn]))
    for group in graph.tied_groups:
        seen = [ready[m] for m in group if m in ready]
        if seen:
            for m in group:
                ready[m] = max(seen)
    return ready


def _after_own_ops(events: list[Event], at: int) -> int:
    """The first event after module ``events[at]``'s pre-backward that ends its own ops: the
    pre-backward hooks of modules around it fire at the same moment and hold none of them."""
    inner = events[at].module
    j = at + 1
    while j < len(events) - 1 and events[j].kind == "pre_bw" and (
            events[j].module == "" or inner.startswith(events[j].module + ".")):
        j += 1
    return min(j, len(events) - 1)


def grad_parameters(graph: ModuleGraph, events: list[Event]) -> list[GradParam]:
    """``ddp_parameters`` with each one's ready event from the analysis timeline."""
    params = ddp_parameters(graph)
    ready = _module_ready_events(graph, events)
    for p in params:
        if p.module in ready:
            p.ready_event, p.ready_at = ready[p.module]
    return params


def rebuilt_order(graph: ModuleGraph, params: list[GradParam]) -> list[GradParam]:
    """The order DDP's reducer records gradients becoming ready (unused ones first)."""
    unused = [p for p in params if p.ready_event is None]

    def within(p: GradParam) -> int:
        bias_first = graph.modules[p.module].class_name in BIAS_FIRST_CLASSES
        return -p.position if bias_first else p.position
    used = sorted((p for p in params if p.ready_event is not None),
                  key=lambda p: (p.ready_event, within(p)))
    return unused + used


def assign_by_size(sizes: list[int], limits: list[int]) -> list[list[int]]:
    """``compute_bucket_assignment_by_size`` for one dtype: positions into ``sizes`` per bucket.

    A bucket closes once its bytes reach its limit; the first bucket uses ``limits[0]``,
    each next one the next limit, the last limit repeating."""
    buckets: list[list[int]] = []
    current: list[int] = []
    size = 0
    limit_at = 0
    for i, nbytes in enumerate(sizes):
        current.append(i)
        size += nbytes
        if size >= limits[limit_at]:
            buckets.append(current)
            current, size = [], 0
            limit_at = min(limit_at + 1, len(limits) - 1)
    if current:
        buckets.append(current)
    return buckets


def build_buckets(graph: ModuleGraph, events: list[Event], config: DDPConfig,
                  params: list[GradParam] | None = None) -> tuple[list[Bucket], list[GradParam]]:
    """The buckets DDP builds after its rebuild, and its parameters (see [Note: DDP buckets]);
    ``params`` is ``grad_parameters(graph, events)`` when the caller already has it."""
    params = grad_parameters(graph, events) if params is None else params
    last = len(events) - 1
    backward_start = next((i for i, e in enumerate(events) if e.kind == "pre_bw"), last)
    if rebuilds(config):
        order = rebuilt_order(graph, params)
        groups = assign_by_size([p.nbytes for p in order], config.limits)
    else:  # DDP keeps its first bucketing: parameter order, the bucket list reversed
        order = params
        groups = assign_by_size([p.nbytes for p in order], config.limits)[::-1]
    out = []
    for positions in groups:
        members = [order[i] for i in positions]
        # unused parameters are marked ready at the first autograd hook
        ready = max((p.ready_at if p.ready_at is not None else backward_start)
                    for p in members)
        out.append(Bucket(params=[p.index for p in members],
                          nbytes=sum(p.nbytes for p in members), ready_event=ready))
    return out, params


def rebuilds(config: DDPConfig) -> bool:
    """Whether DDP rebuilds its buckets after the first iteration (the reducer's
    ``should_rebuild_buckets``: with ``find_unused_parameters`` and no ``static_graph`` it
    never does, and the first bucketing stays)."""
    return config.static_graph or not config.find_unused_parameters


def unused_parameters(graph: ModuleGraph, analysis: Analysis) -> list[GradParam]:
    """Parameters that get no gradient in the analysed step (DDP needs
    ``find_unused_parameters=True`` for them)."""
    return [p for p in grad_parameters(graph, analysis.timeline.events) if p.ready_event is None]


# --- the clock --------------------------------------------------------------------------------

def _event_times(events: list[Event], hw: Hardware, dtype: str) -> list[float]:
    """Compute seconds from the step's start to each event on the hardware's clock: the ops
    between two boundaries (``Event.ops``) timed as cost.py times a unit's ops."""
    try:
        from fsdp_plan.cost.step_time import Rates, compute_time
        rates = Rates.of(hw, dtype)

        def seconds(ops: Any, flops: float) -> float:
            return compute_time(rates, ops, flops)
    except ImportError:  # a cost.py without per-op rates: FLOPs at peak x efficiency
        def seconds(ops: Any, flops: float) -> float:
            return flops / (hw.peak_flops * hw.efficiency)
    times = [0.0] * len(events)
    for i in range(1, len(events)):
        delta = max(0.0, events[i].flops - events[i - 1].flops)
        times[i] = times[i - 1] + seconds(events[i].ops, delta)
    return times


def _optimizer_seconds(hw: Hardware, optimizer: str, numel: int, orig_bytes: int,
                       dtype: str) -> float:
    states = OPTIMIZER_STATES.get(optimizer, 0)
    try:
        from fsdp_plan.cost.step_time import Rates, optimizer_time
        return optimizer_time(hw, Rates.of(hw, dtype), optimizer, numel, orig_bytes, states)
    except ImportError:
        return numel * orig_bytes * (3 + 2 * states) / hw.hbm_bandwidth


def _step_time(**fields: Any) -> StepTime:
    """A ``StepTime`` with the fields this cost.py knows (``comm_tail_s`` is recent)."""
    known = {f.name for f in dataclasses.fields(StepTime)}
    return StepTime(**{k: v for k, v in fields.items() if k in known})


def ddp_step_time(buckets: list[Bucket], events: list[Event], hw: Hardware, *, world_size: int,
                  gpus_per_node: int, dtype: str, optimizer_s: float,
                  compress: bool = False, used_map_bytes: int = 0,
                  ready_out: list[float] | None = None,
                  event_times: list[float] | None = None) -> StepTime:
    """Forward, then backward with each bucket's all-reduce issued when it is ready and all
    earlier buckets were issued (the reducer launches buckets in order), on one
    communication stream; compute overlapping a collective slows by ``hw.contention`` as in
    [Note: two-stream simulation]. The tail is what is left after backward. Where the
    hardware file says collectives do not overlap compute (``comm_overlaps_compute: false``,
    gloo on a CPU, as the FSDP simulation reads it too) backward waits for each all-reduce,
    counted as exposed communication: the reducer's gloo threads then share the few cores
    backward runs on. ``event_times`` is ``_event_times(events, hw, dtype)`` when the caller
    already has it (the same for every bucket size)."""
    times = _event_times(events, hw, dtype) if event_times is None else event_times
    n = len(events)
    bw_start = next((i for i, e in enumerate(events) if e.kind == "pre_bw"), n - 1)
    forward = times[bw_start]
    local = ranks_per_node_in(world_size, 1, gpus_per_node)
    spans: list[tuple[str, str, float, float]] = [("compute", "FW", 0.0, forward)]
    busy: list[tuple[float, float]] = []
    comm_free = 0.0

    overlaps = getattr(hw, "comm_overlaps_compute", True)

    def issue(label: str, at: float, duration: float) -> None:
        nonlocal comm_free, now, waited
        start = max(at, comm_free)
        comm_free = start + duration
        busy.append((start, comm_free))
        spans.append(("comm", label, start, comm_free))
        if not overlaps:  # gloo on a CPU: the all-reduce takes the cores backward needs
            spans.append(("wait", f"wait {label}", now, comm_free))
            waited += comm_free - now
            now = comm_free

    def overlap(start: float, end: float) -> float:
        return sum(max(0.0, min(end, e) - max(start, s)) for s, e in busy if e > start)

    now, unslowed_at, contention, waited = forward, forward, 0.0, 0.0

    def compute_until(target: float, label: str) -> None:
        nonlocal now, unslowed_at, contention
        duration = max(0.0, target - unslowed_at)
        if duration <= 0:
            return
        slowed = duration * (1 + hw.contention * min(1.0, overlap(now, now + duration)
                                                      / max(duration, 1e-12)))
        contention += slowed - duration
        spans.append(("compute", label, now, now + slowed))
        now += slowed
        unslowed_at = target

    for i, bucket in enumerate(buckets):
        compute_until(times[bucket.ready_event], f"BW to bucket {i}")
        if ready_out is not None:
            ready_out.append(now)
        wire = bucket.nbytes / 2 if compress else bucket.nbytes
        issue(f"AR bucket {i} ({wire / MIB:.1f} MiB)", now,
              collective_time(hw, wire, world_size, "all_reduce", ranks_per_node=local))
    compute_until(times[-1], "BW")
    if used_map_bytes:
        issue("AR used-parameter map", now,
              collective_time(hw, used_map_bytes, world_size, "all_reduce",
                              ranks_per_node=local))
    bw_end = now
    comm_finish = max((e for _, e in busy), default=bw_end)
    tail = max(0.0, comm_finish - bw_end)
    if tail > 0:
        spans.append(("wait", "wait: communication tail", bw_end, comm_finish))
    end = bw_end + tail
    spans.append(("compute", "optimizer", end, end + optimizer_s))
    total_comm = sum(e - s for s, e in busy)
    backward = times[-1] - forward
    return _step_time(step_s=forward + backward + contention + waited + tail + optimizer_s,
                      forward_s=forward, backward_s=backward + contention,
                      exposed_comm_s=waited + tail, total_comm_s=total_comm,
                      optimizer_s=optimizer_s, bubbles_s=waited, contention_s=contention,
                      comm_tail_s=tail, spans=spans)


# --- memory -----------------------------------------------------------------------------------

def ddp_memory(graph: ModuleGraph, analysis: Analysis, precision: Precision, optimizer: str,
               config: DDPConfig, unused: list[GradParam] | None = None) -> MemoryEstimate:
    """Per-rank peak of a steady DDP step (every rank holds everything).

    Always alive: fp32 parameters, the bucket storage (which is the gradients under
    ``gradient_as_bucket_view``; otherwise ``.grad`` is a second copy once backward has
    written it), optimizer states (AdamW: two per parameter and a step count per tensor),
    buffers and inputs. On top: the analysis' activation peak (it already holds each weight
    gradient from the op that makes it until it is accumulated), or the optimizer step's
    temporary (one gradient-sized ``foreach`` buffer, as in memory.py). A plan computing below
    float32 runs under ``torch.autocast``, which keeps a low-precision copy of each weight
    from its forward use to its backward."""
    params = graph.total_param_bytes
    # a parameter that never gets a gradient gets no optimizer state and no step temporary
    if unused is None:
        unused = unused_parameters(graph, analysis)
    trained = params - sum(p.nbytes for p in unused)
    num_tensors = sum(len(m.param_shapes) for m in graph.modules.values()) - len(unused)
    states = OPTIMIZER_STATES.get(optimizer, 0)
    static = {
        "params": params,
        "gradient_buckets": params,
        "optimizer_states": states * trained + (4 * num_tensors if optimizer in ("adamw", "adam")
                                                else 0),
        "buffers": graph.total_buffer_bytes,
        "inputs": analysis.input_bytes,
    }
    if not config.gradient_as_bucket_view:
        static["grads"] = params
    events = analysis.timeline.events
    activations = max((e.peak for e in events), default=0)
    autocast = (graph.total_numel * precision.param_bytes
                if precision.param_bytes < precision.orig_bytes else 0)
    base = sum(static.values())
    step = {**static, "activations": activations}
    if autocast:
        step["autocast_weights"] = autocast
    opt_temp = trained if states else 0
    if base + opt_temp > base + activations + autocast:
        return MemoryEstimate(peak_bytes=base + opt_temp, phase="optimizer step",
                              breakdown={**static, "optimizer_temporaries": opt_temp})
    peak_at = max(range(len(events)), key=lambda i: events[i].peak) if events else 0
    ev = events[peak_at] if events else None
    where = f"{ev.kind} {ev.module or '<root>'}" if ev else "step"
    phase = "backward" if ev and ev.kind.endswith("bw") else "forward"
    return MemoryEstimate(peak_bytes=base + activations + autocast, phase=f"{phase} ({where})",
                          breakdown=step)


# --- evaluation and search --------------------------------------------------------------------

def evaluate_ddp(graph: ModuleGraph, analysis: Analysis, config: DDPConfig, *, hw: Hardware,
                 world_size: int, gpus_per_node: int, precision: Precision, optimizer: str,
                 dtype: str = "bfloat16", params: list[GradParam] | None = None,
                 event_times: list[float] | None = None) -> DDPEvaluation:
    """Buckets, memory, collectives and step time of one DDP configuration (``params``: the
    model's ``grad_parameters``, computed once when several configurations are evaluated)."""
    events = analysis.timeline.events
    buckets, params = build_buckets(graph, events, config, params)
    unused = [p.index for p in params if p.ready_event is None]
    numel = graph.total_numel
    optimizer_s = _optimizer_seconds(hw, optimizer, numel, precision.orig_bytes, dtype)
    ready: list[float] = []
    time = ddp_step_time(buckets, events, hw, world_size=world_size,
                         gpus_per_node=gpus_per_node, dtype=dtype, optimizer_s=optimizer_s,
                         compress=config.comm_hook == "bf16_compress",
                         used_map_bytes=4 * len(params) if config.find_unused_parameters else 0,
                         ready_out=ready, event_times=event_times)
    memory = ddp_memory(graph, analysis, precision, optimizer, config,
                        [p for p in params if p.ready_event is None])
    collectives = {"all_gather": 0, "reduce_scatter": 0,
                   "all_reduce": len(buckets) + (1 if config.find_unused_parameters else 0)}
    if buffer_broadcasts(graph):
        collectives["broadcast"] = buffer_broadcasts(graph)
    return DDPEvaluation(config=config, buckets=buckets, memory=memory, time=time,
                         collectives=collectives, unused=unused, ready_s=ready)


def buffer_broadcasts(graph: ModuleGraph) -> int:
    """Broadcasts DDP issues in each forward to keep buffers equal (``broadcast_buffers``,
    its default): ``_broadcast_coalesced`` sends one per tensor type in chunks of 250 MiB, so
    one for floating buffers and one more for batch norm's int64 ``num_batches_tracked``
    (checked on gloo: 1 for the Llama's rotary table, 2 for the ResNet, none without buffers)."""
    if not graph.total_buffer_bytes:
        return 0
    batch_norm = any("BatchNorm" in m.class_name and m.buffer_bytes
                     for m in graph.modules.values())
    floating = graph.total_buffer_bytes > (8 * sum(1 for m in graph.modules.values()
                                                   if "BatchNorm" in m.class_name
                                                   and m.buffer_bytes))
    chunks = max(1, -(-graph.total_buffer_bytes // (250 * MIB)))
    return (chunks if floating else 0) + (1 if batch_norm else 0)


def config_options(graph: ModuleGraph, analysis: Analysis, *, compress: bool,
                   caps: tuple[int, ...] = CAP_GRID_MB, unused: bool | None = None
                   ) -> list[DDPConfig]:
    """The configurations the search tries: each cap with a first bucket as large (an explicit
    ``bucket_cap_mb``) or of 1 MiB, ``find_unused_parameters`` exactly when a parameter gets no
    gradient. ``static_graph`` stays off: one traced step cannot show that the graph never
    changes (data-dependent control flow), and it changes no bucket or byte here. ``unused``
    (whether any parameter gets no gradient) spares recomputing it when the caller knows."""
    if unused is None:
        unused = bool(unused_parameters(graph, analysis))
    out = []
    for cap in caps:
        for first in sorted({cap, min(cap, DEFAULT_FIRST_BUCKET_MB)}, reverse=True):
            out.append(DDPConfig(bucket_cap_mb=cap, first_bucket_mb=first,
                                 find_unused_parameters=unused,
                                 comm_hook="bf16_compress" if compress else None))
    return out


def best_config(evaluations: list[DDPEvaluation]) -> DDPEvaluation:
    """The fastest configuration; ties go to the one closest to DDP's defaults."""
    def key(e: DDPEvaluation) -> tuple[float, int, int]:
        c = e.config
        default = (c.bucket_cap_mb, c.first_bucket_mb) == (DEFAULT_BUCKET_CAP_MB,
                                                            DEFAULT_FIRST_BUCKET_MB)
        return (round(e.time.step_s, 9), 0 if default else 1, abs(c.bucket_cap_mb - 25))
    return min(evaluations, key=key)


def ddp_api_kwargs(config: DDPConfig) -> dict[str, Any]:
    """The ``DistributedDataParallel`` keyword arguments that build ``config``'s buckets: the
    generated policy's own rule (``policy_runtime.ddp_kwargs``), so both sides agree."""
    from fsdp_plan.policy_runtime import ddp_kwargs
    return ddp_kwargs(config.to_dict())


def describe_buckets(evaluation: DDPEvaluation, limit: int = 12) -> list[str]:
    """Report lines: each bucket's bytes, when it is ready and when its all-reduce runs."""
    ar = [s for s in evaluation.time.spans if s[0] == "comm" and s[1].startswith("AR bucket")]
    lines = []
    ready = evaluation.ready_s or [span[2] for span in ar]
    for i, (bucket, span, at) in enumerate(zip(evaluation.buckets, ar, ready)):
        if i == limit and len(evaluation.buckets) > limit + 1:
            lines.append(f"  ... {len(evaluation.buckets) - limit - 1} more buckets")
            continue
        if limit < i < len(evaluation.buckets) - 1:
            continue
        lines.append(f"  bucket {i:>3}: {bucket.nbytes / MIB:9.2f} MiB, "
                     f"{len(bucket.params):>4} params, ready {at * 1e3:9.3f} ms, all-reduce "
                     f"{span[2] * 1e3:9.3f} -> {span[3] * 1e3:9.3f} ms")
    t = evaluation.time
    bw_end = t.forward_s + t.backward_s
    lines.append(f"  backward ends at {bw_end * 1e3:.3f} ms; communication tail "
                 f"{t.exposed_comm_s * 1e3:.3f} ms (forward {t.forward_s * 1e3:.3f} ms, no "
                 "communication)")
    return lines


# --- candidates beside FSDP's, plans, predictions ---------------------------------------------

@dataclass(kw_only=True)
class DDPCandidate(Candidate):
    """A DDP plan evaluated on the same memory budget and clock as the FSDP candidates."""

    ddp: DDPEvaluation


def _candidate(graph: ModuleGraph, evaluation: DDPEvaluation, settings: SearchSettings,
               name: str) -> DDPCandidate:
    root = build_units(graph, [[""]], [False], 1)
    return DDPCandidate(
        name=name, strategy="ddp", replicate=settings.world_size, shard=1, units=root,
        checkpointed=[], forward_prefetch=0, backward_prefetch=1, memory=evaluation.memory,
        time=evaluation.time, collectives=dict(evaluation.collectives),
        collectives_fsdp1=dict(evaluation.collectives),
        fits=evaluation.memory.peak_bytes <= settings.limit_bytes, ddp=evaluation)


def _label(config: DDPConfig) -> str:
    first = (f", first {config.first_bucket_mb:g} MiB"
             if config.first_bucket_mb != config.bucket_cap_mb else "")
    hook = ", bf16 all-reduce" if config.comm_hook else ""
    return f"ddp buckets {config.bucket_cap_mb:g} MiB{first}{hook}"


def evaluate_settings(graph: ModuleGraph, analysis: Analysis, settings: SearchSettings,
                      config: DDPConfig, params: list[GradParam] | None = None,
                      event_times: list[float] | None = None) -> DDPEvaluation:
    """``evaluate_ddp`` with the search's settings."""
    assert settings.hardware is not None
    return evaluate_ddp(graph, analysis, config, hw=settings.hardware,
                        world_size=settings.world_size, gpus_per_node=settings.gpus_per_node,
                        precision=settings.precision, optimizer=settings.optimizer,
                        dtype=analysis.param_dtype, params=params, event_times=event_times)


def ddp_candidates(graph: ModuleGraph, analysis: Analysis, settings: SearchSettings
                   ) -> list[DDPCandidate]:
    """The fastest DDP configuration over ``CAP_GRID_MB`` (and DDP's default buckets when they
    differ from it), for ``search`` to rank beside the FSDP candidates. The bf16 compression
    hook is used only when the user allowed a reduced-precision gradient reduction."""
    compress = settings.precision.reduce_bytes < 4
    # what every bucket size shares: the parameters, their ready events, the compute clock
    params = grad_parameters(graph, analysis.timeline.events)
    unused = any(p.ready_event is None for p in params)
    assert settings.hardware is not None
    times = _event_times(analysis.timeline.events, settings.hardware, analysis.param_dtype)
    evaluations = [evaluate_settings(graph, analysis, settings, c, params, times)
                   for c in config_options(graph, analysis, compress=compress, unused=unused)]
    best = best_config(evaluations)
    out = [_candidate(graph, best, settings, _label(best.config))]
    default = next(e for e in evaluations
                   if (e.config.bucket_cap_mb, e.config.first_bucket_mb)
                   == (DEFAULT_BUCKET_CAP_MB, DEFAULT_FIRST_BUCKET_MB))
    if default is not best:
        out.append(_candidate(graph, default, settings, "recipe: " + _label(default.config)
                              + " (DDP default)"))
    return out


def sweep(graph: ModuleGraph, analysis: Analysis, settings: SearchSettings,
          caps: tuple[int, ...] = CAP_GRID_MB) -> list[DDPEvaluation]:
    """One evaluation per cap (first bucket as large): the step-time curve over the cap."""
    unused = bool(unused_parameters(graph, analysis))
    return [evaluate_settings(graph, analysis, settings, DDPConfig(
        bucket_cap_mb=cap, first_bucket_mb=cap, find_unused_parameters=unused,
        comm_hook="bf16_compress" if settings.precision.reduce_bytes < 4 else None))
        for cap in caps]


def ddp_predicted(candidate: Candidate) -> dict[str, Any]:
    """The DDP part of a plan's ``predicted`` mapping (nothing for FSDP candidates)."""
    if not isinstance(candidate, DDPCandidate):
        return {}
    return {"buckets": [int(b.nbytes) for b in candidate.ddp.buckets],
            "comm_tail_s": round(candidate.time.exposed_comm_s, 6)}


def ddp_plan_block(candidate: Candidate) -> dict[str, Any] | None:
    """The plan's ``ddp`` mapping for a DDP candidate (None for FSDP candidates)."""
    return candidate.ddp.config.to_dict() if isinstance(candidate, DDPCandidate) else None


def ddp_plan_candidate(plan: Any, facts: Any, *, hardware: Hardware,
                       gpus_per_node: int = 8) -> DDPCandidate:
    """A DDP plan as written, evaluated (``fsdp-plan predict`` / ``verify``)."""
    from fsdp_plan.api import precision_of
    if plan.activation_checkpointing:
        from fsdp_plan.common.errors import BadInput
        raise BadInput("the DDP plan checkpoints modules; fsdp-plan predicts DDP plans without "
                       "activation checkpointing only: remove activation_checkpointing.")
    mp = plan.mixed_precision or {}
    settings = SearchSettings(
        budget_bytes=plan.budget_bytes, headroom_bytes=plan.headroom_bytes,
        world_size=plan.world_size, gpus_per_node=gpus_per_node, strategy="ddp",
        precision=precision_of(mp.get("param_dtype") or "float32",
                               mp.get("reduce_dtype") or mp.get("param_dtype") or "float32"),
        optimizer=plan.optimizer, hardware=hardware)
    config = DDPConfig.from_dict(plan.ddp)
    evaluation = evaluate_settings(facts.graph, facts.analysis, settings, config)
    return _candidate(facts.graph, evaluation, settings, "plan as written")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.4g} ms"


def why_line(ranked: list[Candidate]) -> str:
    """One line: why the winner beat the best candidate of the other kind (DDP vs FSDP/HSDP),
    on the same clock; empty when only one kind was planned."""
    from fsdp_plan.common.sizes import format_bytes

    fitting = [c for c in ranked if c.fits]
    if not fitting:
        return ""
    best = fitting[0]
    is_ddp = isinstance(best, DDPCandidate)
    other = next((c for c in fitting if isinstance(c, DDPCandidate) != is_ddp), None)
    if other is None:
        ddp = next((c for c in ranked if isinstance(c, DDPCandidate)), None)
        if is_ddp or ddp is None:
            return ""
        return (f"why: {best.name} wins; DDP does not fit: its peak "
                f"{format_bytes(ddp.memory.peak_bytes)} holds every parameter, gradient and "
                "optimizer state on each GPU.")
    b, o = best.time, other.time
    ddp, fsdp = (b, o) if is_ddp else (o, b)
    return (f"why: {best.name} wins: step {_ms(b.step_s)} vs {_ms(o.step_s)} for {other.name}; "
            f"DDP (no parameter all-gathers, gradient buckets all-reduced during backward) "
            f"exposes {_ms(ddp.exposed_comm_s)} of {_ms(ddp.total_comm_s)} communication, "
            f"FSDP/HSDP {_ms(fsdp.exposed_comm_s)} of {_ms(fsdp.total_comm_s)}; peak "
            f"{format_bytes(best.memory.peak_bytes)} vs {format_bytes(other.memory.peak_bytes)}.")


def report_lines(best: Candidate, ranked: list[Candidate]) -> list[str]:
    """The report's DDP lines: why the winner won (DDP vs FSDP/HSDP) and, for a DDP winner,
    its buckets becoming ready with their all-reduces and the tail."""
    lines = []
    why = why_line(ranked)
    if why:
        lines.append(why)
    if isinstance(best, DDPCandidate):
        c = best.ddp.config
        lines.append(f"DDP buckets after the rebuild ({len(best.ddp.buckets)}, cap "
                     f"{c.bucket_cap_mb:g} MiB, first {c.first_bucket_mb:g} MiB"
                     + (", bf16 compression hook" if c.comm_hook else "")
                     + (", find_unused_parameters" if c.find_unused_parameters else "") + "):")
        lines.extend(describe_buckets(best.ddp))
    return lines
