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

[Note: timeline columns]
The search composes dozens of checkpointing mixes per plan (Llama-70B's: 28, of 3,900 to
6,100 events each) and reads them only through ``ActivationProfile`` (cost/memory.py), which wants
arrays: levels, peaks, and each event's kind and module. So a timeline is held as
``EventColumns``: numpy int64 levels and peaks, float64 FLOPs, an int64 code per (kind,
module) (``EventNames``, numbered once per composer), and lists of kinds, modules and op
counters. A composite is the passes' columns taken piece by piece (one index into the passes
laid side by side, ``_Stacked``), each piece shifted by its offset, with the same integer and
floating-point operations, in the same order, as the per-event rule it replaced
(tests/test_timeline_columns.py keeps that rule), so every figure is bit for bit what it
was. A composite's lists are cut from its pieces only when something asks for them, as are
its FLOPs (and a pass's) and the ``Event`` objects (pictures, ``memory_timeline``): the
search reads the codes, levels and peaks, and a profile names an event by its code
(``EventNames.named``). A pass's own columns give back the pass's ``Event`` list itself.
The memory model places a layout's buffers on a mix's hook frame (cost/memory.py [Note: hook
frames]), shared by every mix whose hooks name the same modules in the same order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, overload

from fsdp_plan.common.errors import BadInput
from fsdp_plan.facts.types import AUTOCAST_EXIT, Analysis, Event, Timeline

if TYPE_CHECKING:
    import numpy as np


class EventNames:
    """Integer ids of the event kinds and modules of a composer's passes, shared by them and
    by their mixes: ``EventColumns.codes`` names an event's (kind, module) by one integer, so
    the memory model indexes events by sorting integers, not by hashing tuples."""

    def __init__(self) -> None:
        self.kinds: dict[str, int] = {}
        self.modules: dict[str, int] = {}
        self.frames: dict[bytes, object] = {}
        """The hook frames of these names' mixes, by their hook events' codes (cost/memory.py
        [Note: hook frames]; an ``ActivationProfile``, which this module cannot name)."""
        self._by_id: tuple[list[str], list[str]] = ([], [])
        """The kinds' and the modules' names by id (``_names_by_id``)."""
        self._keys: dict[tuple, list[int]] = {}
        """``keys`` by its arguments and how many names there were (a name added later
        would change what a lookup of it gives)."""
        self._last: tuple[list[str], list[str], np.ndarray] | None = None
        """The last ``codes`` asked for, with its arguments."""
        self.segments: dict[tuple[int, tuple[str, ...]], tuple[np.ndarray, Segments | None]] = {}
        """``find_segments`` of passes whose columns have these names, by the identity of
        their codes (kept beside, read only) and the blocks: passes that share their codes
        (``codes``) share their segments."""

    def codes(self, kinds: list[str], modules: list[str]) -> np.ndarray:
        """``code(kind, module)`` of each event (new names get the next ids), read only: the
        same array again for the same events (the checkpointed passes replay the same
        modules' hooks in the same order, whatever their policy)."""
        last = self._last
        if last is not None and last[0] == kinds and last[1] == modules:
            return last[2]
        codes = self._ids(self.kinds, kinds) << 32 | self._ids(self.modules, modules)
        codes.flags.writeable = False
        self._last = (kinds, modules, codes)
        return codes

    @staticmethod
    def _ids(table: dict[str, int], names: list[str]) -> np.ndarray:
        """The id of each of ``names`` in ``table``, new names numbered on in the order they
        first appear (a pass has thousands of events and a few hundred names)."""
        import numpy as np  # numpy on first use (cost/memory.py [Note: numpy on first use])

        for name in dict.fromkeys(names):
            table.setdefault(name, len(table))
        return np.fromiter(map(table.__getitem__, names), dtype=np.int64, count=len(names))

    def named(self, code: int) -> tuple[str, str]:
        """The (kind, module) whose ``code`` this is."""
        kinds, modules = self._names_by_id()
        return kinds[code >> 32], modules[code & 0xFFFFFFFF]

    def module_names(self, codes: np.ndarray) -> list[str]:
        """The module of each of ``codes``."""
        modules = self._names_by_id()[1]
        return [modules[i] for i in (codes & 0xFFFFFFFF).tolist()]

    def _names_by_id(self) -> tuple[list[str], list[str]]:
        """The kinds' and the modules' names by id (ids are their order in the tables)."""
        if len(self._by_id[0]) != len(self.kinds) or len(self._by_id[1]) != len(self.modules):
            self._by_id = (list(self.kinds), list(self.modules))
        return self._by_id

    def code(self, kind: str, module: str) -> int | None:
        """The integer of (``kind``, ``module``): the kind's id above the module's 32-bit id
        (None for a name no event has)."""
        k, m = self.kinds.get(kind), self.modules.get(module)
        return None if k is None or m is None else k << 32 | m

    def keys(self, kind: str, modules: tuple[str, ...], in_backward: bool) -> list[int]:
        """``code(kind, m) << 1 | in_backward`` of each of ``modules``, -1 for a name no event
        has: how the memory model indexes a pass's first and last events (cost/memory.py
        ``_first_and_last``). Cached: every mix of a composer's passes asks for the same
        units' modules (read only)."""
        key = (kind, modules, in_backward, len(self.kinds), len(self.modules))
        found = self._keys.get(key)
        if found is None:
            code = self.code
            found = self._keys[key] = [-1 if (c := code(kind, m)) is None
                                       else c << 1 | in_backward for m in modules]
        return found


class EventColumns(Sequence[Event]):
    """A timeline's events held field by field ([Note: timeline columns]): a sequence of
    ``Event`` whose objects are made on first use, beside the arrays the memory model reads."""

    __slots__ = ("_events", "_flops", "_flops_of", "_kinds", "_modules", "_ops", "_slices",
                 "codes", "levels", "names", "peaks")

    def __init__(self, *, kinds: list[str] | None = None, modules: list[str] | None = None,
                 levels: np.ndarray, peaks: np.ndarray,
                 flops: np.ndarray | Callable[[], np.ndarray],
                 ops: list[dict[str, float] | None] | None = None, names: EventNames,
                 codes: np.ndarray, events: list[Event] | None = None,
                 slices: list[tuple[EventColumns, int, int]] | None = None) -> None:
        """``kinds``, ``modules`` and ``ops`` as lists, or (a composite) the ``slices`` of other
        columns they are cut from, on first use: the search reads a composite's events
        through its arrays only; ``flops`` likewise, or what makes them on first use (the
        search reads no FLOPs of a pass's or a composite's columns)."""
        for array in (levels, peaks, codes):
            array.flags.writeable = False  # shared between a pass and the profiles of its mixes
        self._flops, self._flops_of = (None, flops) if callable(flops) else (flops, None)
        if self._flops is not None:
            self._flops.flags.writeable = False
        self._kinds, self._modules, self._ops = kinds, modules, ops
        self._slices = slices
        self.names = names
        self.codes = codes
        """int64 ``names.code(kind, module)`` of each event."""
        self.levels = levels
        """int64 activation-side bytes at each event."""
        self.peaks = peaks
        """int64 highest activation-side bytes since the previous event."""
        self._events = events

    @property
    def flops(self) -> np.ndarray:
        """float64 cumulative FLOPs of each event."""
        if self._flops is None:
            assert self._flops_of is not None, "columns have FLOPs or what makes them"
            self._flops, self._flops_of = self._flops_of(), None
            self._flops.flags.writeable = False
        return self._flops

    @property
    def kinds(self) -> list[str]:
        """Each event's kind."""
        if self._kinds is None:
            self._cut()
        return self._kinds  # type: ignore[return-value]

    @property
    def modules(self) -> list[str]:
        """Each event's module FQN."""
        if self._modules is None:
            self._cut()
        return self._modules  # type: ignore[return-value]

    @property
    def ops(self) -> list[dict[str, float] | None]:
        """Each event's op-class counters (None: none recorded)."""
        if self._ops is None:
            self._cut()
        return self._ops  # type: ignore[return-value]

    def _cut(self) -> None:
        """The lists, cut from the ``slices`` in turn (columns made of codes alone, without
        slices: named from their codes, with no op counters)."""
        kinds: list[str] = []
        modules: list[str] = []
        ops: list[dict[str, float] | None] = []
        if self._slices is None:
            named = [self.names.named(code) for code in self.codes.tolist()]
            kinds, modules = [k for k, _ in named], [m for _, m in named]
            ops = [None] * len(named)
        for src, start, end in self._slices or ():
            kinds += src.kinds[start:end]
            modules += src.modules[start:end]
            ops += src.ops[start:end]
        self._kinds, self._modules, self._ops = kinds, modules, ops

    @classmethod
    def of(cls, events: list[Event], names: EventNames | None = None) -> EventColumns:
        """The columns of ``events``, which stay the sequence's own ``Event`` objects (their
        names numbered in ``names``, a table of their own when not given)."""
        import numpy as np  # numpy on first use (cost/memory.py [Note: numpy on first use])

        names = names if names is not None else EventNames()
        kinds, modules = [e.kind for e in events], [e.module for e in events]
        return cls(kinds=kinds, modules=modules,
                   levels=np.array([e.level for e in events], dtype=np.int64),
                   peaks=np.array([e.peak for e in events], dtype=np.int64),
                   flops=lambda: np.array([e.flops for e in events], dtype=np.float64),
                   ops=[e.ops for e in events], names=names,
                   codes=names.codes(kinds, modules), events=events)

    def as_list(self) -> list[Event]:
        """The events as ``Event`` objects (made once, then kept)."""
        if self._events is None:
            self._events = [
                Event(kind=kind, module=module, level=level, peak=peak, flops=flops, ops=ops)
                for kind, module, level, peak, flops, ops in zip(
                    self.kinds, self.modules, self.levels.tolist(), self.peaks.tolist(),
                    self.flops.tolist(), self.ops)]
        return self._events

    def __len__(self) -> int:
        return len(self.codes)

    @overload
    def __getitem__(self, index: int) -> Event: ...
    @overload
    def __getitem__(self, index: slice) -> list[Event]: ...
    def __getitem__(self, index: int | slice) -> Event | list[Event]:
        return self.as_list()[index]

    def __iter__(self) -> Iterator[Event]:
        return iter(self.as_list())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (EventColumns, list)):
            return self.as_list() == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # mutable-looking like the list it stands for


@dataclass(kw_only=True)
class Segments:
    """Index ranges of one pass: per block a forward and a backward segment, and the glue."""

    fw: list[tuple[int, int]]
    bw: list[tuple[int, int]]
    prefix_end: int
    middle: tuple[int, int]
    suffix_start: int


def find_segments(timeline: Timeline, blocks: list[str],
                  columns: EventColumns | None = None) -> Segments | None:
    """Split ``timeline`` at the blocks' first pre-forward and pre-backward events, looked up
    by code in its ``columns`` (made here when the caller has none; read only, the same for
    columns with the same codes: ``EventNames.segments``)."""
    columns = columns if columns is not None else EventColumns.of(timeline.events)
    key = (id(columns.codes), tuple(blocks))
    found = columns.names.segments.get(key)
    if found is None or found[0] is not columns.codes:
        found = columns.names.segments[key] = (columns.codes,
                                               _find_segments(columns, blocks))
    return found[1]


def _find_segments(columns: EventColumns, blocks: list[str]) -> Segments | None:
    """``find_segments`` over ``columns``' codes."""
    first, after = _code_lookups(columns)
    fw_starts = first("pre_fw", blocks)
    bw_starts = first("pre_bw", blocks)
    if not blocks or None in fw_starts or None in bw_starts:
        return None
    if fw_starts != sorted(fw_starts) or bw_starts != sorted(bw_starts, reverse=True):
        return None
    last_fw_end = after("post_fw", blocks[-1], fw_starts[-1])
    first_bw_end = after("post_bw", blocks[0], bw_starts[0])
    if last_fw_end is None or first_bw_end is None:
        return None
    fw = [(fw_starts[i], fw_starts[i + 1]) for i in range(len(blocks) - 1)]
    fw.append((fw_starts[-1], last_fw_end + 1))
    bw = [(bw_starts[i], bw_starts[i - 1]) for i in range(1, len(blocks))]
    bw.insert(0, (bw_starts[0], first_bw_end + 1))
    return Segments(fw=fw, bw=bw, prefix_end=fw_starts[0], middle=(last_fw_end + 1, bw_starts[-1]),
                    suffix_start=first_bw_end + 1)


def _code_lookups(columns: EventColumns) -> tuple[
        Callable[[str, list[str]], list[int | None]], Callable[[str, str, int], int | None]]:
    """``find_segments``'s two lookups over ``columns``' codes: the first event of
    ``kind`` of each of some modules (None for none), and the first of one module at or
    after an index."""
    import numpy as np  # numpy on first use (cost/memory.py [Note: numpy on first use])

    codes, names = columns.codes, columns.names
    order = np.argsort(codes, kind="stable")  # equal codes stay in event order
    ordered = codes[order]
    starts = np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1])))
    unique, firsts = ordered[starts], order[starts]

    def first(kind: str, modules: list[str]) -> list[int | None]:
        if not len(unique):
            return [None] * len(modules)
        wanted = np.array([-1 if (c := names.code(kind, m)) is None else c for m in modules],
                          dtype=np.int64)
        at = np.minimum(np.searchsorted(unique, wanted), len(unique) - 1)
        found = (unique[at] == wanted) & (wanted >= 0)
        return [i if ok else None for i, ok in zip(firsts[at].tolist(), found.tolist())]

    def after(kind: str, module: str, start: int) -> int | None:
        code = names.code(kind, module)
        hits = np.flatnonzero(codes[start:] == code) if code is not None else ()
        return int(hits[0]) + start if len(hits) else None
    return first, after


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

    def __init__(self, analysis: Analysis, blocks: list[str], *,
                 like: TimelineComposer | None = None) -> None:
        """``like``: a composer of the same analysis whose selective pass differs (another
        matmul stride: ``Analysis.with_selective_stride``); its plain and fully checkpointed
        passes, their segments and columns are this one's too, worked out once."""
        compiled = getattr(analysis, "compiled", None)
        self.blocks = blocks
        self._sources = (analysis.timeline, analysis.checkpointed_timeline, compiled)
        """What the plain and full passes are made of (``like`` shares them when the same)."""
        if like is not None and like.blocks == blocks and all(
                a is b for a, b in zip(like._sources, self._sources)):
            self.plain, self.plain_seg, self.ckpt, self.ckpt_seg = (
                like.plain, like.plain_seg, like.ckpt, like.ckpt_seg)
            names = like._columns["none"].names
            self._released = {mode: like._released[mode] for mode in ("none", "full")}
            self._columns = {mode: like._columns[mode] for mode in ("none", "full")
                             if mode in like._columns}
        else:
            # each pass's columns ([Note: timeline columns]), which the composites slice and
            # its segments are found by
            names = EventNames()
            plain = EventColumns.of(analysis.timeline.events, names)
            self.plain, self.plain_seg = analysis.timeline, find_segments(analysis.timeline,
                                                                          blocks, plain)
            if compiled is not None and self.plain_seg is None:
                raise BadInput("--compile needs the model's repeated blocks to run one after "
                               "the other in forward and in reverse in backward (aligned block "
                               "segments); this model's do not, so compiled blocks cannot be "
                               "planned. Plan without --compile.")
            self.ckpt, self.ckpt_seg, ckpt = self._mode_pass(analysis.checkpointed_timeline,
                                                             "full", compiled, names)
            if compiled is not None:  # [Note: compiled timeline]
                self.plain = compiled_timeline(self.plain, self.plain_seg,
                                               [compiled.kept_bytes(b) for b in blocks],
                                               [compiled.bw_peak_bytes(b) for b in blocks])
                plain = EventColumns.of(self.plain.events, names)
            self._released = {mode: self._released_per_block(timeline) for mode, timeline in
                              (("none", self.plain), ("full", self.ckpt))}
            self._columns = {"none": plain}
            if ckpt is not None:
                self._columns["full"] = ckpt
        self.sel, self.sel_seg, sel = self._mode_pass(
            getattr(analysis, "selective_timeline", None), "selective", compiled, names)
        self._released["selective"] = self._released_per_block(self.sel)
        self._releases = any(r != base for mode in ("full", "selective")
                             for r, base in zip(self._released.get(mode, ()),
                                                self._released["none"]))
        """Whether any block's mode frees casts the plain pass does not (autocast): else
        every mix's ``released_delta`` sum is 0."""
        if sel is not None:
            self._columns["selective"] = sel
        self._stacked_passes: _Stacked | None = None
        """The passes' columns side by side (``_Stacked``), made for the first mix composed:
        a composer whose mixes are its passes themselves (the selective pass at another
        matmul stride, read for one recipe) never needs them."""
        every = frozenset(range(len(blocks)))
        self._cache: dict[tuple[frozenset[int], frozenset[int]], EventColumns] = {
            (frozenset(), frozenset()): self._columns["none"]}
        if self.ckpt is not None:
            self._cache[(every, frozenset())] = self._columns["full"]
        if self.sel is not None:
            self._cache[(frozenset(), every)] = self._columns["selective"]

    def _stacked(self) -> _Stacked:
        """The passes' columns side by side, made on first use."""
        if self._stacked_passes is None:
            self._stacked_passes = _Stacked.of(list(self._columns.values()))
        return self._stacked_passes

    def _mode_pass(self, timeline: Timeline | None, mode: str, compiled, names: EventNames
                   ) -> tuple[Timeline | None, Segments | None, EventColumns | None]:
        """The pass of a checkpointing ``mode``, its block segments and its columns (names
        numbered in ``names``), with compiled blocks the pass derived for them ([Note:
        compiled timeline]; None, None, None where their checkpoint wrapper did not
        compile)."""
        if timeline is None:
            return None, None, None
        columns = EventColumns.of(timeline.events, names)
        segments = find_segments(timeline, self.blocks, columns)
        if compiled is None:
            return timeline, segments, columns
        if segments is None or mode not in compiled.by_mode:
            return None, None, None
        derived = compiled_timeline(timeline, segments,
                                    [compiled.kept_bytes(b, mode) for b in self.blocks],
                                    [compiled.bw_peak_bytes(b, mode) for b in self.blocks])
        return derived, segments, EventColumns.of(derived.events, names)

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
                ) -> tuple[EventColumns, Segments]:
        """The columns and segments of the pass block ``i`` takes its segments from."""
        if i in full:
            return self._columns["full"], self.ckpt_seg
        if i in selective:
            return self._columns["selective"], self.sel_seg
        return self._columns["none"], self.plain_seg

    def pass_of(self, mode: str) -> tuple[Timeline | None, Segments | None]:
        """The pass of a checkpointing ``mode`` (``none``, ``full``, ``selective``) and its
        block segments (None, None where it was not traced or does not split)."""
        return {"none": (self.plain, self.plain_seg), "full": (self.ckpt, self.ckpt_seg),
                "selective": (self.sel, self.sel_seg)}[mode]

    def ops_of(self, mode: str) -> list[dict[str, float] | None]:
        """Each event's op counters in the pass of ``mode`` (``pass_of``; its columns' list,
        read only)."""
        return self._columns[mode].ops

    def segment_delta(self, i: int, mode: str, part: str = "fw") -> tuple[int, float]:
        """Level and FLOP change over block ``i``'s forward (``part="fw"``) or backward
        segment in the pass of ``mode``: what the block keeps for backward, what it computes."""
        src, seg = self.pass_of(mode)
        if src is None or seg is None:
            return 0, 0.0
        start, end = (seg.fw if part == "fw" else seg.bw)[i]
        events = src.events
        nxt = events[end] if end < len(events) else events[end - 1]
        return nxt.level - events[start].level, nxt.flops - events[start].flops

    def events(self, checkpointed: int | frozenset[int],
               selective: frozenset[int] = frozenset()) -> EventColumns:
        """The composite timeline with blocks ``0..k-1`` (an int ``k``) or the given block
        indices (a frozenset) fully checkpointed, and the ``selective`` indices selectively
        (as columns whose ``Event`` objects are made on first use: [Note: timeline columns])."""
        which = frozenset(range(checkpointed)) if isinstance(checkpointed, int) else checkpointed
        selective = frozenset(selective) - which
        key = (which, selective)
        if key in self._cache:
            return self._cache[key]
        if not self.supports_partial() or (selective and self.sel_seg is None):
            raise ValueError("partial checkpointing needs aligned block segments")
        p = self.plain_seg
        # [Note: autocast and checkpointed blocks]: released in the glue, at the autocast exit
        cached = (sum(self.released_delta(i, "full") for i in which) + sum(
            self.released_delta(i, "selective") for i in selective)) if self._releases else 0
        release_at = next((k for k in range(*p.middle)
                           if self.plain.events[k].kind in (AUTOCAST_EXIT, "pre_bw")), p.middle[1])
        plain = self._columns["none"]
        pieces: list[tuple[EventColumns, int, int]] = [(plain, 0, p.prefix_end)]
        for i in range(len(self.blocks)):
            src, seg = self._source(i, which, selective)
            pieces.append((src, *seg.fw[i]))
        pieces.append((plain, *p.middle))
        for i in reversed(range(len(self.blocks))):
            src, seg = self._source(i, which, selective)
            pieces.append((src, *seg.bw[i]))
        pieces.append((plain, p.suffix_start, len(plain)))
        out = _compose(pieces, (plain, p.middle) if cached else None, cached, release_at,
                       self._stacked())
        self._cache[key] = out
        return out


@dataclass
class _Stacked:
    """A composer's passes' columns one after the other, so that a composite gathers every
    event of its 160 pieces (Llama-70B) through one index (``_gather``): slicing each piece
    column by column took three times as long."""

    offsets: dict[int, int]
    """Where each pass's events start, by the pass's ``id``."""
    levels: np.ndarray
    peaks: np.ndarray
    codes: np.ndarray
    passes: list[EventColumns]
    _flops: np.ndarray | None = None

    @property
    def flops(self) -> np.ndarray:
        """The passes' FLOPs, stacked on first use (a composite's FLOPs are made when asked)."""
        import numpy as np  # numpy on first use (cost/memory.py [Note: numpy on first use])

        if self._flops is None:
            self._flops = np.concatenate([p.flops for p in self.passes])
        return self._flops

    @classmethod
    def of(cls, passes: list[EventColumns]) -> _Stacked:
        import numpy as np  # numpy on first use (cost/memory.py [Note: numpy on first use])

        starts = np.cumsum([0] + [len(p) for p in passes]).tolist()
        return cls(offsets={id(p): at for p, at in zip(passes, starts)}, passes=passes,
                   **{column: np.concatenate([getattr(p, column) for p in passes])
                      for column in ("levels", "peaks", "codes")})


def _compose(pieces: list[tuple[EventColumns, int, int]],
             glue: tuple[EventColumns, tuple[int, int]] | None, cached: int, release_at: int,
             stacked: _Stacked) -> EventColumns:
    """The events ``src[start:end]`` of each piece in turn, re-based on the running level and
    FLOPs ([Note: composing checkpointed blocks]); in the ``glue`` piece (the plain pass's
    middle, given when ``cached`` bytes of autocast casts are released) those are freed at
    ``release_at`` (``_release_in_glue``). Column arithmetic as [Note: timeline columns]:
    each piece's shifts are worked out at once (``stacked``: the pieces' passes side by
    side), then every event gathered at once."""
    slices: list[tuple[EventColumns, int, int]] = []
    begins: list[int] = []
    nexts: list[int] = []
    lengths: list[int] = []
    glue_piece = None
    for src, start, end in pieces:
        if start >= end:
            continue
        if glue is not None and src is glue[0] and (start, end) == glue[1]:
            glue_piece = len(slices)
        at = stacked.offsets[id(src)]
        begins.append(at + start)
        nexts.append(at + (end if end < len(src) else end - 1))  # the event after the piece
        lengths.append(end - start)
        slices.append((src, start, end))
    used = _Pieces.of(begins, nexts, lengths, stacked, glue_piece, cached)
    levels, peaks, codes = _gather(used, stacked)
    glue_at = None
    if glue_piece is not None:
        g = glue_piece
        src, start, end = slices[g]
        glue_at = sum(lengths[:g])  # where the glue's events sit in the composite
        now, peak = _release_in_glue(src, start, end, int(used.shifts[g]), cached, release_at)
        levels[glue_at:glue_at + end - start] = now
        peaks[glue_at:glue_at + end - start] = peak

    def flops() -> np.ndarray:
        """The composite's FLOPs, re-based piece by piece (the glue's as the others)."""
        before, bases = used.flops_before(stacked)
        out = _gather_flops(used, stacked, before, bases)
        if glue_piece is not None:
            src, start, end = slices[glue_piece]
            out[glue_at:glue_at + end - start] = (
                float(before[glue_piece] - bases[glue_piece]) + src.flops[start:end])
        return out
    return EventColumns(levels=levels, peaks=peaks, flops=flops, names=pieces[0][0].names,
                        codes=codes, slices=slices)


@dataclass
class _Pieces:
    """Per piece of a composite (``_compose``), in order: where its events start among the
    stacked passes' (``_Stacked``), how many, the event after it there and its level shift."""

    begins: np.ndarray
    lengths: np.ndarray
    after: np.ndarray
    shifts: np.ndarray

    @classmethod
    def of(cls, begins: list[int], nexts: list[int], lengths: list[int], stacked: _Stacked,
           glue: int | None, cached: int) -> _Pieces:
        """The pieces starting at ``begins`` among the stacked passes' events, followed there
        by the events at ``nexts``: the running level rises over each piece by its next
        event's less its first's (less ``cached`` bytes over the ``glue`` piece), added up
        piece by piece (``cumsum`` adds in order, as the per-event rule did)."""
        import numpy as np  # numpy on first use (cost/memory.py [Note: numpy on first use])

        first = np.array(begins, dtype=np.int64)
        after = np.array(nexts, dtype=np.int64)
        base_levels = stacked.levels[first]
        rise = stacked.levels[after] - base_levels
        if glue is not None:
            rise[glue] -= cached
        level_before = np.zeros(len(first), dtype=np.int64)
        np.cumsum(rise[:-1], out=level_before[1:])
        return cls(begins=first, lengths=np.array(lengths, dtype=np.int64), after=after,
                   shifts=level_before - base_levels)

    def flops_before(self, stacked: _Stacked) -> tuple[np.ndarray, np.ndarray]:
        """The FLOPs before each piece and its first event's FLOPs, the running FLOPs rising
        over each piece as the level does (float64, as the analysis records them; ``cumsum``
        adds in order)."""
        import numpy as np  # numpy on first use (cost/memory.py [Note: numpy on first use])

        bases = stacked.flops[self.begins]
        before = np.zeros(len(self.begins), dtype=np.float64)
        np.cumsum(stacked.flops[self.after[:-1]] - bases[:-1], out=before[1:])
        return before, bases


def _gather(used: _Pieces, stacked: _Stacked) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Levels, peaks and codes of the pieces ``used`` (``_compose``), each event as the
    per-event rule has it: ``level + e.level - base`` and ``level + e.peak - base`` (the
    piece's first peak at least ``level``)."""
    import numpy as np  # numpy on first use (cost/memory.py [Note: numpy on first use])

    lengths, begins, shift = used.lengths, used.begins, used.shifts
    if not len(lengths):
        return (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64),
                np.zeros(0, dtype=np.int64))
    index = _stacked_index(used)
    firsts = lengths.cumsum() - lengths
    shifts = shift.repeat(lengths)
    levels = stacked.levels[index] + shifts
    peaks = stacked.peaks[index] + shifts
    # each piece's own first level + its shift = the running level there
    peaks[firsts] = np.maximum(stacked.levels[begins] + shift, peaks[firsts])
    return levels, peaks, stacked.codes[index]


def _gather_flops(used: _Pieces, stacked: _Stacked, before: np.ndarray, bases: np.ndarray
                  ) -> np.ndarray:
    """FLOPs of the pieces ``used``: ``(flops + e.flops) - base_flops`` per event, given the
    FLOPs before each piece and its first event's (``_Pieces.flops_before``)."""
    import numpy as np  # numpy on first use (cost/memory.py [Note: numpy on first use])

    if not len(used.lengths):
        return np.zeros(0)
    return ((np.repeat(before, used.lengths) + stacked.flops[_stacked_index(used)])
            - np.repeat(bases, used.lengths))


def _stacked_index(used: _Pieces) -> np.ndarray:
    """Where each event of the pieces ``used`` sits among the stacked passes' events."""
    import numpy as np  # numpy on first use (cost/memory.py [Note: numpy on first use])

    lengths = used.lengths
    firsts = lengths.cumsum() - lengths
    return (used.begins - firsts).repeat(lengths) + np.arange(int(firsts[-1] + lengths[-1]))


def _release_in_glue(src: EventColumns, start: int, end: int, shift: int, cached: int,
                     release_at: int) -> tuple[np.ndarray, np.ndarray]:
    """Levels and peaks of the glue ``src[start:end]`` re-based by ``shift`` bytes, with the
    checkpointed blocks' autocast casts (``cached`` bytes) freed at event ``release_at``
    ([Note: autocast and checkpointed blocks]; facts without an ``autocast_exit`` event: the
    first backward event). The peak of the gap before that event still holds them."""
    import numpy as np  # numpy on first use (cost/memory.py [Note: numpy on first use])

    at = np.arange(start, end)
    now = src.levels[start:end] + shift - cached * (at >= release_at)
    peak = src.peaks[start:end] + shift - cached * (at > release_at)
    out = np.maximum(peak, now)
    out[0] = max(shift + int(src.levels[start]), int(peak[0]))
    return now, out
