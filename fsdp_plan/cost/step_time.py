"""The step-time model: per-unit compute and collective times, simulated on two streams.

[Note: two-stream simulation]
Compute runs units in forward order, then in backward order. Each unit's all-gather must
finish before it computes; it is issued when the unit ``d`` places earlier starts (prefetch
depth ``d``; 0 means when the unit itself starts). Reduce-scatters (and HSDP all-reduces) are
issued when a unit's backward finishes. One communication stream runs collectives in issue
order. While a collective overlaps compute, compute slows by ``contention`` (collectives take
SMs and HBM bandwidth). Then (SPEC section 6):
    waits    = times compute stood still waiting for an all-gather (bubbles)
    tail     = max(0, comm_finish - backward_finish)             -> comm_tail_s
    exposed  = waits + tail                                       -> exposed_comm_s
    hidden   = total communication - exposed
    step     = compute (with contention and host waits) + exposed + optimizer
The host issues each unit's pass ahead of the device; where it falls behind, the device waits
for it ([Note: the host floor] in streams.py: ``host_wait_s``, part of compute).
Every wait lies inside a span where the communication stream is busy (an all-gather issued
no later than the wait began is still running), so exposed <= total and hidden >= 0.

[Note: per-op compute time]
A unit's compute time comes from its ops (facts/types.py [Note: op classes]): matrix-multiply FLOPs
by shape class at the hardware's measured matmul rates for the compute dtype, attention FLOPs
at the attention rate, bytes moved by memory-bound ops at the memory bandwidth, and a host
overhead per op (``op_overhead_s``: added on a CPU, overlapped on a GPU whose host runs ahead,
where an op costs max(work, overhead)), plus ``unit_overhead_s`` per FSDP unit and pass. On a
GPU (``async_launch``) the host's side of both is ``issue_time``: the host issues each unit's
ops and FSDP's per-unit work on its own timeline, which the device never runs ahead of
([Note: the host floor] in streams.py); on a CPU the host computes in line and both are
device time. Facts without op counters (written before they existed) fall back to FLOPs at
``peak_flops x efficiency``.

[Note: bandwidth across nodes]
``inter_node_bandwidth`` is one GPU's share of its node's network (HGX/DGX nodes: one NIC
per GPU, e.g. 400 Gb/s NDR ~ 40-45 GB/s achieved). In every data-parallel collective all
GPUs of a node take part at once, each in its own group, so a group with k ranks on a node
has k NICs' worth of bandwidth there: NCCL runs a ring channel through each NIC, and a node
must take in (n-1)/n of an all-gather's bytes through them while each GPU takes in
(N-1)/N over NVLink. The bus bandwidth is therefore min(intra-node, k x inter_node): full
sharding over several 8-GPU nodes with a NIC per GPU runs at 8 NICs' worth (on H100 with
400 Gb/s NICs, close to its NVLink figure), while an HSDP replica group (one rank per node)
runs at one NIC's rate. Checked against torchtitan's published 64-A100 runs
(benchmarks/published_runs.py): one NIC for the whole ring had predicted them 38-44% slow.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from fsdp_plan.cost.hardware import Hardware
from fsdp_plan.cost.precision import step_bytes
from fsdp_plan.cost.streams import DeferredSpans, Span, Streams

MM_KEYS = ("mm_small", "mm_medium", "mm_large")


@dataclass(kw_only=True, frozen=True)
class Rates:
    """The rates one compute dtype reaches on ``Hardware``, with the derived defaults filled in."""

    matmul: dict[str, float]
    """``mm_small`` / ``mm_medium`` / ``mm_large`` -> FLOP/s."""
    attention: float
    memory: float
    """Bytes/s of memory-bound ops."""
    op_overhead_s: float
    async_launch: bool
    unit_overhead_s: float = 0.0
    """Host seconds FSDP spends per unit and pass (hooks, copy-in/copy-out issue)."""
    param_overhead_s: float = 0.0
    """Host seconds FSDP spends per parameter tensor of a unit and pass."""
    checkpoint_overhead_s: float = 0.0
    """Host seconds activation checkpointing spends per checkpointed block and step."""
    fallback: float
    """FLOP/s for facts without op counters: ``peak_flops x efficiency``."""

    @classmethod
    def of(cls, hw: Hardware, dtype: str = "bfloat16") -> Rates:
        fallback = hw.peak_flops * hw.efficiency
        table: Mapping[str, float] = (hw.matmul_flops.get(dtype)
                                      or hw.matmul_flops.get("bfloat16") or {})
        matmul = {}
        for key in MM_KEYS:
            cls_name = key[3:]
            # a class the file leaves out takes the nearest one it gives, else the fallback
            nearest = [table[c] for c in (cls_name, "medium", "large", "small") if c in table]
            matmul[key] = nearest[0] if nearest else fallback
        attention = (hw.attention_flops.get(dtype) or hw.attention_flops.get("bfloat16")
                     or matmul["mm_large"])
        memory = hw.memory_bandwidth or 0.8 * hw.hbm_bandwidth
        return cls(matmul=matmul, attention=attention, memory=memory,
                   op_overhead_s=hw.op_overhead_s, async_launch=hw.async_launch,
                   unit_overhead_s=hw.unit_overhead_s, param_overhead_s=hw.param_overhead_s,
                   checkpoint_overhead_s=hw.checkpoint_overhead_s, fallback=fallback)


def compute_time(rates: Rates, ops: Mapping[str, float] | None, flops: float) -> float:
    """Seconds for ops with these counters ([Note: per-op compute time]); ``flops`` alone
    (at the fallback rate) when the facts carry no counters."""
    if not ops:
        return flops / rates.fallback
    work = 0.0  # the matmul classes in turn, as ``sum`` added them (a class absent adds 0.0)
    matmul = rates.matmul
    for k in MM_KEYS:
        if k in ops:
            work += ops[k] / matmul[k]
    work += ops.get("attention", 0.0) / rates.attention
    work += ops.get("memory_bytes", 0.0) / rates.memory
    overhead = ops.get("ops", 0.0) * rates.op_overhead_s
    return max(work, overhead) if rates.async_launch else work + overhead


def issue_time(rates: Rates, ops: Mapping[str, float] | None, units: int = 0,
               params: int = 0) -> float:
    """Host seconds to issue ``ops`` and ``units`` FSDP unit passes over ``params`` parameter
    tensors ahead of the device: the host timeline of [Note: the host floor] (streams.py). 0
    where the host computes in line (a CPU, ``async_launch: false``: ``compute_time`` and
    ``pass_time`` already count it as device time) and for facts without op counters (their
    FLOP rate includes everything)."""
    if not rates.async_launch or not ops:
        return 0.0
    return (ops.get("ops", 0.0) * rates.op_overhead_s + units * rates.unit_overhead_s
            + params * rates.param_overhead_s)


def pass_time(rates: Rates, ops: Mapping[str, float] | None, flops: float, params: int = 0
              ) -> tuple[float, float]:
    """(device seconds, host seconds) of one FSDP unit's forward or backward pass over these
    ops and its ``params`` parameter tensors ([Note: per-op compute time]): FSDP's per-unit
    and per-parameter host cost is device time where the host computes in line (a CPU), host
    time where it runs ahead (a GPU)."""
    host = issue_time(rates, ops, units=1, params=params)
    device = compute_time(rates, ops, flops)
    if rates.async_launch:
        return device, host
    return device + rates.unit_overhead_s + params * rates.param_overhead_s, host


def add_ops(total: dict[str, float], ops: Mapping[str, float] | None) -> dict[str, float]:
    """``total`` plus ``ops``, key by key (in place; returns ``total``)."""
    for k, v in (ops or {}).items():
        total[k] = total.get(k, 0.0) + v
    return total


def exclusive_ops(module_names: set[str], modules: Mapping[str, object]
                  ) -> tuple[dict[str, dict[str, float]], dict[str, dict[str, float]]]:
    """Forward and backward op counters of each module's own ops (``ModuleCompute.own_*_ops``,
    [Note: FLOP attribution]); ops of modules outside ``module_names`` (wrappers the graph does
    not list) and outside every module go to the root ``""``, like ``_exclusive_flops``."""
    fw: dict[str, dict[str, float]] = {"": {}}
    bw: dict[str, dict[str, float]] = {"": {}}
    for fqn, comp in modules.items():
        owner = fqn if fqn in module_names else ""
        add_ops(fw.setdefault(owner, {}), getattr(comp, "own_fw_ops", None))
        add_ops(bw.setdefault(owner, {}), getattr(comp, "own_bw_ops", None))
    return fw, bw


def optimizer_time(hw: Hardware, rates: Rates, optimizer: str, shard_numel: int,
                   orig_bytes: int, tensors: int = 0) -> float:
    """The optimizer step over this rank's shard: measured seconds per parameter when the
    hardware file has them, else its bytes (parameter, gradient, states read and written)
    at the memory bandwidth."""
    per_param = hw.optimizer_s_per_param.get(optimizer)
    per_tensor = hw.optimizer_s_per_tensor.get(optimizer)
    if optimizer == "adam":
        per_param = per_param or hw.optimizer_s_per_param.get("adamw")
        per_tensor = per_tensor or hw.optimizer_s_per_tensor.get("adamw")
    if per_param is not None:
        return shard_numel * per_param + tensors * (per_tensor or 0.0)
    if optimizer == "none":
        return 0.0
    return step_bytes(optimizer, shard_numel, orig_bytes) / rates.memory


def fsdp_copy_time(hw: Hardware, rates: Rates, nbytes: float, kind: str) -> float:
    """FSDP2's own time around one unit's ``kind`` collective of ``nbytes`` (the gathered
    parameters, or the unsharded gradients): copies into and out of the flat buffer, its
    allocation and the gradient division. From the hardware file's per-byte table when it has
    one (interpolated in log bytes between the measured unit sizes, the nearest outside
    them), else two passes over the bytes at the memory bandwidth."""
    table = hw.fsdp_s_per_byte.get(kind)
    if not table:
        return 2 * nbytes / rates.memory
    points = sorted((int(size), s) for size, s in table.items())
    if nbytes <= points[0][0]:
        return nbytes * points[0][1]
    if nbytes >= points[-1][0]:
        return nbytes * points[-1][1]
    at = bisect.bisect_right([size for size, _ in points], nbytes)
    (x0, y0), (x1, y1) = points[at - 1], points[at]
    share = math.log(nbytes / x0) / math.log(x1 / x0)
    return nbytes * (y0 + share * (y1 - y0))


def _fit(hw: Hardware, kind: str, group: int) -> Mapping[str, float] | None:
    """The fitted curve for ``kind`` at ``group`` ranks: that group's, else the nearest
    measured group below it, else the smallest measured one."""
    fits = hw.collectives.get(kind) or {}
    if not fits:
        return None
    sizes = hw.collective_groups[kind]
    below = bisect.bisect_right(sizes, group)  # how many measured groups are <= group
    return fits[str(sizes[below - 1] if below else sizes[0])]


def collective_time(hw: Hardware, nbytes: float, group: int, kind: str = "all_gather", *,
                    ranks_per_node: int | None = None) -> float:
    """Ring time of one collective over ``group`` ranks moving ``nbytes`` (the full buffer):
    ``launch + latency + factor * (g - 1) / g * nbytes / bus_bandwidth``.

    ``ranks_per_node``: the group's ranks on each node it spans (``ranks_per_node_in``);
    ``None`` when the whole group sits in one node. Inside a node the bus bandwidth and
    latency are the hardware file's fitted curve for ``kind`` (else the link figures). A group
    larger than its ranks per node crosses nodes, see [Note: bandwidth across nodes]: it
    reaches ``ranks_per_node`` times each GPU's network share, never more than inside a node."""
    if group <= 1:
        return hw.launch_overhead_s
    factor = 2.0 if kind == "all_reduce" else 1.0
    local = group if ranks_per_node is None else max(1, min(ranks_per_node, group))
    crosses_nodes = group > local
    fit = _fit(hw, kind, local)
    if fit is not None:
        latency, bw = fit.get("latency_s", hw.collective_latency_s), fit["bus_bandwidth"]
    else:
        latency, bw = hw.collective_latency_s, hw.intra_node_bandwidth
    if crosses_nodes:
        latency = hw.collective_latency_s
        bw = min(bw, local * hw.inter_node_bandwidth)
    return hw.launch_overhead_s + latency + factor * (group - 1) / group * nbytes / bw


def ranks_per_node_in(group: int, stride: int, gpus_per_node: int) -> int:
    """Ranks of a group on each node it spans, for a group of ``group`` ranks ``stride``
    apart (a mesh's shard dimension: stride 1; its replicate dimension: stride = shard)."""
    if stride >= gpus_per_node:
        return 1
    return max(1, min(group, gpus_per_node // stride))


@dataclass(kw_only=True, frozen=True)
class UnitCost:
    """Times of one unit: compute per pass and its collectives."""

    key: str
    fw_compute_s: float
    bw_compute_s: float
    """Backward compute, including any recomputed forward of checkpointed modules."""
    all_gather_s: float
    reduce_scatter_s: float
    all_reduce_s: float = 0.0
    regather: bool = True
    optimizer_s: float = 0.0
    """The unit's parameters' optimizer step in backward, after its reduce-scatter
    (``optimizer_overlap``; 0: the optimizer steps after backward)."""
    fw_host_s: float = 0.0
    bw_host_s: float = 0.0
    """Host seconds to issue the unit's forward and backward (its ops' dispatch and launch,
    FSDP's per-unit hooks and copies); the device never runs ahead of them ([Note: the host
    floor] in streams.py). 0: issued in line, or the host is never behind."""


@dataclass(kw_only=True)
class StepTime:
    """The simulated step and its parts (seconds); see [Note: two-stream simulation]."""

    step_s: float
    forward_s: float
    """Forward compute without contention (the forward's slowdown is in ``contention_s``)."""
    backward_s: float
    """Backward compute including its contention slowdown (and recomputation)."""
    exposed_comm_s: float
    """All time compute waits for communication: all-gather waits plus the tail."""
    total_comm_s: float
    optimizer_s: float
    bubbles_s: float
    """Compute waiting for all-gathers (part of ``exposed_comm_s``)."""
    contention_s: float
    comm_tail_s: float = 0.0
    backward_contention_s: float = 0.0
    """The backward's part of ``contention_s`` (what ``bench --baseline no-overlap`` measures:
    bench/overlap.py)."""
    """Communication left after backward: max(0, comm_finish - backward_finish)."""
    host_wait_s: float = 0.0
    """Compute standing still for the host to issue its work ([Note: the host floor] in
    streams.py): part of ``compute_s``, in neither ``forward_s`` nor ``backward_s``."""
    spans: Sequence[Span] = field(default_factory=list)
    """(lane, label, start, end) for the report's timeline and the Chrome trace; lanes are
    ``compute``, ``comm``, ``wait`` (compute standing still for communication) and ``host``
    (the host issuing a stretch of compute, where it has a timeline of its own). A list, or
    where the search's clock ran without them one made when first read (``DeferredSpans``,
    [Note: spans when read] in streams.py)."""

    @property
    def hidden_comm_s(self) -> float:
        return max(0.0, self.total_comm_s - self.exposed_comm_s)

    @property
    def compute_s(self) -> float:
        """Forward + backward compute with all contention: ``step - exposed - optimizer``."""
        return self.step_s - self.exposed_comm_s - self.optimizer_s


ForwardCache = dict[tuple, tuple[Streams, float, float, float]]
"""Forward passes simulated already: by the prefetch depth, whether spans were kept and what
forward reads of each unit, the streams after it, its end, bubbles and contention
(``simulate_step``)."""


def forward_reads(units: list[UnitCost]) -> tuple:
    """What the forward pass reads of ``units``: each one's key, forward compute and host
    seconds and all-gather (``simulate_step``'s forward cache key, with the prefetch)."""
    return tuple((u.key, u.fw_compute_s, u.fw_host_s, u.all_gather_s) for u in units)


def simulate_step(units: list[UnitCost], hw: Hardware, *, forward_prefetch: int = 0,
                  backward_prefetch: int = 1, optimizer_s: float = 0.0,
                  forwards: ForwardCache | None = None,
                  forward_key: tuple | None = None, record_spans: bool = True) -> StepTime:
    """Run the two-stream simulation over ``units`` given in forward order
    ([Note: two-stream simulation], on ``cost/streams.Streams``).

    ``forwards``: forward passes already run on ``hw`` (one clock's, the search's). Forward
    reads only each unit's forward compute, host seconds and all-gather, and the
    checkpointing a search varies changes only backward: a layout's candidates share one
    forward, run once and continued from a copy of its streams. ``forward_key``:
    ``forward_reads(units)`` where the caller keeps it. ``record_spans=False``: the clock
    keeps no spans, and the step time's are made when first read, by this simulation run
    again ([Note: spans when read] in streams.py; ``units`` is not changed afterwards)."""
    streams = Streams(hw, record_spans=record_spans)

    def run_pass(order: list[UnitCost], phase: str, now: float, prefetch: int,
                 gathers: list[bool]) -> tuple[float, float, float]:
        ready: list[float] = []
        issued = 0
        """How many all-gathers (or units that need none) are in ``ready``."""
        bubbles = contention = 0.0
        n = len(order)
        backward = phase == "bw"
        issue, compute = streams.issue, streams.compute
        # the labels' prefixes only where spans are kept (a key joined to "" is the key)
        tag, ag, wait_ag, rs, ar, opt = ((phase.upper() + " ", "AG ", "wait AG ", "RS ", "AR ",
                                          "optimizer ") if record_spans else ("",) * 6)
        stream_blocks = not hw.comm_overlaps_compute
        for i, u in enumerate(order):
            # issue all-gathers up to ``prefetch`` units ahead of the one about to compute
            ahead = i + prefetch + 1
            if ahead > n:  # noqa: PLR1730 (not ``min()``: streams.py, the clock's conditionals)
                ahead = n
            while issued < ahead:
                cost = order[issued]
                ready.append(issue(ag + cost.key, now, cost.all_gather_s)
                             if gathers[issued] else now)
                issued += 1
            # without overlap (gloo) compute also waits for whatever the stream still runs
            start = ready[i] if ready[i] > now else now  # noqa: FURB136 (streams.py)
            if stream_blocks and streams.comm_free > start:
                start = streams.comm_free
            if start > now:
                streams.wait(wait_ag + u.key, now, start)
            bubbles += start - now
            if backward:
                now, slowdown = compute(tag + u.key, start, u.bw_compute_s, u.bw_host_s)
                contention += slowdown
                reduced = issue(rs + u.key, now, u.reduce_scatter_s)
                if u.all_reduce_s:
                    reduced = issue(ar + u.key, streams.comm_free, u.all_reduce_s)
                if u.optimizer_s:
                    now, waited, slowdown = streams.step_in_backward(
                        opt + u.key, now, reduced, u.optimizer_s)
                    bubbles += waited
                    contention += slowdown
            else:
                now, slowdown = compute(tag + u.key, start, u.fw_compute_s, u.fw_host_s)
                contention += slowdown
        return now, bubbles, contention

    if forwards is None:
        key = None
    else:  # a forward run without spans has none to continue from
        key = (forward_prefetch, record_spans,
               forward_reads(units) if forward_key is None else forward_key)
    if key is not None and key in forwards:
        ran, fw_end, fw_bubbles, fw_cont = forwards[key]
        streams = ran.copy()
    else:
        fw_end, fw_bubbles, fw_cont = run_pass(units, "fw", 0.0, forward_prefetch,
                                               [True] * len(units))
        if key is not None:
            forwards[key] = (streams.copy(), fw_end, fw_bubbles, fw_cont)
    bw_order = list(reversed(units))
    bw_end, bw_bubbles, bw_cont = run_pass(bw_order, "bw", fw_end, backward_prefetch,
                                           [u.regather for u in bw_order])
    tail, total_comm = streams.finish(bw_end, optimizer_s)
    # made from the arguments as given (``optimizer_s`` is the optimizer's after this)
    spans = streams.spans if record_spans else DeferredSpans(functools.partial(
        _spans_of, units, hw, forward_prefetch, backward_prefetch, optimizer_s))
    forward = sum(u.fw_compute_s for u in units)
    backward = sum(u.bw_compute_s for u in units)
    bubbles = fw_bubbles + bw_bubbles
    if any(u.optimizer_s for u in units):  # [Note: optimizer overlap in the models]
        optimizer_s = streams.steps_left(bw_end + tail)
    exposed = bubbles + tail
    step = (forward + backward + (fw_cont + bw_cont) + streams.host_wait_s + exposed
            + optimizer_s)
    return StepTime(step_s=step, forward_s=forward, backward_s=backward + bw_cont,
                    exposed_comm_s=exposed, total_comm_s=total_comm, optimizer_s=optimizer_s,
                    bubbles_s=bubbles, contention_s=fw_cont + bw_cont, comm_tail_s=tail,
                    backward_contention_s=bw_cont, host_wait_s=streams.host_wait_s,
                    spans=spans)


def _spans_of(units: list[UnitCost], hw: Hardware, forward_prefetch: int,
              backward_prefetch: int, optimizer_s: float) -> list[Span]:
    """The spans of ``simulate_step`` of these, run again keeping them."""
    return list(simulate_step(units, hw, forward_prefetch=forward_prefetch,
                              backward_prefetch=backward_prefetch,
                              optimizer_s=optimizer_s).spans)


def step_phases(time: StepTime) -> dict[str, float]:
    """Seconds of the step's forward (to the last forward compute, waits included), backward
    (to the end of the communication tail) and optimizer: what bench measures per phase."""
    forward = max((e for lane, label, _, e in time.spans
                   if lane == "compute" and label.startswith("FW")), default=0.0)
    backward = max(0.0, time.step_s - time.optimizer_s - forward)
    return {"forward": forward, "backward": backward, "optimizer": time.optimizer_s}


def accumulated_step(last: StepTime, earlier: StepTime, steps: int) -> StepTime:
    """One optimizer step of ``steps`` micro-batches: ``steps - 1`` run like ``earlier`` (no
    reduction with ``gradient_sync: last``, else like ``last``), then ``last``; the optimizer
    runs once. The spans show the last micro-batch."""
    k = steps - 1

    def total(name: str) -> float:
        return getattr(last, name) + k * getattr(earlier, name)
    return StepTime(step_s=last.step_s + k * (earlier.step_s - earlier.optimizer_s),
                    forward_s=total("forward_s"), backward_s=total("backward_s"),
                    exposed_comm_s=total("exposed_comm_s"), total_comm_s=total("total_comm_s"),
                    optimizer_s=last.optimizer_s, bubbles_s=total("bubbles_s"),
                    contention_s=total("contention_s"), comm_tail_s=total("comm_tail_s"),
                    backward_contention_s=total("backward_contention_s"),
                    host_wait_s=total("host_wait_s"), spans=last.spans)
