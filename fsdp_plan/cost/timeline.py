"""Activation timelines for a plan: compose the plain and checkpointed passes, and find unit boundaries.

[Note: composing checkpointed blocks]
The analysis ran three times: no checkpointing, every repeated block fully checkpointed, and
every repeated block selectively checkpointed. A plan that checkpoints some blocks (in either
mode) takes each block's forward and backward segment from the pass that matches its mode
and everything else (embedding, head, loss) from the plain pass; levels are re-based segment
by segment, so the composite is what a run with exactly those modes records. The search
checkpoints the first blocks (full ones first, then selective ones; for identical blocks the
peak depends only on how many of each there are); a plan written by hand may give any block
any mode, which composes the same way.

[Note: compiled timeline]
With ``--compile`` every repeated block runs compiled, and what its forward leaves alive is
the AOTAutograd partition's (facts/compiled.py [Note: compiled blocks]), not the eager
pass's. ``compiled_timeline`` derives the plain pass of a compiled model from the eager one:
over each block's forward segment the level rises by the partition's ``kept_bytes`` instead
of the eager rise, the difference carried on through every later event until that block's
backward segment ends (its saved tensors are freed there). Events inside a block keep the
eager shape, shifted by the difference and held no lower than the level the segment starts
from (forward) or ends at (backward): transients inside a compiled block are modelled on the
eager ones, not on fused kernels. Checkpointed blocks are derived the same way from the
pass of their mode (fully or selectively checkpointed), with what the partition of the block
compiled inside that mode's checkpoint wrapper keeps (``kept_bytes(block, mode)``); a mode
whose wrapper did not compile is not offered.
The backward of a compiled block is one graph (for a checkpointed block, the recompute and
the backward together), and it holds at least its own op-by-op peak (``bw_peak_bytes``) on
top of the level its segment starts from: the segment's highest peak is raised to that when
the eager shape stays below it. The eager shape can be far lower where eager runs a single
kernel that the decomposed graph spreads over float32 intermediates (GPT-2's LayerNorm and
tanh GELU: a fully checkpointed tiny GPT-2 was predicted 12.5% under the measured compiled
step). On a GPU inductor fuses most of those intermediates away, so there it is an upper
bound.

[Note: autocast and checkpointed blocks]
Under ``torch.autocast`` a checkpointed block's forward still casts its weights, and the
autocast weight cache holds those casts (nothing saves them for backward) until the autocast
region ends after the loss; the recompute casts again. That release is not local to the
block's segments: it happens in the glue between forward and backward, which the composite
takes from the plain pass, where it frees nothing of the block (its casts are saved for
backward). So each pass records the bytes freed at the region's end by the module that made
them (``Timeline.autocast_released``) and where the region ends (an ``autocast_exit`` event),
and the composite releases there what the checkpointed blocks' passes released beyond the
plain pass.
"""

from __future__ import annotations

import bisect
import dataclasses
from dataclasses import dataclass

from fsdp_plan.common.errors import BadInput
from fsdp_plan.facts.types import AUTOCAST_EXIT, Analysis, Event, Timeline


@dataclass(kw_only=True)
class Segments:
    """Index ranges of one pass: per block a forward and a backward segment, and the glue."""

    fw: list[tuple[int, int]]
    bw: list[tuple[int, int]]
    prefix_end: int
    middle: tuple[int, int]
    suffix_start: int


def _first(index: dict[tuple[str, str], list[int]], kind: str, module: str,
           start: int = 0) -> int | None:
    """The first event ``kind`` of ``module`` at or after ``start`` (``index`` from
    ``_positions``), by bisection: a linear scan per block was quadratic in the depth."""
    positions = index.get((kind, module), [])
    at = bisect.bisect_left(positions, start)
    return positions[at] if at < len(positions) else None


def _positions(events: list[Event]) -> dict[tuple[str, str], list[int]]:
    index: dict[tuple[str, str], list[int]] = {}
    for i, e in enumerate(events):
        index.setdefault((e.kind, e.module), []).append(i)
    return index


def find_segments(timeline: Timeline, blocks: list[str]) -> Segments | None:
    """Split ``timeline`` at the blocks' first pre-forward and pre-backward events."""
    ev = _positions(timeline.events)
    fw_starts = [_first(ev, "pre_fw", b) for b in blocks]
    bw_starts = [_first(ev, "pre_bw", b) for b in blocks]
    if not blocks or None in fw_starts or None in bw_starts:
        return None
    if fw_starts != sorted(fw_starts) or bw_starts != sorted(bw_starts, reverse=True):
        return None
    last_fw_end = _first(ev, "post_fw", blocks[-1], fw_starts[-1])
    first_bw_end = _first(ev, "post_bw", blocks[0], bw_starts[0])
    if last_fw_end is None or first_bw_end is None:
        return None
    fw = [(fw_starts[i], fw_starts[i + 1]) for i in range(len(blocks) - 1)]
    fw.append((fw_starts[-1], last_fw_end + 1))
    bw = [(bw_starts[i], bw_starts[i - 1]) for i in range(1, len(blocks))]
    bw.insert(0, (bw_starts[0], first_bw_end + 1))
    return Segments(fw=fw, bw=bw, prefix_end=fw_starts[0], middle=(last_fw_end + 1, bw_starts[-1]),
                    suffix_start=first_bw_end + 1)


def compiled_timeline(plain: Timeline, segments: Segments, kept: list[int | None],
                      bw_peak: list[int | None] | None = None) -> Timeline:
    """The plain pass with block ``i``'s forward leaving ``kept[i]`` bytes alive (None: as
    eager) and its backward holding at least ``bw_peak[i]`` over the level it starts from;
    see [Note: compiled timeline]."""
    events = plain.events
    n = len(events)
    shift = [0] * (n + 1)
    for i, k in enumerate(kept):
        if k is None:
            continue
        (fs, fe), (_bs, be) = segments.fw[i], segments.bw[i]
        d = k - (events[fe].level - events[fs].level if fe < n else 0)
        shift[fs + 1] += d
        shift[be] -= d
    offsets, running = [], 0
    for j in range(n):
        running += shift[j]
        offsets.append(running)
    floor = [None] * n
    for i, k in enumerate(kept):
        if k is None:
            continue
        (fs, fe), (bs, be) = segments.fw[i], segments.bw[i]
        for j in range(fs + 1, fe):
            floor[j] = events[fs].level + offsets[fs]
        end = events[be].level + offsets[be] if be < n else plain.final_level
        for j in range(bs, be):
            floor[j] = end
    out = []
    for j, e in enumerate(events):
        level = e.level + offsets[j]
        if floor[j] is not None:
            level = max(level, floor[j])
        out.append(dataclasses.replace(e, level=level, peak=max(level, e.peak + offsets[j])))
    for i, held in enumerate(bw_peak or []):
        bs, be = segments.bw[i]
        if held is None or kept[i] is None or bs >= min(be, n):
            continue
        top = max(range(bs, min(be, n)), key=lambda j: out[j].peak)
        least = out[bs].level + held
        if out[top].peak < least:
            out[top] = dataclasses.replace(out[top], peak=least)
    return dataclasses.replace(plain, events=out)


class TimelineComposer:
    """Builds (and caches) the timeline for per-block checkpointing modes (blocks by index).

    Each block's forward and backward segments come from the pass of its mode: the plain
    pass (none), the all-blocks-checkpointed pass (full) or the all-blocks-selective pass
    (selective); the glue (embedding, head, loss) from the plain pass."""

    def __init__(self, analysis: Analysis, blocks: list[str]) -> None:
        self.plain = analysis.timeline
        self.ckpt = analysis.checkpointed_timeline
        self.sel = getattr(analysis, "selective_timeline", None)
        self.blocks = blocks
        self.plain_seg = find_segments(self.plain, blocks)
        compiled = getattr(analysis, "compiled", None)
        if compiled is not None and self.plain_seg is None:
            raise BadInput("--compile needs the model's repeated blocks to run one after the "
                           "other in forward and in reverse in backward (aligned block "
                           "segments); this model's do not, so compiled blocks cannot be "
                           "planned. Plan without --compile.")
        self.ckpt_seg = find_segments(self.ckpt, blocks) if self.ckpt else None
        self.sel_seg = find_segments(self.sel, blocks) if self.sel else None
        if compiled is not None:  # [Note: compiled timeline], each mode from its own pass
            self.plain = compiled_timeline(self.plain, self.plain_seg,
                                           [compiled.kept_bytes(b) for b in blocks],
                                           [compiled.bw_peak_bytes(b) for b in blocks])
            self.ckpt, self.sel = (
                compiled_timeline(src, seg, [compiled.kept_bytes(b, mode) for b in blocks],
                                  [compiled.bw_peak_bytes(b, mode) for b in blocks])
                if src is not None and seg is not None and mode in compiled.by_mode else None
                for src, seg, mode in ((self.ckpt, self.ckpt_seg, "full"),
                                       (self.sel, self.sel_seg, "selective")))
            self.ckpt_seg, self.sel_seg = (self.ckpt_seg if self.ckpt else None,
                                           self.sel_seg if self.sel else None)
        self._released = {mode: self._released_per_block(timeline) for mode, timeline in
                          (("none", self.plain), ("full", self.ckpt), ("selective", self.sel))}
        every = frozenset(range(len(blocks)))
        self._cache: dict[tuple[frozenset[int], frozenset[int]], list[Event]] = {
            (frozenset(), frozenset()): self.plain.events}
        if self.ckpt is not None:
            self._cache[(every, frozenset())] = self.ckpt.events
        if self.sel is not None:
            self._cache[(frozenset(), every)] = self.sel.events

    def _released_per_block(self, timeline: Timeline | None) -> list[int]:
        """Per block: the bytes its modules' forward left to the autocast cache in ``timeline``
        ([Note: autocast and checkpointed blocks]); zeros without autocast."""
        out = [0] * len(self.blocks)
        released = timeline.autocast_released if timeline is not None else {}
        if not released:
            return out
        index = {b: i for i, b in enumerate(self.blocks)}
        for fqn, nbytes in released.items():
            name = fqn
            while name and name not in index:
                name = name.rpartition(".")[0]
            if name in index:
                out[index[name]] += nbytes
        return out

    def released_delta(self, i: int, mode: str) -> int:
        """What block ``i`` in ``mode`` frees at the end of the autocast region beyond what it
        frees without checkpointing (0 for ``none`` and without autocast)."""
        return self._released[mode][i] - self._released["none"][i] if mode != "none" else 0

    @property
    def max_checkpointed(self) -> int:
        """How many blocks can be checkpointed (0 when the model has no repeated blocks)."""
        return len(self.blocks) if self.ckpt is not None else 0

    @property
    def has_selective(self) -> bool:
        """Whether blocks can be selectively checkpointed (the selective pass replayed)."""
        return self.sel is not None and (self.sel_seg is not None or not self.blocks)

    def supports_partial(self) -> bool:
        return self.plain_seg is not None and self.ckpt_seg is not None

    def supports_mixed(self) -> bool:
        """Whether modes can be mixed per block (every pass splits into block segments)."""
        return self.supports_partial() and self.sel_seg is not None

    def _source(self, i: int, full: frozenset[int], selective: frozenset[int]
                ) -> tuple[list[Event], Segments]:
        if i in full:
            return self.ckpt.events, self.ckpt_seg
        if i in selective:
            return self.sel.events, self.sel_seg
        return self.plain.events, self.plain_seg

    def segment_delta(self, i: int, mode: str, part: str = "fw") -> tuple[int, float]:
        """Level and FLOP change over block ``i``'s forward (``part="fw"``) or backward
        segment in the pass of ``mode``: what the block keeps for backward, what it computes."""
        src, seg = {"none": (self.plain, self.plain_seg), "full": (self.ckpt, self.ckpt_seg),
                    "selective": (self.sel, self.sel_seg)}[mode]
        if src is None or seg is None:
            return 0, 0.0
        start, end = (seg.fw if part == "fw" else seg.bw)[i]
        events = src.events
        nxt = events[end] if end < len(events) else events[end - 1]
        return nxt.level - events[start].level, nxt.flops - events[start].flops

    def events(self, checkpointed: int | frozenset[int],
               selective: frozenset[int] = frozenset()) -> list[Event]:
        """The composite timeline with blocks ``0..k-1`` (an int ``k``) or the given block
        indices (a frozenset) fully checkpointed, and the ``selective`` indices selectively."""
        which = frozenset(range(checkpointed)) if isinstance(checkpointed, int) else checkpointed
        selective = frozenset(selective) - which
        key = (which, selective)
        if key in self._cache:
            return self._cache[key]
        if not self.supports_partial() or (selective and self.sel_seg is None):
            raise ValueError("partial checkpointing needs aligned block segments")
        p = self.plain_seg
        # [Note: autocast and checkpointed blocks]: released in the glue, at the autocast exit
        cached = sum(self.released_delta(i, "full") for i in which) + sum(
            self.released_delta(i, "selective") for i in selective)
        release_at = next((k for k in range(*p.middle)
                           if self.plain.events[k].kind in (AUTOCAST_EXIT, "pre_bw")), p.middle[1])
        pieces: list[tuple[list[Event], int, int]] = [(self.plain.events, 0, p.prefix_end)]
        for i in range(len(self.blocks)):
            src, seg = self._source(i, which, selective)
            pieces.append((src, *seg.fw[i]))
        pieces.append((self.plain.events, *p.middle))
        for i in reversed(range(len(self.blocks))):
            src, seg = self._source(i, which, selective)
            pieces.append((src, *seg.bw[i]))
        pieces.append((self.plain.events, p.suffix_start, len(self.plain.events)))
        out: list[Event] = []
        level = 0
        flops = 0.0
        for src, start, end in pieces:
            if start >= end:
                continue
            base_level, base_flops = src[start].level, src[start].flops
            glue = src is self.plain.events and (start, end) == p.middle
            if glue and cached:
                out.extend(_release_in_glue(src, start, end, level - base_level,
                                            flops - base_flops, cached, release_at))
            else:
                for e in src[start:end]:
                    # Re-base on the composite's running level; a piece's first peak covered
                    # the gap before it in its own pass, so it is at least the level it starts
                    # from.
                    peak = level + e.peak - base_level
                    # built directly: dataclasses.replace took half the time of a search's
                    # new checkpointing mixes (70B: 190,000 events per search)
                    out.append(Event(kind=e.kind, module=e.module,
                                     level=level + e.level - base_level,
                                     peak=max(level, peak) if e is src[start] else peak,
                                     flops=flops + e.flops - base_flops, ops=e.ops))
            nxt = src[end] if end < len(src) else src[end - 1]
            level += nxt.level - base_level - (cached if glue else 0)
            flops += nxt.flops - base_flops
        self._cache[key] = out
        return out


def _release_in_glue(src: list[Event], start: int, end: int, shift: int, flops_shift: float,
                     cached: int, release_at: int) -> list[Event]:
    """The glue ``src[start:end]`` re-based by ``shift`` bytes and ``flops_shift`` FLOPs, with
    the checkpointed blocks' autocast casts (``cached`` bytes) freed at event ``release_at``
    ([Note: autocast and checkpointed blocks]; facts without an ``autocast_exit`` event: the
    first backward event). The peak of the gap before that event still holds them."""
    out = []
    level = shift + src[start].level
    for k in range(start, end):
        e = src[k]
        now = shift + e.level - (cached if k >= release_at else 0)
        peak = shift + e.peak - (cached if k > release_at else 0)
        out.append(Event(kind=e.kind, module=e.module, level=now,
                         peak=max(level, peak) if k == start else max(peak, now),
                         flops=flops_shift + e.flops, ops=e.ops))
    return out
