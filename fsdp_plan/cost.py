"""The step-time model: per-unit compute and collective times, simulated on two streams.

[Note: two-stream simulation]
Compute runs units in forward order, then in backward order. Each unit's all-gather must
finish before it computes; it is issued when the unit ``d`` places earlier starts (prefetch
depth ``d``; 0 means when the unit itself starts). Reduce-scatters (and HSDP all-reduces) are
issued when a unit's backward finishes. One communication stream runs collectives in issue
order. While a collective overlaps compute, compute slows by ``contention`` (collectives take
SMs and HBM bandwidth). Then, as DEVELOPERS.md defines:
    exposed = max(0, comm_finish - backward_finish); hidden = total - exposed
    step = forward + backward_with_contention + exposed + optimizer + bubbles
where bubbles are the times compute waited for an all-gather.
"""

from __future__ import annotations

import bisect
import math
import os
from dataclasses import dataclass, field

from fsdp_plan.errors import BadInput


@dataclass(kw_only=True, frozen=True)
class Hardware:
    """One GPU kind and its links; every field can be overridden from a YAML file."""

    name: str
    peak_flops: float
    """Dense bf16 FLOP/s."""
    efficiency: float = 0.5
    """Share of peak a real training step reaches."""
    hbm_bandwidth: float = 3.3e12
    intra_node_bandwidth: float = 360e9
    """Achieved bus bandwidth of NVLink collectives, bytes/s per GPU."""
    inter_node_bandwidth: float = 40e9
    """Achieved bus bandwidth across nodes (e.g. 400 Gb/s InfiniBand per GPU)."""
    collective_latency_s: float = 20e-6
    launch_overhead_s: float = 10e-6
    contention: float = 0.10
    """Fractional slowdown of compute while a collective overlaps it."""


GPUS: dict[str, Hardware] = {
    "h100": Hardware(name="h100", peak_flops=989e12, hbm_bandwidth=3.35e12),
    "h200": Hardware(name="h200", peak_flops=989e12, hbm_bandwidth=4.8e12),
    "a100": Hardware(name="a100", peak_flops=312e12, hbm_bandwidth=2.0e12,
                     intra_node_bandwidth=230e9, inter_node_bandwidth=20e9),
    "b200": Hardware(name="b200", peak_flops=2250e12, hbm_bandwidth=8.0e12,
                     intra_node_bandwidth=720e9, inter_node_bandwidth=80e9),
}


# field -> (lowest, lowest allowed?, highest, unit, example): what a hardware file may set.
# The bounds are generous (several times today's largest GPU) and only catch typing mistakes
# and unit slips (GB/s written as 40 instead of 40e9 would still pass; 0, negatives, NaN and
# infinities never do, because they turn into divisions by zero or NaN step times).
_HARDWARE_RANGES: dict[str, tuple[float, bool, float, str, str]] = {
    "peak_flops": (0.0, False, 1e18, "FLOP/s (dense bf16)", "989e12"),
    "efficiency": (0.0, False, 1.0, "share of peak, a fraction", "0.5"),
    "hbm_bandwidth": (0.0, False, 1e15, "bytes/s", "3.35e12"),
    "intra_node_bandwidth": (0.0, False, 1e15, "bytes/s per GPU", "360e9"),
    "inter_node_bandwidth": (0.0, False, 1e15, "bytes/s per GPU", "40e9"),
    "collective_latency_s": (0.0, True, 10.0, "seconds", "20e-6"),
    "launch_overhead_s": (0.0, True, 10.0, "seconds", "10e-6"),
    "contention": (0.0, True, 10.0, "fractional compute slowdown", "0.1"),
}


def _hardware_value(key: str, value: object, where: str) -> float:
    """One numeric hardware field, checked against ``_HARDWARE_RANGES``."""
    low, low_ok, high, unit, example = _HARDWARE_RANGES[key]
    expected = (f"a number {'>=' if low_ok else '>'} {low:g} and <= {high:g} in {unit}, "
                f"e.g. {key}: {example}")
    number: float | None = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:  # YAML 1.1 reads 989e12 (no dot) as a string
            number = float(value.strip())
        except ValueError:
            number = None
    if number is None:
        raise BadInput(f"{where}: {key} is {value!r} ({type(value).__name__}); expected {expected}.")
    if math.isnan(number) or number > high or number < low or (number == low and not low_ok):
        raise BadInput(f"{where}: {key} {value!r} is out of range; expected {expected}.")
    return number


def hardware_for(name: str, overrides: dict[str, object] | None = None,
                 where: str = "hardware file") -> Hardware:
    """The preset ``name`` with any field replaced from ``overrides`` (a hardware file's mapping).

    Every override is checked: a known field, a finite number in its range (units in
    ``_HARDWARE_RANGES``); ``name`` is text."""
    key = str(name).lower()
    if key not in GPUS:
        raise BadInput(f"unknown --gpu {name!r}; choose one of {', '.join(GPUS)}, or describe "
                       "the GPU in a hardware YAML file with --hardware.")
    hw = GPUS[key]
    if overrides is None:
        return hw
    if not isinstance(overrides, dict):
        raise BadInput(f"{where} must hold a mapping of field: value (e.g. peak_flops: 989e12), "
                       f"got {type(overrides).__name__}.")
    fields = {f: getattr(hw, f) for f in hw.__dataclass_fields__}
    unknown = sorted(str(k) for k in overrides if k not in fields)
    if unknown:
        raise BadInput(f"{where} sets unknown fields {', '.join(unknown)}; known fields: "
                       f"{', '.join(sorted(fields))}.")
    for field_name, value in overrides.items():
        if field_name == "name":
            if not isinstance(value, str) or not value.strip():
                raise BadInput(f"{where}: name is {value!r}; expected a GPU name as text.")
            fields["name"] = value
        else:
            fields[field_name] = _hardware_value(field_name, value, where)
    return Hardware(**fields)


MAX_HARDWARE_FILE_BYTES = 1 << 20


def read_hardware_file(path: str) -> dict[str, object]:
    """The mapping in a ``--hardware`` YAML file (read with ``safe_load``); checked by ``hardware_for``."""
    import yaml
    if os.path.exists(path) and not os.path.isfile(path):
        raise BadInput(f"--hardware {path!r} is not a regular file (a folder, pipe or device); "
                       "give the path of a YAML file such as one fsdp-plan calibrate writes.")
    if os.path.isfile(path) and os.path.getsize(path) > MAX_HARDWARE_FILE_BYTES:
        raise BadInput(f"--hardware {path!r} is {os.path.getsize(path):,} bytes; a hardware file "
                       f"is a few lines of field: value (at most {MAX_HARDWARE_FILE_BYTES:,} "
                       "bytes).")
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except UnicodeDecodeError as e:
        raise BadInput(f"--hardware {path!r} is not UTF-8 text (byte {e.start}); a hardware file "
                       "is YAML text such as peak_flops: 989e12.") from e
    except OSError as e:
        raise BadInput(f"--hardware {path!r} cannot be read: {e.strerror or e}.") from e
    except yaml.constructor.ConstructorError as e:
        raise BadInput(f"--hardware {path!r} holds a YAML tag that fsdp-plan never constructs "
                       f"({' '.join(str(e.problem).split())}); a hardware file is plain "
                       "field: number lines.") from e
    except yaml.YAMLError as e:
        raise BadInput(f"--hardware {path!r} is not valid YAML: {' '.join(str(e).split())}.") from e
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise BadInput(f"--hardware {path!r} must hold a mapping of field: value (e.g. "
                       f"peak_flops: 989e12), got {type(raw).__name__}.")
    return raw


def collective_time(hw: Hardware, nbytes: float, group: int, crosses_nodes: bool,
                    kind: str = "all_gather") -> float:
    """Ring time of one collective over ``group`` ranks moving ``nbytes`` (the full buffer)."""
    if group <= 1:
        return hw.launch_overhead_s
    bw = hw.inter_node_bandwidth if crosses_nodes else hw.intra_node_bandwidth
    factor = 2.0 if kind == "all_reduce" else 1.0
    return hw.launch_overhead_s + hw.collective_latency_s + factor * (group - 1) / group * nbytes / bw


@dataclass(kw_only=True)
class UnitCost:
    """Times of one unit: compute per pass and its collectives."""

    key: str
    fw_compute_s: float
    bw_compute_s: float
    all_gather_s: float
    reduce_scatter_s: float
    all_reduce_s: float = 0.0
    regather: bool = True


@dataclass(kw_only=True)
class StepTime:
    """The simulated step and its parts (seconds)."""

    step_s: float
    forward_s: float
    backward_s: float
    exposed_comm_s: float
    total_comm_s: float
    optimizer_s: float
    bubbles_s: float
    contention_s: float
    spans: list[tuple[str, str, float, float]] = field(default_factory=list)
    """(lane, label, start, end) for the report's timeline and the Chrome trace."""

    @property
    def hidden_comm_s(self) -> float:
        return self.total_comm_s - self.exposed_comm_s


def simulate_step(units: list[UnitCost], hw: Hardware, *, forward_prefetch: int = 0,
                  backward_prefetch: int = 1, optimizer_s: float = 0.0) -> StepTime:
    """Run the two-stream simulation over ``units`` given in forward order."""
    spans: list[tuple[str, str, float, float]] = []
    comm_free = 0.0
    comm_busy: list[tuple[float, float]] = []
    comm_ends: list[float] = []

    def issue(label: str, at: float, duration: float) -> float:
        nonlocal comm_free
        start = max(at, comm_free)
        comm_free = start + duration
        comm_busy.append((start, comm_free))
        comm_ends.append(comm_free)
        spans.append(("comm", label, start, comm_free))
        return comm_free

    def overlap(start: float, end: float) -> float:
        # comm_busy is sorted and disjoint (one stream): scan from the first busy span ending
        # after ``start``.
        total = 0.0
        i = bisect.bisect_right(comm_ends, start)
        while i < len(comm_busy) and comm_busy[i][0] < end:
            s, e = comm_busy[i]
            total += max(0.0, min(end, e) - max(start, s))
            i += 1
        return total

    def run_pass(order: list[UnitCost], phase: str, now: float, prefetch: int,
                 gathers: list[bool]) -> tuple[float, float, float]:
        ready: dict[int, float] = {}
        bubbles = contention = 0.0
        issued = 0
        for i, u in enumerate(order):
            # issue all-gathers up to ``prefetch`` units ahead of the one about to compute
            while issued < len(order) and issued <= i + prefetch:
                cost = order[issued]
                ready[issued] = (issue(f"AG {cost.key}", now, cost.all_gather_s)
                                 if gathers[issued] else now)
                issued += 1
            start = max(now, ready[i])
            bubbles += start - now
            duration = u.fw_compute_s if phase == "fw" else u.bw_compute_s
            slowed = duration * (1 + hw.contention * min(1.0, overlap(start, start + duration)
                                                          / max(duration, 1e-12)))
            contention += slowed - duration
            now = start + slowed
            spans.append(("compute", f"{phase.upper()} {u.key}", start, now))
            if phase == "bw":
                issue(f"RS {u.key}", now, u.reduce_scatter_s)
                if u.all_reduce_s:
                    issue(f"AR {u.key}", comm_free, u.all_reduce_s)
        return now, bubbles, contention

    fw_end, fw_bubbles, fw_cont = run_pass(units, "fw", 0.0, forward_prefetch, [True] * len(units))
    bw_order = list(reversed(units))
    bw_end, bw_bubbles, bw_cont = run_pass(bw_order, "bw", fw_end, backward_prefetch,
                                           [u.regather for u in bw_order])
    comm_finish = max([e for _, e in comm_busy], default=bw_end)
    exposed = max(0.0, comm_finish - bw_end)
    total_comm = sum(e - s for s, e in comm_busy)
    forward = sum(u.fw_compute_s for u in units)
    backward = sum(u.bw_compute_s for u in units)
    bubbles = fw_bubbles + bw_bubbles
    step = forward + backward + (fw_cont + bw_cont) + exposed + optimizer_s + bubbles
    end = bw_end + exposed
    spans.append(("compute", "optimizer", end, end + optimizer_s))
    return StepTime(step_s=step, forward_s=forward, backward_s=backward + bw_cont,
                    exposed_comm_s=exposed, total_comm_s=total_comm, optimizer_s=optimizer_s,
                    bubbles_s=bubbles, contention_s=fw_cont + bw_cont, spans=spans)
