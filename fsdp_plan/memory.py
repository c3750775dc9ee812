"""The per-rank memory model over one steady training step (SPEC section 5's "peak").

[Note: FSDP2 memory timeline]
Peak = max over the step of: sharded parameters, optimizer states and buffers (always live);
sharded gradients of the units already reduce-scattered; the activation timeline of the
analysis (see analysis.py); and what FSDP2 keeps unsharded at that moment:
- a unit's parameters, all-gathered in ``param_dtype`` when it (or, with prefetch, the unit
  ``d`` before it) starts forward, freed after its forward when it reshards, and gathered
  again for backward when the unit ahead of it in backward order starts (FSDP2's implicit
  backward prefetch), freed after its backward;
- the all-gather's flat output and input copies for an instant while it is copied out;
- a unit's unsharded gradients (``param_dtype``) during its backward;
- the reduce-scatter input (``reduce_dtype``, padded unsharded size), which FSDP2 keeps until
  the next unit's reduce-scatter is issued (``reduce_scatter_max_input_buffers = 1``).
The optimizer step (AdamW ``foreach``) needs one extra shard-sized temporary.
All figures are bytes per rank; the search calls ``estimate_peak`` thousands of times, so it
walks only the unit boundaries and reads activation maxima between them from a sparse table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fsdp_plan.analysis import Event
from fsdp_plan.units import UnitSpec

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd": 0, "none": 0}


@dataclass(kw_only=True, frozen=True)
class Precision:
    """Element sizes: the stored (sharded) parameters, the compute copy, the gradient reduction."""

    orig_bytes: int = 4
    param_bytes: int = 2
    reduce_bytes: int = 4


@dataclass(kw_only=True)
class StepContext:
    """What stays fixed while the search varies units, prefetch and checkpointing."""

    precision: Precision
    shard_size: int
    optimizer: str
    buffer_bytes: int
    input_bytes: int


@dataclass(kw_only=True)
class UnitWindows:
    """Event indices where a unit's forward and backward begin and end."""

    fw_start: int
    fw_end: int
    bw_start: int
    bw_end: int
    ran: bool = True


@dataclass(kw_only=True)
class MemoryEstimate:
    """The predicted peak and what it is made of at that moment."""

    peak_bytes: int
    phase: str
    breakdown: dict[str, int] = field(default_factory=dict)


class ActivationProfile:
    """One (composite) activation timeline with O(1) range maxima of its event peaks."""

    def __init__(self, events: list[Event]) -> None:
        self.events = events
        self.levels = [e.level for e in events]
        peaks = [e.peak for e in events]
        self._table = [peaks]
        span = 1
        while 2 * span <= len(peaks):
            prev = self._table[-1]
            self._table.append([max(prev[i], prev[i + span]) for i in range(len(prev) - span)])
            span *= 2
        self.backward_start = next((i for i, e in enumerate(events) if e.kind == "pre_bw"),
                                   len(events) - 1)
        self.forward_end = max(0, self.backward_start - 1)
        self._first: dict[tuple[str, str, bool], int] = {}
        self._last: dict[tuple[str, str, bool], int] = {}
        for i, e in enumerate(events):
            key = (e.kind, e.module, i >= self.backward_start)
            self._first.setdefault(key, i)
            self._last[key] = i

    def max_peak(self, lo: int, hi: int) -> int:
        """Highest event peak over indices ``lo..hi`` inclusive (0 for an empty range)."""
        if lo > hi:
            return 0
        level = (hi - lo + 1).bit_length() - 1
        row = self._table[level]
        return max(row[lo], row[hi - (1 << level) + 1])

    def windows(self, unit: UnitSpec) -> UnitWindows:
        """Where ``unit`` computes: its modules' first pre-forward to last post-forward, etc."""
        end = len(self.events) - 1
        if unit.modules == [""]:
            fw_end = self._last.get(("post_fw", "", False), self.forward_end)
            return UnitWindows(fw_start=0, fw_end=fw_end, bw_start=self.backward_start, bw_end=end)
        fw_starts = [self._first[k] for m in unit.modules if (k := ("pre_fw", m, False)) in self._first]
        fw_ends = [self._last[k] for m in unit.modules if (k := ("post_fw", m, False)) in self._last]
        bw_starts = [self._first[k] for m in unit.modules if (k := ("pre_bw", m, True)) in self._first]
        bw_ends = [self._last[k] for m in unit.modules if (k := ("post_bw", m, True)) in self._last]
        if not fw_starts:
            return UnitWindows(fw_start=0, fw_end=0, bw_start=end, bw_end=end, ran=False)
        fw_start, fw_end = min(fw_starts), max(fw_ends or fw_starts)
        bw_start = min(bw_starts) if bw_starts else self.backward_start
        # A unit whose inputs need no gradient (an embedding) gets its post-backward from
        # FSDP's end-of-backward callback.
        bw_end = max(bw_ends) if bw_ends and len(bw_ends) == len(bw_starts) else end
        return UnitWindows(fw_start=fw_start, fw_end=fw_end, bw_start=bw_start,
                           bw_end=max(bw_end, bw_start))


def estimate_peak(profile: ActivationProfile, units: list[UnitSpec], ctx: StepContext, *,
                  forward_prefetch: int = 0, backward_prefetch: int = 1) -> MemoryEstimate:
    """Peak bytes per rank of one steady step for ``units`` (children first, root last)."""
    p = ctx.precision
    shard = ctx.shard_size
    total_shard = sum(u.shard_numel for u in units)
    static = {
        "sharded_params": total_shard * p.orig_bytes,
        "optimizer_states": OPTIMIZER_STATES.get(ctx.optimizer, 0) * total_shard * p.orig_bytes
        + (4 * sum(u.num_params for u in units) if ctx.optimizer in ("adamw", "adam") else 0),
        "buffers": ctx.buffer_bytes,
        "inputs": ctx.input_bytes,
    }
    static_total = sum(static.values())
    windows = [profile.windows(u) for u in units]
    ran = [i for i, w in enumerate(windows) if w.ran and units[i].numel > 0]
    fw_order = sorted(ran, key=lambda i: windows[i].fw_start)
    bw_order = sorted(ran, key=lambda i: (windows[i].bw_end, -windows[i].bw_start))

    # (start_event, end_event, bytes, category): live for events start..end.
    live: list[tuple[int, int, int, str]] = []
    instants: list[tuple[int, int, str]] = []  # transient extra bytes at one event
    for pos, i in enumerate(fw_order):
        u, w = units[i], windows[i]
        unsharded = u.unsharded_numel(shard) * p.param_bytes
        gather_at = windows[fw_order[max(0, pos - forward_prefetch)]].fw_start
        free_at = w.fw_end if u.reshard_after_forward else w.bw_end
        live.append((gather_at, free_at, unsharded, "unsharded_params"))
        instants.append((gather_at, unsharded + u.shard_numel * p.param_bytes, "comm_buffers"))
    bw_sequence = sorted(ran, key=lambda i: windows[i].bw_start)
    for pos, i in enumerate(bw_sequence):
        u, w = units[i], windows[i]
        unsharded = u.unsharded_numel(shard) * p.param_bytes
        if u.reshard_after_forward:
            gather_at = windows[bw_sequence[max(0, pos - backward_prefetch)]].bw_start
            gather_at = min(gather_at, w.bw_start)
            live.append((gather_at, w.bw_end, unsharded, "unsharded_params"))
            instants.append((gather_at, unsharded + u.shard_numel * p.param_bytes, "comm_buffers"))
        live.append((w.bw_start, w.bw_end, u.unsharded_numel(shard) * p.param_bytes, "unsharded_grads"))
    last = len(profile.events) - 1
    grads_by_event: list[tuple[int, int]] = []
    for pos, i in enumerate(bw_order):
        u, w = units[i], windows[i]
        rs_input = u.unsharded_numel(shard) * p.reduce_bytes
        nxt = windows[bw_order[pos + 1]].bw_end if pos + 1 < len(bw_order) else last
        live.append((w.bw_end, nxt, rs_input, "comm_buffers"))
        grads_by_event.append((w.bw_end, u.shard_numel * p.orig_bytes))

    boundaries = sorted({0, last, *(s for s, _, _, _ in live), *(e for _, e, _, _ in live)})
    best = MemoryEstimate(peak_bytes=-1, phase="", breakdown={})
    for idx, event in enumerate(boundaries):
        lo = boundaries[idx - 1] + 1 if idx else 0
        for point, act in ((event, profile.max_peak(lo, event)), (event, profile.levels[event])):
            is_instant = act == profile.levels[event] and point == event
            parts: dict[str, int] = dict(static)
            for s, e, nbytes, cat in live:
                # A buffer allocated at ``s`` is not in the interval before ``s`` (its peak).
                inside = s <= point <= e if is_instant else s < point <= e
                if inside:
                    parts[cat] = parts.get(cat, 0) + nbytes
            if is_instant:
                for at, nbytes, cat in instants:
                    if at == point:
                        parts[cat] = parts.get(cat, 0) + nbytes
            parts["sharded_grads"] = sum(b for at, b in grads_by_event if at < point)
            parts["activations"] = act
            total = sum(parts.values())
            if total > best.peak_bytes:
                phase = "forward" if point <= profile.forward_end else "backward"
                best = MemoryEstimate(peak_bytes=total, phase=f"{phase} ({profile.events[point].kind} "
                                      f"{profile.events[point].module or '<root>'})", breakdown=parts)
    optimizer_step = static_total + total_shard * p.orig_bytes + (
        total_shard * p.orig_bytes if OPTIMIZER_STATES.get(ctx.optimizer, 0) else 0)
    if optimizer_step > best.peak_bytes:
        best = MemoryEstimate(peak_bytes=optimizer_step, phase="optimizer step", breakdown={
            **static, "sharded_grads": total_shard * p.orig_bytes,
            "optimizer_temporaries": optimizer_step - static_total - total_shard * p.orig_bytes})
    return best
