"""Which ``bucket_cap_mb`` built the DDP buckets a trace shows, from the model's gradients in
the order DDP's reducer records them (cost/ddp_buckets.py [Note: DDP buckets]).

[Note: the cap read back]
DDP closes a bucket once its bytes reach the cap (the parameter that crosses it included).
Measured buckets that split the ready-ordered gradients into consecutive groups fix the cap
to an interval: above every group's bytes without its last parameter (no bucket closed
early) and at most every closed group's bytes (each did close). The default
(``bucket_cap_mb`` unset: 1 MiB first bucket, 25 MiB after) is tried first, as
``assign_by_size`` builds it; otherwise the interval is reported with its roundest value
(fewest significant digits, then the largest power of ten, then the smallest).
"""

from __future__ import annotations

import math

from fsdp_plan.cost.ddp_buckets import DEFAULT_BUCKET_CAP_MB, DEFAULT_FIRST_BUCKET_MB, MIB, \
    assign_by_size


def _groups(sizes: list[int], measured: list[int]) -> list[list[int]] | None:
    """``sizes`` cut into consecutive groups of the measured byte counts, or None."""
    groups, at = [], 0
    for want in measured:
        group, total = [], 0
        while at < len(sizes) and total < want:
            group.append(sizes[at])
            total += sizes[at]
            at += 1
        if total != want:
            return None
        groups.append(group)
    return groups if at == len(sizes) else None


def cap_interval_mb(sizes: list[int], measured: list[int]) -> tuple[float, float] | None:
    """The (exclusive low, inclusive high) caps in MiB under which an explicit
    ``bucket_cap_mb`` builds ``measured`` from ``sizes`` (bytes in ready order)."""
    groups = _groups(sizes, measured)
    if not groups:
        return None
    low = max(sum(g) - g[-1] for g in groups)
    high = min((sum(g) for g in groups[:-1]), default=math.inf)
    return (low / MIB, high / MIB) if low < high else None


def roundest(low: float, high: float) -> float:
    """The roundest number in ``(low, high]`` ([Note: the cap read back])."""
    if math.isinf(high):
        high = max(low * 2, DEFAULT_BUCKET_CAP_MB)
    for digits in range(1, 8):
        for exponent in range(6, -8, -1):
            step = 10.0 ** (exponent - digits + 1)
            first = math.floor(low / step) + 1
            value = first * step
            if value <= high and value >= 10.0 ** exponent and value < 10.0 ** (exponent + 1):
                return float(f"{value:.{digits}g}")
    return high


def cap_that_built(sizes: list[int], measured: list[int]
                   ) -> tuple[float, tuple[float, float] | None] | None:
    """(bucket_cap_mb, its interval or None for the default) that builds ``measured``."""
    default = assign_by_size(sizes, [DEFAULT_FIRST_BUCKET_MB * MIB, DEFAULT_BUCKET_CAP_MB * MIB])
    if [sum(sizes[i] for i in g) for g in default] == list(measured):
        return float(DEFAULT_BUCKET_CAP_MB), None
    interval = cap_interval_mb(sizes, measured)
    if interval is None:
        return None
    return roundest(*interval), interval
