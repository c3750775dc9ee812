"""Activation timelines for a plan: compose the plain and checkpointed passes, and find unit boundaries.

[Note: composing checkpointed blocks]
The analysis ran twice: no checkpointing, and every repeated block checkpointed. A plan that
checkpoints the first ``k`` blocks takes each block's forward and backward segment from the
pass that matches it and everything else (embedding, head, loss) from the plain pass; levels
are re-based segment by segment, so the composite is what a run with exactly those blocks
checkpointed records. The search checkpoints the first blocks (the choice that frees the most
memory earliest; for identical blocks the peak depends only on how many are checkpointed); a
plan written by hand may checkpoint any set of blocks, which composes the same way.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from fsdp_plan.facts import Analysis, Event, Timeline


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


class TimelineComposer:
    """Builds (and caches) the timeline for a set of checkpointed blocks (by index)."""

    def __init__(self, analysis: Analysis, blocks: list[str]) -> None:
        self.plain = analysis.timeline
        self.ckpt = analysis.checkpointed_timeline
        self.blocks = blocks
        self.plain_seg = find_segments(self.plain, blocks)
        self.ckpt_seg = find_segments(self.ckpt, blocks) if self.ckpt else None
        self._cache: dict[frozenset[int], list[Event]] = {frozenset(): self.plain.events}
        if self.ckpt is not None:
            self._cache[frozenset(range(len(blocks)))] = self.ckpt.events

    @property
    def max_checkpointed(self) -> int:
        """How many blocks can be checkpointed (0 when the model has no repeated blocks)."""
        return len(self.blocks) if self.ckpt is not None else 0

    def supports_partial(self) -> bool:
        return self.plain_seg is not None and self.ckpt_seg is not None

    def events(self, checkpointed: int | frozenset[int]) -> list[Event]:
        """The composite timeline with blocks ``0..k-1`` (an int ``k``) or the given block
        indices (a frozenset) checkpointed."""
        which = frozenset(range(checkpointed)) if isinstance(checkpointed, int) else checkpointed
        if which in self._cache:
            return self._cache[which]
        if not self.supports_partial():
            raise ValueError("partial checkpointing needs aligned block segments")
        p, c = self.plain_seg, self.ckpt_seg
        pieces: list[tuple[list[Event], int, int]] = [(self.plain.events, 0, p.prefix_end)]
        for i in range(len(self.blocks)):
            src, seg = (self.ckpt.events, c) if i in which else (self.plain.events, p)
            pieces.append((src, *seg.fw[i]))
        pieces.append((self.plain.events, *p.middle))
        for i in reversed(range(len(self.blocks))):
            src, seg = (self.ckpt.events, c) if i in which else (self.plain.events, p)
            pieces.append((src, *seg.bw[i]))
        pieces.append((self.plain.events, p.suffix_start, len(self.plain.events)))
        out: list[Event] = []
        level = 0
        flops = 0.0
        for src, start, end in pieces:
            if start >= end:
                continue
            base_level, base_flops = src[start].level, src[start].flops
            for e in src[start:end]:
                # Re-base on the composite's running level; a piece's first peak covered the
                # gap before it in its own pass, so it is at least the level it starts from.
                peak = level + e.peak - base_level
                out.append(Event(kind=e.kind, module=e.module, level=level + e.level - base_level,
                                 peak=max(level, peak) if e is src[start] else peak,
                                 flops=flops + e.flops - base_flops))
            nxt = src[end] if end < len(src) else src[end - 1]
            level += nxt.level - base_level
            flops += nxt.flops - base_flops
        self._cache[which] = out
        return out
