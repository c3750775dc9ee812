"""DDP's cost model: gradient buckets, their ready order, memory and step time, from the same
facts and two-stream clock (cost/streams.py) as FSDP.

When the unsharded model states and the activations fit on one GPU, plain
``DistributedDataParallel`` gathers no parameters: its only collective is the gradient
all-reduce, one per bucket, issued during backward. Its knob is ``bucket_cap_mb``: small
buckets start early but pay launch and latency per all-reduce; large ones start late and
leave a tail after backward. This module predicts the buckets exactly as DDP builds them,
when each becomes ready, the all-reduce schedule on the communication stream and the per-rank
memory; search/ddp.py picks the cap with the lowest step time. Pure functions over
``ModelFacts``.

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

[Note: DDP and accumulation] (torch 2.13 ``DistributedDataParallel._pre_forward`` /
``_post_forward``; counts checked on gloo with 2 processes by tests/test_ddp.py)
An optimizer step of N micro-batches runs N forwards and backwards and one optimizer step.
With ``gradient_sync: every`` each backward all-reduces its buckets (and the used-parameter
map), so the step is N times one micro-batch's forward, backward and exposed all-reduces,
plus one optimizer step. With ``last`` every micro-batch but the last runs under
``no_sync`` (``require_backward_grad_sync = False``, the policy's ``prepare_microbatch``):
the reducer is not armed and nothing is all-reduced, so those micro-batches cost their
forward and backward only, and the step all-reduces once. Buffers are broadcast at the start
of a forward only when the previous forward synchronised (``require_forward_param_sync``,
set by ``_post_forward``): once per micro-batch with ``every``, once per step with ``last``
(the first micro-batch, after the previous step's synchronised last one). Under ``no_sync``
the gradients are not bucket views: the step's ``zero_grad(set_to_none=True)`` dropped
them, so autograd accumulates into fresh ``.grad`` tensors, one parameter-sized copy held
over the later micro-batches until the synchronised backward copies each into its bucket
(MemTracker on gloo measured exactly that much more than ``every``).
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass, field, replace
from itertools import accumulate
from typing import Any

from fsdp_plan.cost.comm_hooks import (
    POWERSGD_DEFAULT_START_ITER,
    HookPhase,
    all_reduces_per_bucket,
    hook_kind,
    hook_phases,
    hook_state_bytes,
    hook_step_bytes,
)
from fsdp_plan.cost.hardware import Hardware
from fsdp_plan.cost.memory import MemoryEstimate, MemoryTimeline, loss_span
from fsdp_plan.cost.optimizer_overlap import step_temporaries
from fsdp_plan.cost.precision import OPTIMIZER_STATES, Precision, optimizer_state_bytes
from fsdp_plan.cost.step_time import (
    Rates,
    StepTime,
    accumulated_step,
    collective_time,
    compute_time,
    issue_time,
    optimizer_time,
    ranks_per_node_in,
)
from fsdp_plan.cost.streams import DeferredSpans, Streams
from fsdp_plan.facts.types import Analysis, Event, ModuleGraph

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
    """A hook kind of cost/comm_hooks.py ``COMM_HOOKS`` (``fp16_compress``, ``bf16_compress``,
    ``powersgd``), or None for DDP's own all-reduce."""
    powersgd_rank: int = 1
    """PowerSGD's ``matrix_approximation_rank`` (read only with ``comm_hook: powersgd``)."""
    powersgd_start_iter: int = POWERSGD_DEFAULT_START_ITER
    """PowerSGD's ``start_powerSGD_iter``: plain all-reduces before that iteration."""

    @property
    def default_buckets(self) -> bool:
        """Whether the buckets are DDP's own (first 1 MiB, then 25 MiB)."""
        return ((self.first_bucket_mb, self.bucket_cap_mb)
                == (DEFAULT_FIRST_BUCKET_MB, DEFAULT_BUCKET_CAP_MB))

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
        if self.comm_hook == "powersgd":
            out["powersgd"] = {"rank": self.powersgd_rank, "start_iter": self.powersgd_start_iter}
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> DDPConfig:
        raw = dict(raw or {})
        powersgd = raw.get("powersgd") or {}
        extra = {f"powersgd_{k}": powersgd[k] for k in ("rank", "start_iter") if k in powersgd}
        return cls(**{k: raw[k] for k in ("bucket_cap_mb", "first_bucket_mb",
                                          "gradient_as_bucket_view", "static_graph",
                                          "find_unused_parameters", "comm_hook") if k in raw},
                   **extra)


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
    return [list(range(start, end))
            for start, end in _bucket_ranges(list(accumulate(sizes, initial=0)), limits)]


def _bucket_ranges(cumulative: list[int], limits: list[int],
                   last_ends: list[int] | None = None) -> list[tuple[int, int]]:
    """``assign_by_size`` as ``(start, end)`` position ranges, given the running totals of
    the sizes (``cumulative[i]``: the bytes before position ``i``): each bucket ends at the
    first position where its bytes reach its limit, found by bisection; ``last_ends``: where
    a bucket at the last limit ends from each position (``BucketOrder.ends_at``), when the
    caller keeps them (a bucket of the 70B's DDP holds one parameter or a few, and the
    search cuts 17 configurations' buckets, most at the last limit)."""
    n = len(cumulative) - 1
    out: list[tuple[int, int]] = []
    start = at = 0
    last = len(limits) - 1
    while start < n and (at < last or last_ends is None):
        end = min(n, bisect.bisect_left(cumulative, cumulative[start] + limits[at], start + 1))
        out.append((start, end))
        start, at = end, min(at + 1, last)
    while start < n:
        end = last_ends[start]  # type: ignore[index]  # only reached with last_ends
        out.append((start, end))
        start = end
    return out


@dataclass(kw_only=True, frozen=True)
class BucketOrder:
    """One order DDP assigns buckets over (``DdpOrder.params`` or ``.rebuilt``), as the
    running totals of its parameters' bytes and each one's index and ready event (an unused
    parameter is marked ready at the first autograd hook: ``backward_start``)."""

    cumulative: list[int]
    indices: list[int]
    ready: list[int]
    _ends: dict[int, list[int]] = field(default_factory=dict, compare=False, repr=False)
    """``ends_at`` by limit."""

    def ends_at(self, limit: int) -> list[int]:
        """Where a bucket of ``limit`` bytes starting at each position ends: the first
        position where its bytes reach the limit, one on at least (``_bucket_ranges``'s
        bisection, for every position at once)."""
        found = self._ends.get(limit)
        if found is None:
            import numpy as np  # numpy on first use (cost/memory.py [Note: numpy on first use])

            totals = np.array(self.cumulative, dtype=np.int64)
            n = len(totals) - 1
            found = self._ends[limit] = np.minimum(n, np.maximum(
                np.searchsorted(totals, totals[:-1] + limit), np.arange(1, n + 1))).tolist()
        return found

    @classmethod
    def of(cls, order: list[GradParam], backward_start: int) -> BucketOrder:
        return cls(cumulative=list(accumulate((p.nbytes for p in order), initial=0)),
                   indices=[p.index for p in order],
                   ready=[p.ready_at if p.ready_at is not None else backward_start
                          for p in order])


def build_buckets(graph: ModuleGraph, events: list[Event], config: DDPConfig,
                  shared: DdpOrder | None = None) -> tuple[list[Bucket], list[GradParam]]:
    """The buckets DDP builds after its rebuild, and its parameters (see [Note: DDP buckets]);
    ``shared`` is ``ddp_order(graph, events)`` when the caller already has it."""
    shared = ddp_order(graph, events) if shared is None else shared
    return shared.cut(config)[0], shared.params


def rebuilds(config: DDPConfig) -> bool:
    """Whether DDP rebuilds its buckets after the first iteration (the reducer's
    ``should_rebuild_buckets``: with ``find_unused_parameters`` and no ``static_graph`` it
    never does, and the first bucketing stays)."""
    return config.static_graph or not config.find_unused_parameters


@dataclass(kw_only=True, frozen=True)
class DdpOrder:
    """What every bucket configuration of one analysed step shares, worked out once
    (``ddp_order``): the search evaluates 17 configurations per plan, and each walked the
    3,857 events and sorted the parameters again (a fifth of DDP's evaluation time, 70B)."""

    params: list[GradParam]
    """``grad_parameters``: DDP's parameters with their ready events."""
    rebuilt: list[GradParam]
    """``rebuilt_order`` of ``params``: the order rebuilt buckets are assigned over."""
    backward_start: int
    """The first ``pre_bw`` event (the last event without one)."""
    peaks: ActivationPeaks
    param_buckets: BucketOrder
    """``params`` as buckets are assigned over them (``build_buckets``)."""
    rebuilt_buckets: BucketOrder
    """``rebuilt`` likewise."""
    broadcasts: int
    """``buffer_broadcasts`` of the graph."""
    param_tensors: int
    """``parameter_tensors`` of the graph."""
    _cuts: dict[tuple, list[Bucket]] = field(default_factory=dict, compare=False, repr=False)
    """The bucket lists cut so far, by ``cut``'s layout key."""

    def cut(self, config: DDPConfig) -> tuple[list[Bucket], tuple]:
        """The buckets ``config`` cuts (``build_buckets``) and the key of their layout: the
        order they are assigned over and each one's position range. Caps below a model's
        smallest large parameter cut the same buckets (the 70B's 17 configurations cut 4
        layouts), so each layout's list is made once and shared, read only."""
        rebuilt = rebuilds(config)
        order = self.rebuilt_buckets if rebuilt else self.param_buckets
        ranges = _bucket_ranges(order.cumulative, config.limits,
                                order.ends_at(config.limits[-1]))
        if not rebuilt:  # DDP keeps its first bucketing: parameter order, the list reversed
            ranges.reverse()
        key = (rebuilt, tuple(ranges))
        found = self._cuts.get(key)
        if found is None:
            total, indices, ready = order.cumulative, order.indices, order.ready
            found = self._cuts[key] = [
                Bucket(params=indices[start:end], nbytes=total[end] - total[start],
                       ready_event=max(ready[start:end])) for start, end in ranges]
        return found, key


@dataclass(kw_only=True, frozen=True)
class ActivationPeaks:
    """Where the analysed step's activations peak (``activation_peaks``): what ``ddp_memory``
    reads of the events, the same for every bucket configuration."""

    peak: int
    """The highest event peak (0 without events)."""
    peak_at: int
    """The first event at that peak."""
    backward_at: int | None
    """The first backward event at the highest backward peak (None without backward)."""
    loss: tuple[int, int] | None
    """``loss_span`` of the events ([Note: the loss in the breakdown])."""


def activation_peaks(events: list[Event], first_pre_bw: int) -> ActivationPeaks:
    """``ActivationPeaks`` of ``events`` whose first ``pre_bw`` is ``first_pre_bw``
    (``len(events)`` without one)."""
    peaks = [e.peak for e in events]
    peak = max(peaks, default=0)
    backward = [i for i, e in enumerate(events) if e.kind.endswith("bw")]
    backward_at = max(backward, key=peaks.__getitem__) if backward else None
    return ActivationPeaks(peak=peak, peak_at=peaks.index(peak) if peaks else 0,
                           backward_at=backward_at, loss=loss_span(events, first_pre_bw))


def ddp_order(graph: ModuleGraph, events: list[Event]) -> DdpOrder:
    """``DdpOrder`` of ``graph`` over the analysed ``events``."""
    params = grad_parameters(graph, events)
    first_pre_bw = next((i for i, e in enumerate(events) if e.kind == "pre_bw"), len(events))
    rebuilt = rebuilt_order(graph, params)
    backward_start = min(first_pre_bw, len(events) - 1)
    return DdpOrder(params=params, rebuilt=rebuilt, backward_start=backward_start,
                    peaks=activation_peaks(events, first_pre_bw),
                    param_buckets=BucketOrder.of(params, backward_start),
                    rebuilt_buckets=BucketOrder.of(rebuilt, backward_start),
                    broadcasts=buffer_broadcasts(graph), param_tensors=parameter_tensors(graph))


def parameter_tensors(graph: ModuleGraph) -> int:
    """The model's parameter tensors (what the optimizer steps one by one)."""
    return sum(len(m.param_shapes) for m in graph.modules.values())


def unused_parameters(graph: ModuleGraph, analysis: Analysis) -> list[GradParam]:
    """Parameters that get no gradient in the analysed step (DDP needs
    ``find_unused_parameters=True`` for them)."""
    return [p for p in grad_parameters(graph, analysis.timeline.events) if p.ready_event is None]



# --- the clock --------------------------------------------------------------------------------

def event_times(events: list[Event], hw: Hardware, dtype: str) -> list[float]:
    """Compute seconds from the step's start to each event on the hardware's clock: the ops
    between two boundaries (``Event.ops``) timed as cost/step_time.py times a unit's ops."""
    rates = Rates.of(hw, dtype)
    times = [0.0] * len(events)
    flops, counters = [e.flops for e in events], [e.ops for e in events]
    # by the counters' identity and the FLOPs: a deep model's repeated blocks share both
    # (facts/depth.py), so the 70B's 3,857 events need 83 timings
    seconds: dict[tuple[int, float], float] = {}
    now = 0.0
    for i in range(1, len(events)):
        delta = flops[i] - flops[i - 1]
        delta = delta if delta > 0.0 else 0.0  # noqa: FURB136 (as max(0.0, delta), faster)
        ops = counters[i]
        found = seconds.get((id(ops), delta))
        if found is None:
            found = seconds[id(ops), delta] = compute_time(rates, ops, delta)
        now += found
        times[i] = now
    return times


def host_issue_times(events: list[Event], hw: Hardware) -> list[float]:
    """Host seconds to issue the ops up to each event ([Note: the host floor] in streams.py;
    the same for every bucket size)."""
    rates = Rates.of(hw)
    issued = [0.0] * len(events)
    seconds: dict[int, float] = {}  # by the counters' identity, as ``event_times``
    for i in range(1, len(events)):
        ops = events[i].ops
        found = seconds.get(id(ops))
        if found is None:
            found = seconds[id(ops)] = issue_time(rates, ops)
        issued[i] = issued[i - 1] + found
    return issued


def ddp_step_time(buckets: list[Bucket], events: list[Event], hw: Hardware, *, world_size: int,
                  gpus_per_node: int, optimizer_s: float, times: list[float],
                  chains: list[list[HookPhase]] | None = None, host_sync: bool = False,
                  used_map_bytes: int = 0, steps_in_backward: list[float] | None = None,
                  issued: list[float] | None = None, backward_start: int | None = None,
                  record_spans: bool = True) -> tuple[StepTime, list[float]]:
    """Forward, then backward with each bucket's all-reduce issued when it is ready and all
    earlier buckets were issued (the reducer launches buckets in order), on the two streams of
    cost/streams.py. Where the hardware file says collectives do not overlap compute
    (``comm_overlaps_compute: false``, gloo on a CPU, as the FSDP simulation reads it too)
    backward waits for each all-reduce, counted as exposed communication: the reducer's gloo
    threads then share the few cores backward runs on. ``times`` is ``event_times(events, hw,
    dtype)`` (the same for every bucket size). The host issues the ops between two events
    ahead of the device, which never runs ahead of it ([Note: the host floor] in streams.py).
    ``chains``: each bucket's communication hook chain (``comm_hooks.hook_phases``; None: DDP's
    own all-reduce of the bucket), placed as [Note: hooks on the clock] says; ``host_sync``:
    the host waits for each bucket's chain on a GPU (PowerSGD). ``steps_in_backward``: each
    bucket's optimizer seconds when its parameters step after its all-reduce
    (``optimizer_overlap``; cost/optimizer_overlap.py), ``optimizer_s`` then 0. ``issued``:
    ``host_issue_times(events, hw)`` where the caller keeps it; ``backward_start``: the first
    ``pre_bw`` event (the last event without one), ``DdpOrder.backward_start``, likewise.
    ``record_spans=False``: the clock keeps no spans and labels none (the search's:
    ``evaluate_ddp`` makes them when read, [Note: spans when read] in streams.py).
    Returns the step and when each bucket became ready."""
    n = len(events)
    bw_start = (next((i for i, e in enumerate(events) if e.kind == "pre_bw"), n - 1)
                if backward_start is None else backward_start)
    forward = times[bw_start]
    rates = Rates.of(hw)
    if issued is None:
        issued = host_issue_times(events, hw)
    local = ranks_per_node_in(world_size, 1, gpus_per_node)
    streams = Streams(hw, record_spans=record_spans)
    now, _ = streams.compute("FW", 0.0, forward, issued[bw_start])
    done, contention, waited, hook_s = bw_start, 0.0, 0.0, 0.0
    ready: list[float] = []

    seconds_of: dict[float, float] = {}  # buckets of one size (a layer's) repeat

    def all_reduce(label: str, nbytes: float) -> None:
        nonlocal now, waited
        seconds = seconds_of.get(nbytes)
        if seconds is None:
            seconds = seconds_of[nbytes] = collective_time(hw, nbytes, world_size, "all_reduce",
                                                           ranks_per_node=local)
        streams.issue(label, now, seconds)
        if not hw.comm_overlaps_compute:  # gloo on a CPU: the all-reduce takes the cores
            streams.wait(f"wait {label}", now, streams.comm_free)
            waited += streams.comm_free - now
            now = streams.comm_free

    def compute_until(event: int, label: str) -> None:
        """Backward compute from the last event reached to ``event``."""
        nonlocal now, done, contention
        duration, host = times[event] - times[done], issued[event] - issued[done]
        if event <= done or (duration <= 0 and host <= 0):
            return
        now, slowdown = streams.compute(label, now, max(0.0, duration), host)
        contention += slowdown
        done = event

    def phase_time(phase: HookPhase) -> float:
        return compute_time(rates, {"mm_small": phase.flops, "memory_bytes": phase.memory_bytes,
                                    "ops": phase.ops}, phase.flops)

    def run_chain(i: int, chain: list[HookPhase]) -> None:
        """Bucket ``i``'s hook: its first compute on the compute stream, then each collective
        and the callback work after it off the compute stream ([Note: hooks on the clock])."""
        nonlocal now, hook_s, waited
        first = phase_time(chain[0])
        if first > 0:
            start = now
            now, _ = streams.compute(f"{chain[0].label} bucket {i}", now, first,
                                     chain[0].ops * rates.op_overhead_s if rates.async_launch
                                     else 0.0)
            hook_s += now - start
        for j, phase in enumerate(chain):
            if j and phase_time(phase) > 0:
                streams.issue(f"{phase.label} bucket {i}", streams.comm_free, phase_time(phase))
            if phase.all_reduce_bytes is not None:
                wire = phase.all_reduce_bytes
                all_reduce(f"AR bucket {i} ({wire / MIB:.1f} MiB)" if len(chain) == 2
                           else f"AR bucket {i} {phase.label} ({wire / MIB:.2f} MiB)", wire)
        if host_sync and rates.async_launch and streams.comm_free > now:
            streams.wait(f"wait: bucket {i} hook's synchronize", now, streams.comm_free)
            waited += streams.comm_free - now
            now = streams.comm_free
            streams.host_free = max(streams.host_free, now)

    for i, bucket in enumerate(buckets):
        compute_until(bucket.ready_event, f"BW to bucket {i}" if record_spans else "")
        ready.append(now)
        if chains is None:
            all_reduce(f"AR bucket {i} ({bucket.nbytes / MIB:.1f} MiB)" if record_spans
                       else "", bucket.nbytes)
        else:
            run_chain(i, chains[i])
        if steps_in_backward and steps_in_backward[i] > 0:  # after the bucket's all-reduce
            now, wait_s, slowdown = streams.step_in_backward(
                f"optimizer bucket {i}", now, streams.comm_free, steps_in_backward[i])
            waited += wait_s
            contention += slowdown
    compute_until(n - 1, "BW")
    if used_map_bytes:
        all_reduce("AR used-parameter map", used_map_bytes)
    tail, total_comm = streams.finish(now, optimizer_s)
    if steps_in_backward:  # what is left of the steps after backward ends the step
        optimizer_s = streams.steps_left(now + tail)
    backward = times[-1] - forward
    step = StepTime(step_s=forward + backward + contention + hook_s + streams.host_wait_s
                    + waited + tail + optimizer_s, forward_s=forward,
                    backward_s=backward + contention + hook_s,
                    exposed_comm_s=waited + tail, total_comm_s=total_comm,
                    optimizer_s=optimizer_s, bubbles_s=waited, contention_s=contention,
                    backward_contention_s=contention,
                    comm_tail_s=tail, host_wait_s=streams.host_wait_s, spans=streams.spans)
    return step, ready


# --- memory -----------------------------------------------------------------------------------

def ddp_memory(graph: ModuleGraph, analysis: Analysis, precision: Precision, optimizer: str,
               config: DDPConfig, unused: list[GradParam] | None = None, *,
               sync_last: bool = False, hook_buffers: int = 0,
               steps_in_backward: list[tuple[int, int]] | None = None,
               shared: DdpOrder | None = None) -> MemoryEstimate:
    """Per-rank peak of a steady DDP step (every rank holds everything).

    Always alive: fp32 parameters, the bucket storage (which is the gradients under
    ``gradient_as_bucket_view``; otherwise ``.grad`` is a second copy once backward has
    written it), optimizer states (AdamW: two per parameter and a step count per tensor),
    buffers and inputs. On top: the analysis' activation peak (it already holds each weight
    gradient from the op that makes it until it is accumulated), or the optimizer step's
    temporary (one gradient-sized ``foreach`` buffer, as in cost/memory.py). A plan computing below
    float32 runs under ``torch.autocast``, which keeps a low-precision copy of each weight
    from its forward use to its backward: in the activations of an analysis traced under
    autocast ([Note: autocast precision]), added as ``autocast_weights`` to one that was not.
    ``sync_last``: micro-batches accumulated under ``no_sync`` hold their gradients apart
    from the buckets ([Note: DDP and accumulation]). A communication hook's state kept across
    steps is always alive (``comm_hook_state``); ``hook_buffers``, what one bucket's chain
    holds while it runs (``hook_memory``), comes on top of backward's activations where that
    is higher (``comm_hook_buffers``). ``steps_in_backward``: the parameters step in backward
    (``optimizer_overlap``), each bucket's once its last gradient is ready, ``(event, step
    temporary bytes)``; no optimizer step follows. ``shared``: ``ddp_order`` of the analysis
    when the caller keeps it."""
    events = analysis.timeline.events
    shared = ddp_order(graph, events) if shared is None else shared
    if unused is None:  # ``unused_parameters``
        unused = [p for p in shared.params if p.ready_event is None]
    static, autocast, opt_temp = _ddp_resident(graph, analysis, precision, optimizer, config,
                                               unused, shared)
    peaks = shared.peaks
    if steps_in_backward is not None:
        return _overlapped_ddp_memory(analysis, static, autocast, steps_in_backward, peaks)
    buffers = hook_buffers
    activations = peaks.peak
    at = peaks.backward_at
    if buffers and at is not None and events[at].peak + buffers > activations:
        step = {**static, "activations": events[at].peak, "comm_hook_buffers": buffers}
        if autocast:
            step["autocast_weights"] = autocast
        held = _held_grads(graph, config, unused, sync_last)
        if held:
            step["accumulated_grads"] = held
        base, top = sum(static.values()), events[at].peak + buffers + autocast + held
        if base + opt_temp <= base + top:
            return MemoryEstimate(peak_bytes=base + top,
                                  phase=f"backward ({events[at].kind} "
                                        f"{events[at].module or '<root>'}, a hook's buffers)",
                                  breakdown=step)
    base = sum(static.values())
    step = {**static, "activations": activations}
    if autocast:
        step["autocast_weights"] = autocast
    held = _held_grads(graph, config, unused, sync_last)
    if held:
        step["accumulated_grads"] = held
        autocast += held  # held, like the autocast copies, over the micro-batch's activations
    if base + opt_temp > base + activations + autocast:
        return MemoryEstimate(peak_bytes=base + opt_temp, phase="optimizer step",
                              breakdown={**static, "optimizer_temporaries": opt_temp})
    peak_at = peaks.peak_at
    ev = events[peak_at] if events else None
    where = f"{ev.kind} {ev.module or '<root>'}" if ev else "step"
    phase = "backward" if ev and ev.kind.endswith("bw") else "forward"
    span = peaks.loss
    if span is not None and span[0] < peak_at <= span[1]:  # [Note: the loss in the breakdown]
        step["activations"] = min(activations, events[span[0]].level)
        step["loss"] = activations - step["activations"]
    return MemoryEstimate(peak_bytes=base + activations + autocast, phase=f"{phase} ({where})",
                          breakdown=step)


def _overlapped_ddp_memory(analysis: Analysis, static: dict[str, int], autocast: int,
                           steps: list[tuple[int, int]], peaks: ActivationPeaks
                           ) -> MemoryEstimate:
    """``ddp_memory`` with the optimizer stepping in backward: the activation peak, or a
    bucket's step (the activations at its ready event and its step temporary), whichever is
    higher."""
    events = analysis.timeline.events
    peak_at = peaks.peak_at
    step = {**static, "activations": events[peak_at].peak if events else 0}
    where = (f"{events[peak_at].kind} {events[peak_at].module or '<root>'}" if events
             else "step")
    phase = "backward" if events and events[peak_at].kind.endswith("bw") else "forward"
    for at, temporary in steps:
        if temporary and events[at].level + temporary > (step["activations"]
                                                         + step.get("optimizer_temporaries", 0)):
            step = {**static, "activations": events[at].level,
                    "optimizer_temporaries": temporary}
            where, phase = (f"{events[at].kind} {events[at].module or '<root>'}",
                            "optimizer step in backward")
    if autocast:
        step["autocast_weights"] = autocast
    return MemoryEstimate(peak_bytes=sum(step.values()), phase=f"{phase} ({where})",
                          breakdown=step)


def _held_grads(graph: ModuleGraph, config: DDPConfig, unused: list[GradParam] | None,
                sync_last: bool) -> int:
    """Bytes of the gradients a micro-batch under ``no_sync`` leaves for the next: the
    optimizer's ``zero_grad(set_to_none=True)`` dropped the bucket views, so autograd
    accumulates into fresh ``.grad`` tensors until the synchronised micro-batch copies them
    into the buckets (measured with MemTracker on gloo: one parameter-sized copy more)."""
    if not sync_last or not config.gradient_as_bucket_view:
        return 0  # without bucket views ``.grad`` is already a copy of its own ("grads")
    return graph.total_param_bytes - sum(p.nbytes for p in unused or [])


def _ddp_resident(graph: ModuleGraph, analysis: Analysis, precision: Precision, optimizer: str,
                  config: DDPConfig, unused: list[GradParam] | None,
                  shared: DdpOrder | None = None) -> tuple[dict[str, int], int, int]:
    """``ddp_memory``'s always-alive bytes by kind, the autocast weight copies (forward to
    backward) and the optimizer step's temporary."""
    params = graph.total_param_bytes
    # a parameter that never gets a gradient gets no optimizer state and no step temporary
    if unused is None:
        unused = unused_parameters(graph, analysis)
    trained = params - sum(p.nbytes for p in unused)
    num_tensors = (shared.param_tensors if shared is not None
                   else parameter_tensors(graph)) - len(unused)
    states = OPTIMIZER_STATES.get(optimizer, 0)
    static = {
        "params": params,
        "gradient_buckets": params,
        # ``trained`` is already in bytes of the stored parameters: elements of one byte
        "optimizer_states": optimizer_state_bytes(optimizer, trained, num_tensors, 1),
        "buffers": graph.total_buffer_bytes,
        "inputs": analysis.input_bytes,
    }
    if not config.gradient_as_bucket_view:
        static["grads"] = params
    if config.comm_hook is not None:
        buckets, grads = build_buckets(graph, analysis.timeline.events, config, shared)
        state, _ = hook_memory(graph, grads, buckets, config)
        if state:
            static["comm_hook_state"] = state
    # traced under autocast, the activations hold the weights' casts already; facts traced with
    # the parameters cast (FSDP mixed precision) get one cast of every weight added
    autocast = (graph.total_numel * precision.param_bytes
                if precision.param_bytes < precision.orig_bytes and not analysis.autocast_dtype
                else 0)
    return static, autocast, trained if states else 0


def ddp_memory_timeline(graph: ModuleGraph, analysis: Analysis, precision: Precision,
                        optimizer: str, config: DDPConfig,
                        unused: list[GradParam] | None = None, *,
                        sync_last: bool = False, optimizer_overlap: bool = False
                        ) -> MemoryTimeline:
    """``ddp_memory`` at every analysed boundary (for pictures): the resident bytes, the
    autocast copies and the gradients held under ``no_sync`` under the activation timeline,
    then the optimizer step; its highest total is ``ddp_memory``'s peak. With
    ``optimizer_overlap`` there is no optimizer step (each bucket's step in backward adds one
    parameter's temporary, which ``ddp_memory`` counts and this timeline does not draw)."""
    if unused is None:
        unused = unused_parameters(graph, analysis)
    static, autocast, opt_temp = _ddp_resident(graph, analysis, precision, optimizer, config,
                                               unused)
    held = {"autocast_weights": autocast} if autocast else {}
    if _held_grads(graph, config, unused, sync_last):
        held["accumulated_grads"] = _held_grads(graph, config, unused, sync_last)
    events = analysis.timeline.events
    backward_start = next((i for i, e in enumerate(events) if e.kind == "pre_bw"), len(events))
    forward_end = max(0, backward_start - 1)
    return MemoryTimeline(
        events=events, forward_end=forward_end, points=[4 * i for i in range(len(events))],
        activations=[e.peak for e in events], static=static,
        held=held, live=[], instants=[],
        grads_at=[], optimizer_step=None if optimizer_overlap
        else {**static, "optimizer_temporaries": opt_temp},
        loss_span=loss_span(events, backward_start))


# --- evaluation ----------------------------------------------------------------------------

def evaluate_ddp(graph: ModuleGraph, analysis: Analysis, config: DDPConfig, *, hw: Hardware,
                 world_size: int, gpus_per_node: int, precision: Precision, optimizer: str,
                 dtype: str = "bfloat16", shared: DdpOrder | None = None,
                 times: list[float] | None = None, grad_accum_steps: int = 1,
                 gradient_sync: str = "every", optimizer_overlap: bool = False,
                 issued: list[float] | None = None,
                 step_times: dict[tuple, tuple[StepTime, list[float]]] | None = None
                 ) -> DDPEvaluation:
    """Buckets, memory, collectives and step time of one DDP configuration (``shared``: the
    analysis' ``ddp_order``, and ``times``: ``event_times``, computed once when several
    configurations are evaluated; ``issued``: ``host_issue_times`` likewise) over one
    optimizer step of ``grad_accum_steps`` micro-batches ([Note: DDP and accumulation]).

    ``step_times``: the simulated backward of the bucket layouts met before, kept by the
    caller for configurations that share every other argument (one evaluator's). Caps
    below a model's smallest large parameter all cut the same buckets (the 70B's 17
    configurations cut 4 layouts), and a step's time depends on its buckets, not on the cap
    that cut them: each layout is simulated once."""
    events = analysis.timeline.events
    shared = ddp_order(graph, events) if shared is None else shared
    buckets, layout = shared.cut(config)
    params = shared.params
    unused = [p.index for p in params if p.ready_event is None]
    optimizer_s = optimizer_time(hw, Rates.of(hw, dtype), optimizer, graph.total_numel,
                                 precision.orig_bytes)
    times = event_times(events, hw, dtype) if times is None else times
    common = {"world_size": world_size, "gpus_per_node": gpus_per_node,
              "optimizer_s": optimizer_s, "times": times, "issued": issued,
              "backward_start": shared.backward_start}
    kind = hook_kind(config.comm_hook)
    chains = None
    if kind is not None:
        element = _grad_element_bytes(params)
        chains = [hook_phases(config.comm_hook, bucket_shapes(graph, params, b), element,
                              rank=config.powersgd_rank) for b in buckets]
    steps = None
    if optimizer_overlap:  # [Note: optimizer overlap in the models]
        by_index = {p.index: p for p in params}
        rates = Rates.of(hw, dtype)
        steps = [optimizer_time(hw, rates, optimizer, sum(by_index[j].numel for j in b.params),
                                precision.orig_bytes) for b in buckets]
        common["optimizer_s"] = 0.0
    key = (layout, config.comm_hook, config.powersgd_rank, config.find_unused_parameters,
           optimizer_overlap)
    simulated = step_times.get(key) if step_times is not None else None
    if simulated is None:
        clock = functools.partial(
            ddp_step_time, buckets, events, hw, chains=chains,
            host_sync=kind is not None and kind.host_sync,
            used_map_bytes=4 * len(params) if config.find_unused_parameters else 0,
            steps_in_backward=steps, **common)
        step, bucket_ready = clock(record_spans=False)
        # the spans when read: the same run keeping them ([Note: spans when read])
        simulated = (replace(step, spans=DeferredSpans(lambda: clock()[0].spans)),
                     bucket_ready)
        if step_times is not None:
            step_times[key] = simulated
    shared_spans = simulated[0].spans
    time, ready = replace(simulated[0], spans=DeferredSpans(lambda: list(shared_spans))), list(
        simulated[1])  # each candidate's own, as when simulated for it
    if grad_accum_steps > 1:
        earlier = time
        if gradient_sync == "last":  # under no_sync: forward and backward, no all-reduce
            earlier, _ = ddp_step_time([], events, hw, **common)
        time = accumulated_step(time, earlier, grad_accum_steps)
    memory = ddp_memory(graph, analysis, precision, optimizer, config,
                        [p for p in params if p.ready_event is None],
                        sync_last=grad_accum_steps > 1 and gradient_sync == "last",
                        hook_buffers=hook_memory(graph, params, buckets, config)[1],
                        steps_in_backward=_step_temporaries(optimizer, params, buckets)
                        if optimizer_overlap else None, shared=shared)
    reduces = 1 if gradient_sync == "last" else grad_accum_steps
    per_bucket = all_reduces_per_bucket(config.comm_hook)
    collectives = {"all_gather": 0, "reduce_scatter": 0,
                   "all_reduce": reduces * (per_bucket * len(buckets)
                                            + (1 if config.find_unused_parameters else 0))}
    broadcasts = shared.broadcasts
    if broadcasts:
        collectives["broadcast"] = reduces * broadcasts
    return DDPEvaluation(config=config, buckets=buckets, memory=memory, time=time,
                         collectives=collectives, unused=unused, ready_s=ready)


def _step_temporaries(optimizer: str, params: list[GradParam], buckets: list[Bucket]
                      ) -> list[tuple[int, int]]:
    """(event, bytes) of each bucket's in-backward step: where its last gradient is ready, and
    what its largest parameter's step allocates (cost/optimizer_overlap.py
    ``step_temporaries``)."""
    by_index = {p.index: p for p in params}
    return [(b.ready_event, step_temporaries(optimizer)
             * max(by_index[j].nbytes for j in b.params)) for b in buckets]


def bucket_shapes(graph: ModuleGraph, params: list[GradParam], bucket: Bucket
                  ) -> list[tuple[int, ...]]:
    """The shapes of a bucket's gradients, in the bucket's order (``bucket.gradients()``)."""
    by_index = {p.index: p for p in params}
    out = []
    for index in bucket.params:
        p = by_index[index]
        out.append(tuple(int(d) for d in graph.modules[p.module].param_shapes[p.position]))
    return out


def _grad_element_bytes(params: list[GradParam]) -> int:
    """Bytes per gradient element (DDP's buckets hold the parameters' dtype)."""
    numel = sum(p.numel for p in params)
    return max(1, round(sum(p.nbytes for p in params) / numel)) if numel else 4


def hook_memory(graph: ModuleGraph, params: list[GradParam], buckets: list[Bucket],
                config: DDPConfig) -> tuple[int, int]:
    """(bytes a communication hook keeps across steps, bytes it holds on top while a bucket's
    chain runs) for ``config``'s hook ([Note: communication hooks])."""
    if config.comm_hook is None:
        return 0, 0
    shapes = [bucket_shapes(graph, params, b) for b in buckets]
    element = _grad_element_bytes(params)
    return (hook_state_bytes(config.comm_hook, shapes, element, rank=config.powersgd_rank),
            hook_step_bytes(config.comm_hook, shapes, element, rank=config.powersgd_rank))


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


def ddp_api_kwargs(config: DDPConfig) -> dict[str, Any]:
    """The ``DistributedDataParallel`` keyword arguments that build ``config``'s buckets: the
    generated policy's own rule (``policy_runtime.ddp_kwargs``), so both sides agree."""
    from fsdp_plan.policy_runtime import ddp_kwargs  # torch: the cost model imports none
    return ddp_kwargs(config.to_dict())


