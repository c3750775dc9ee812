"""The per-rank memory model over one steady training step (SPEC section 5's "peak").

[Note: FSDP2 memory timeline]
Peak = max over the step of: sharded parameters, optimizer states and buffers (always live);
sharded gradients of the units already reduce-scattered; the activation timeline of the
analysis (see facts/analysis.py); and what FSDP2 keeps unsharded at that moment:
- a unit's parameters, all-gathered in ``param_dtype`` when it (or, with prefetch, the unit
  ``d`` before it) starts forward, freed after its forward when it reshards, and gathered
  again for backward when the unit ahead of it in backward order starts (FSDP2's implicit
  backward prefetch), freed after its backward;
- the all-gather's flat output and input copies for an instant while it is copied out, and in
  forward the flat output until the next unit's copy-out (the root's post-forward for the last);
- a unit's unsharded gradients (``param_dtype``) during its backward;
- the reduce-scatter input (``reduce_dtype``, padded unsharded size), which FSDP2 keeps until
  the next unit's reduce-scatter is issued (``reduce_scatter_max_input_buffers = 1``).
The optimizer step (AdamW ``foreach``) needs one extra shard-sized temporary.

[Note: CPU offload on the device]
With FSDP2's ``CPUOffloadPolicy`` the sharded parameters, their gradients and the optimizer
states live in (pinned) host memory and the optimizer steps on the CPU (torch 2.13,
``_fsdp_param.py`` / ``_fsdp_collectives.py``). On the device remain the buffers, the inputs,
the activations and what FSDP2 gathers and reduces, as above; in addition, while a unit's
all-gather input is built, its shard copied from the host (stored dtype) and cast to
``param_dtype``, and after its reduce-scatter the reduced shard until it is copied back. No
sharded gradient accumulates on the device and the optimizer step adds nothing there.
[Note: gradient accumulation]
Measured with FSDPMemTracker over whole steps (torch 2.13): a step of several micro-batches
peaks in a micro-batch after the first, where what the earlier ones left is held throughout:
with ``every`` the reduce-scattered fp32 sharded gradients (FSDP2 accumulates into them); with
``last`` (no reduce-scatter before the last micro-batch) every parameter's unsharded gradient,
accumulated in the reduce dtype when it differs from the compute dtype, else in the compute
dtype. The optimizer step comes after the last micro-batch has reduced them: not held there.

[Note: optimizer overlap in memory]
With ``optimizer_overlap`` (cost/optimizer_overlap.py) no sharded gradient outlives its unit's
reduce-scatter and no optimizer step follows backward. A unit's parameters step inside its
reduce-scatter call, after the unsharded gradients were copied into the reduce-scatter input
and let go (``foreach_reduce``): at that moment the step holds what the sweep holds at the
unit's post-backward point without its instants (the unsharded gradients are gone, the
reduce-scatter input is live), plus the unit's sharded gradient and one parameter's step
temporary (the largest). Measured against FSDPMemTracker (tests/test_optimizer_overlap.py).

[Note: sub-steps]
Several FSDP actions share one module boundary; they run in this order: 0 the ending unit's
post-forward/post-backward (reshard, reduce-scatter), 1 the starting unit's copy-out of its
all-gather, 2 the prefetch of the next unit's all-gather. A live buffer is (start, end, bytes,
category) with start/end = (event, sub-step), present at instants start <= t < end and in the
gap before event k when start < k <= end.

All figures are bytes per rank; the search calls ``estimate_peak`` thousands of times, so it
walks only the unit boundaries and reads the activation maxima between them in one pass
over the event peaks (``ActivationProfile._gap_maxima``).

[Note: numpy on first use]
The sweep runs on numpy arrays, imported inside the functions that use them: this module is
on the import path of ``fsdp-plan --help`` and ``emit`` (about 0.3 s of numpy they never use).
"""

from __future__ import annotations

import bisect
import functools
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

from fsdp_plan.common.deferred import Deferred
from fsdp_plan.cost.optimizer_overlap import step_temporaries
from fsdp_plan.cost.precision import OPTIMIZER_STATES, Precision, optimizer_state_bytes
from fsdp_plan.cost.timeline import EventColumns
from fsdp_plan.cost.units import UnitSpec
from fsdp_plan.facts.types import Event


@dataclass(kw_only=True)
class StepContext:
    """What stays fixed while the search varies units, prefetch and checkpointing."""

    precision: Precision
    shard_size: int
    optimizer: str
    buffer_bytes: int
    input_bytes: int
    offload: bool = False
    """FSDP2 ``CPUOffloadPolicy``: see [Note: CPU offload on the device]."""
    grad_accum_steps: int = 1
    gradient_sync: str = "every"
    """With ``grad_accum_steps > 1``: see [Note: gradient accumulation]."""
    optimizer_overlap: bool = False
    """Each parameter stepped in backward: see [Note: optimizer overlap in memory]."""


@dataclass(kw_only=True)
class UnitWindows:
    """Event indices where a unit's forward and backward begin and end."""

    fw_start: int
    fw_end: int
    bw_start: int
    bw_end: int
    ran: bool = True

    def copy(self) -> UnitWindows:
        """A copy to adjust (three times faster than ``copy.copy``)."""
        return UnitWindows(fw_start=self.fw_start, fw_end=self.fw_end, bw_start=self.bw_start,
                           bw_end=self.bw_end, ran=self.ran)


class MemoryEstimate:
    """The predicted peak and what it is made of at that moment.

    ``breakdown``: the parts, or a ``Deferred`` of them that ``estimate_peak`` works out when
    first read, as a candidate's step time is ([Note: step times when asked] in
    common/deferred.py): the search reads the peak of every plan it evaluates and the parts
    of the few the report and the plan show. Copies share the ``Deferred``."""

    __slots__ = ("_breakdown", "peak_bytes", "phase")

    def __init__(self, *, peak_bytes: int, phase: str,
                 breakdown: dict[str, int] | Deferred[dict[str, int]] | None = None) -> None:
        self.peak_bytes = peak_bytes
        self.phase = phase
        self._breakdown = (breakdown if isinstance(breakdown, Deferred)
                           else Deferred.known({} if breakdown is None else breakdown))

    @property
    def breakdown(self) -> dict[str, int]:
        """Bytes by category at the peak."""
        return self._breakdown.get()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MemoryEstimate):
            return NotImplemented
        return (self.peak_bytes, self.phase, self.breakdown) == (
            other.peak_bytes, other.phase, other.breakdown)

    __hash__ = None  # type: ignore[assignment]  # compared by value, like a dataclass

    def __repr__(self) -> str:
        return (f"MemoryEstimate(peak_bytes={self.peak_bytes!r}, phase={self.phase!r}, "
                f"breakdown={self.breakdown!r})")


class ActivationProfile:
    """One (composite) activation timeline with the range maxima of its event peaks.

    Built from a timeline's columns (cost/timeline.py [Note: timeline columns]); the search
    reads only those, and ``events`` makes the ``Event`` objects when something asks for them
    (pictures)."""

    def __init__(self, events: Sequence[Event]) -> None:
        columns = events if isinstance(events, EventColumns) else EventColumns.of(list(events))
        self._columns = columns
        self.num_events = n = len(columns)
        self._levels = columns.levels
        self._peaks = columns.peaks
        self._padded_peaks: np.ndarray | None = None
        """The peaks and a 0 after them (``_gap_maxima``), made on first use."""
        self._table: np.ndarray | None = None
        """A sparse table of the event peaks (``_sparse_table``) for ``max_peak``, made on
        first use: the search's sweeps read their range maxima with ``_gap_maxima``."""
        self._names = columns.names
        self._codes = columns.codes
        self._kind_codes = columns.codes >> 32
        """Each event's kind id (``EventNames.kinds``)."""
        self._pre_bw: np.ndarray | None = None
        self._pre_bw_list: list[int] | None = None
        pre_bw = self._pre_backward()
        self.backward_start = int(pre_bw[0]) if len(pre_bw) else n - 1
        self.forward_end = max(0, self.backward_start - 1)
        self.loss_span = _loss_span(self.kind_and_module, n, self.backward_start)
        self._loss_level = int(self._levels[self.loss_span[0]]) if self.loss_span else 0
        self._first_last: tuple[_CodeIndex, _CodeIndex] | None = None
        self._pre_bw_modules: list[str] | None = None
        self._left: dict[tuple[tuple[str, ...], int, int], int] = {}
        self._windows: dict[tuple[str, ...], UnitWindows] = {}
        self._skeletons: dict[tuple, _Skeleton] = {}
        """The step's buffers by units and prefetch (``_framed_skeleton``; on a hook frame)."""
        self._layouts: dict[tuple, _Layout] = {}
        """What the units' modules alone fix of those (``_framed_skeleton``)."""
        self._frame: tuple[ActivationProfile, np.ndarray] | None = None
        """The hook frame and where its events sit here (``hook_frame``)."""
        self._ran: dict[int, tuple[list[UnitSpec], tuple[bool, ...]]] = {}
        """``ran_of`` by the identity of the units' list (on a hook frame)."""
        self._framed: tuple[np.ndarray, np.ndarray] | None = None
        """The levels and gap peaks at the frame's events (``framed_activations``)."""
        self._sweeps: dict[int, dict[str, np.ndarray]] = {}
        """The sweeps of the frame's skeletons here, by skeleton serial (``_sweep_of``)."""

    def hook_frame(self) -> tuple[ActivationProfile, np.ndarray]:
        """This profile's hook frame and, for each of the frame's events, its index here
        (one more entry maps the frame's number of events to this one's): see [Note: hook
        frames].

        [Note: hook frames]
        Where a unit's buffers start and end is read from FSDP's module hooks alone: the
        pre- and post-forward events in forward and the pre- and post-backward events in
        backward (``_find_windows``, ``_gradient_modules``), with the step's first and last
        events and the last one before backward. A checkpointing mix moves those events (a
        checkpointed block replays its forward inside backward, and the replayed hooks are
        not among them), it does not reorder them. So every mix whose hook events name the
        same modules in the same order places a layout's buffers at the same hooks: the
        windows, the skeletons and the order of the sweep's points are worked out once, on
        the frame (a profile of those events alone, kept with the composer's names), and
        each mix maps the frame's points onto its own events and reads its activations there
        (``_sweep_of``). The placement only compares event indices and codes them as
        ``4 * event + sub + 1``, and every index it reads or makes is one of the frame's
        events: the map keeps both, so the buffers are where placing them on the mix put
        them (tests/test_timeline_columns.py places both ways).
        """
        if self._frame is None:
            import numpy as np  # see [Note: numpy on first use]

            n, start = self.num_events, self.backward_start
            kinds, ids = self._kind_codes, self._names.kinds

            def of(first: str, second: str, part: np.ndarray) -> np.ndarray:
                return (part == ids.get(first, -1)) | (part == ids.get(second, -1))
            hook = np.concatenate((of("pre_fw", "post_fw", kinds[:start]),
                                   of("pre_bw", "post_bw", kinds[start:])))
            if n:
                hook[[0, self.forward_end, n - 1]] = True
            events = np.flatnonzero(hook)
            codes = self._codes[events]
            key = codes.tobytes()
            frame = self._names.frames.get(key)
            if not isinstance(frame, ActivationProfile):
                zeros = np.zeros(len(codes), dtype=np.int64)
                frame = self._names.frames[key] = ActivationProfile(EventColumns(
                    levels=zeros, peaks=zeros, flops=zeros.astype(np.float64),
                    names=self._names, codes=codes))
            self._frame = (frame, np.append(events, n))
        return self._frame

    def framed_activations(self) -> tuple[np.ndarray, np.ndarray]:
        """At each event of the hook frame (``hook_frame``): its level here, and the highest
        event peak here from the frame's previous event (exclusive; from the first event for
        the first) to it, with a 0 after them. A sweep on the frame reads its activations
        from these (``_sweep_of``): the events between two frame events are in one of these
        ranges, so the gap before a point holds the highest of those from the previous
        point's frame event to its own."""
        if self._framed is None:
            import numpy as np  # see [Note: numpy on first use]

            events = self.hook_frame()[1][:-1]
            starts = np.concatenate(([0], events[:-1] + 1))
            peaks = (np.maximum.reduceat(self._peaks, starts) if len(starts)
                     else np.zeros(0, dtype=np.int64))
            self._framed = (self._levels[events], np.append(peaks, 0))
        return self._framed

    @property
    def _first(self) -> _CodeIndex:
        """The first event of each code, in forward and in backward (``_first_and_last``),
        made on first use: the search looks events up on hook frames only ([Note: hook
        frames]), never on its mixes."""
        if self._first_last is None:
            self._first_last = _first_and_last(self._codes, self.backward_start)
        return self._first_last[0]

    @property
    def _last(self) -> _CodeIndex:
        """The last event of each code, in forward and in backward (see ``_first``)."""
        if self._first_last is None:
            self._first_last = _first_and_last(self._codes, self.backward_start)
        return self._first_last[1]

    def kind_and_module(self, event: int) -> tuple[str, str]:
        """The kind and module FQN of event ``event``."""
        return self._names.named(int(self._codes[event]))

    def _pre_backward(self) -> np.ndarray:
        """The indices of the pre-backward events (int64)."""
        if self._pre_bw is None:
            import numpy as np  # see [Note: numpy on first use]

            kind = self._names.kinds.get("pre_bw", -1)
            self._pre_bw = np.flatnonzero(self._kind_codes == kind)
        return self._pre_bw

    def _pre_backward_list(self) -> list[int]:
        """``_pre_backward`` as a list, made on first use (hook frames only: [Note: hook
        frames]; every mix's profile reads just the first)."""
        if self._pre_bw_list is None:
            self._pre_bw_list = self._pre_backward().tolist()
        return self._pre_bw_list

    @property
    def events(self) -> list[Event]:
        """The timeline's ``Event`` objects (made on first use: not on the search's path)."""
        return self._columns.as_list()

    @property
    def levels(self) -> list[int]:
        """Activation-side bytes at each event, as Python ints."""
        return self._levels.tolist()

    def split_loss(self, lo: int, hi: int, activations: int) -> dict[str, int]:
        """``activations`` at events ``lo..hi`` as ``{activations, loss}``: see
        [Note: the loss in the breakdown]."""
        return loss_parts(self._loss_level, self.loss_span, lo, hi, activations)

    def max_peak(self, lo: int, hi: int) -> int:
        """Highest event peak over indices ``lo..hi`` inclusive (0 for an empty range)."""
        if lo > hi:
            return 0
        if self._table is None:
            self._table = _sparse_table(self._peaks)
        level = (hi - lo + 1).bit_length() - 1
        row = self._table[level]
        return int(max(row[lo], row[hi - (1 << level) + 1]))

    def _gap_maxima(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """``max_peak(lo[i], hi[i])`` for every ``i`` at once, where the ranges are non-empty,
        ascending and disjoint (the gaps of a sweep, ``_sweep_of``): one ``reduceat`` over
        the peaks, which reads each event once (the sparse table's gathers took three times
        as long, and building the table per profile as long again)."""
        import numpy as np  # see [Note: numpy on first use]

        bounds = np.empty(2 * len(lo), dtype=np.int64)
        bounds[0::2] = lo
        bounds[1::2] = hi + 1  # at most the number of events: one more peak is appended
        if self._padded_peaks is None:
            self._padded_peaks = np.append(self._peaks, 0)
        return np.maximum.reduceat(self._padded_peaks, bounds)[0::2]

    def first_event(self, kind: str, module: str, default: int) -> int:
        """Index of the first backward (or forward) ``kind`` event of ``module``."""
        return self._index(self._first, kind, module, kind.endswith("bw"), default)

    def _index(self, found: _CodeIndex, kind: str, module: str, in_backward: bool,
               default: int) -> int:
        """The first or last (``found``: ``_first``, ``_last``) ``kind`` event of ``module``
        in backward or in forward, else ``default``."""
        return found.get(self._event_keys(kind, [module], in_backward)[0], default)

    def _event_keys(self, kind: str, modules: Sequence[str], in_backward: bool) -> list[int]:
        """The keys ``_first`` and ``_last`` hold ``kind`` events of ``modules`` by
        (``EventNames.keys``; read only)."""
        return self._names.keys(kind, tuple(modules), in_backward)

    def _backward_left(self, modules: tuple[str, ...], start: int, stop: int) -> int:
        """Where backward has left a unit: see [Note: post-backward of shared inputs].

        [Note: post-backward of shared inputs]
        FSDP2 runs a unit's post-backward (reshard, reduce-scatter) once the gradients of the
        unit's OWN uses of its inputs are ready. A module's post-backward hook waits for its
        inputs' whole gradient instead, which comes late when an input is shared with modules
        whose backward runs later (T5's encoder output and position bias feed every decoder
        block). So a unit's backward ends at the first pre-backward of a module outside it
        (and not around it) after the last pre-backward of a module inside it.
        """
        key = (modules, start, stop)
        left = self._left.get(key)
        if left is not None:
            return left
        names, prefixes = _inside_test(modules)
        # only pre-backward events matter: visit those in ``start..stop`` (by bisection)
        pre_bw, fqns = self._pre_backward_list(), self._pre_backward_modules()
        lo, hi = bisect.bisect_left(pre_bw, start), bisect.bisect_right(pre_bw, stop)
        last_inside = start
        for j in range(hi - 1, lo - 1, -1):  # the last pre-backward inside the unit
            fqn = fqns[j]
            if fqn in names or fqn.startswith(prefixes):
                last_inside = pre_bw[j]
                break
        left = stop
        for j in range(bisect.bisect_right(pre_bw, last_inside), hi):
            fqn = fqns[j]  # the first after it neither inside nor around the unit
            if not (fqn in names or fqn.startswith(prefixes)) and not (
                    fqn == "" or any(m.startswith(fqn + ".") for m in modules)):
                left = pre_bw[j]
                break
        self._left[key] = left
        return left

    def _pre_backward_modules(self) -> list[str]:
        """The module of each pre-backward event (``_pre_backward``), in order."""
        if self._pre_bw_modules is None:
            self._pre_bw_modules = self._names.module_names(
                self._codes[self._pre_backward()])
        return self._pre_bw_modules

    def windows(self, unit: UnitSpec) -> UnitWindows:
        """Where ``unit`` computes: its modules' first pre-forward to last post-forward, etc.

        A fresh copy each call, for the caller to change; cached by the unit's modules, since
        the search evaluates the same units under many prefetch and strategy choices
        (``_place_buffers`` reads the cached windows themselves and changes none)."""
        return self._cached_windows(unit).copy()

    def _cached_windows(self, unit: UnitSpec) -> UnitWindows:
        """The shared windows of ``unit``: callers must not change them."""
        return self.cached_windows_of([unit])[0]

    def ran_of(self, units: list[UnitSpec]) -> tuple[bool, ...]:
        """Whether each of ``units`` ran forward (its modules did)."""
        frame = self.hook_frame()[0]
        found = frame._ran.get(id(units))
        if found is None or found[0] is not units:  # kept by the list's identity, as
            # ``_units_facts`` keeps its facts (the list kept alive with them)
            found = frame._ran[id(units)] = (
                units, tuple(w.ran for w in frame.cached_windows_of(units)))
        return found[1]

    def cached_windows_of(self, units: list[UnitSpec]) -> list[UnitWindows]:
        """The shared windows of each of ``units`` (callers must not change them), those not
        cached yet looked up together (a layout's units are met in a new checkpointing mix
        all at once)."""
        keys = [tuple(u.modules) for u in units]
        cached = self._windows
        missing = [u for u, key in zip(units, keys) if key not in cached]
        if missing:
            for u, w in zip(missing, self._find_windows(missing)):
                cached[tuple(u.modules)] = w
        return [cached[key] for key in keys]

    def _find_windows(self, units: list[UnitSpec]) -> list[UnitWindows]:
        """The windows of each of ``units``: its modules' first pre-forward to last
        post-forward, first pre-backward to last post-backward (FSDP2's early post-backward:
        ``_backward_left``), the four kinds of event of all their modules looked up at once."""
        import numpy as np  # see [Note: numpy on first use]

        end = self.num_events - 1
        modules = [m for u in units for m in u.modules]
        sizes = np.array([len(u.modules) for u in units], dtype=np.int64)
        firsts = np.cumsum(sizes) - sizes
        big = np.iinfo(np.int64).max

        def found(first_or_last: _CodeIndex, kind: str, in_backward: bool
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
            """Per unit, of its modules' ``kind`` events: the lowest index, the highest (-1
            for none) and how many modules have one; a -1 closes the array so that a unit
            without modules reads none."""
            keys = np.array(self._event_keys(kind, modules, in_backward), dtype=np.int64)
            index = np.append(first_or_last.get_many(keys, -1), -1)
            has = index >= 0
            return (np.minimum.reduceat(np.where(has, index, big), firsts),
                    np.maximum.reduceat(index, firsts),
                    np.add.reduceat(has, firsts) * (sizes > 0))
        fw_start, fw_start_max, fw_found = found(self._first, "pre_fw", False)
        _, fw_last, fw_ended = found(self._last, "post_fw", False)
        bw_start, _, bw_found = found(self._first, "pre_bw", True)
        _, bw_last, bw_ended = found(self._last, "post_bw", True)
        # the last post-forward, else (none found) the last pre-forward
        fw_end = np.where(fw_ended > 0, fw_last, fw_start_max)
        out = []
        for unit, ran, forward_start, forward_end, bw_first, began, bw_max, ended in zip(
                units, (fw_found > 0).tolist(), fw_start.tolist(), fw_end.tolist(),
                bw_start.tolist(), bw_found.tolist(), bw_last.tolist(), bw_ended.tolist()):
            if unit.modules == [""]:
                root_end = self._index(self._last, "post_fw", "", False, self.forward_end)
                out.append(UnitWindows(fw_start=0, fw_end=root_end,
                                       bw_start=self.backward_start, bw_end=end))
                continue
            if not ran:
                out.append(UnitWindows(fw_start=0, fw_end=0, bw_start=end, bw_end=end,
                                       ran=False))
                continue
            # ``began``/``ended``: how many of its modules have a pre- and a post-backward
            backward_start = bw_first if began else self.backward_start
            # A unit whose inputs need no gradient (an embedding) gets its post-backward from
            # FSDP's end-of-backward callback.
            backward_end = bw_max if ended and ended == began else end
            if ended and ended == began:
                backward_end = min(backward_end, self._backward_left(
                    tuple(unit.modules), backward_start, backward_end))
            out.append(UnitWindows(fw_start=forward_start, fw_end=forward_end,
                                   bw_start=backward_start,
                                   bw_end=max(backward_end, backward_start)))
        return out


@functools.lru_cache(maxsize=4096)
def _inside_test(modules: tuple[str, ...]) -> tuple[frozenset[str], tuple[str, ...]]:
    """The names and the prefixes a module inside a unit of ``modules`` has one of (its own
    name, or a descendant's): the same units are met in every checkpointing mix."""
    return frozenset(modules), tuple(m + "." for m in modules)


def loss_span(events: Sequence[Event], backward_start: int) -> tuple[int, int] | None:
    """Event indices around the loss: the last forward end of a submodule (not the root)
    before backward, and the first backward start of one after it.

    [Note: the loss in the breakdown]
    Between the end of the last submodule's forward and the start of the first submodule's
    backward the step computes the loss and its gradient: in ``loss_fn`` outside the model, or
    inside the root's forward (Hugging Face heads given ``labels`` upcast the logits to float32
    there). What the activations hold above the level the last submodule left is what the loss
    holds; when the peak falls there the breakdown shows it as ``loss``."""
    return _loss_span(lambda i: (events[i].kind, events[i].module), len(events),
                      backward_start)


def _loss_span(kind_and_module: Callable[[int], tuple[str, str]], n: int,
               backward_start: int) -> tuple[int, int] | None:
    """``loss_span`` over ``n`` events read by index (the last such forward end is the first
    met walking back from backward, a few events: the walks read no more)."""
    def submodule(i: int, kind: str) -> bool:
        k, module = kind_and_module(i)
        return k == kind and module != ""
    last_fw = next((i for i in range(min(backward_start, n) - 1, -1, -1)
                    if submodule(i, "post_fw")), None)
    first_bw = next((i for i in range(backward_start, n) if submodule(i, "pre_bw")), None)
    if last_fw is None or first_bw is None:
        return None
    return last_fw, first_bw


def split_loss(events: Sequence[Event], span: tuple[int, int] | None, lo: int, hi: int,
               activations: int) -> dict[str, int]:
    """``activations`` of the gap over events ``lo..hi`` as ``{activations, loss}`` when the gap
    lies inside the loss's ``span`` (``loss_span``), else as ``{activations}``: see
    [Note: the loss in the breakdown]. The two parts always sum to ``activations``."""
    return loss_parts(events[span[0]].level if span is not None else 0, span, lo, hi,
                      activations)


def loss_parts(model: int, span: tuple[int, int] | None, lo: int, hi: int, activations: int
               ) -> dict[str, int]:
    """``split_loss`` given ``model``, the level at the span's start (what the model holds)."""
    if span is None or not span[0] < lo <= hi <= span[1]:
        return {"activations": activations}
    return {"activations": min(model, activations), "loss": max(0, activations - model)}


def _first_and_last(codes: np.ndarray, backward_start: int
                    ) -> tuple[_CodeIndex, _CodeIndex]:
    """The first and the last event index of each (kind, module, in backward), keyed by
    ``code << 1 | in_backward`` (``EventNames.code``): from one stable sort of the keys, so
    equal keys stay in event order."""
    import numpy as np  # see [Note: numpy on first use]

    keys = codes << 1
    keys[max(0, backward_start):] |= 1
    order = np.argsort(keys, kind="stable")
    ordered = keys[order]
    starts = np.flatnonzero(np.concatenate(([True], ordered[1:] != ordered[:-1])))
    ends = np.append(starts[1:], len(keys)) - 1
    unique = ordered[starts]
    return _CodeIndex(unique, order[starts]), _CodeIndex(unique, order[ends])


class _CodeIndex:
    """Event indices by code (``_first_and_last``), read as a dict's ``get`` (by bisection
    of the sorted codes) or for many codes at once (``get_many``). The search composes a
    profile per checkpointing mix and looks up a few hundred codes in each: building two dicts
    over every event took longer than all of them."""

    __slots__ = ("_code_array", "_index_array")

    def __init__(self, codes: np.ndarray, indices: np.ndarray) -> None:
        self._code_array, self._index_array = codes, indices
        """Sorted, each once; and the event index of each."""

    def get(self, code: int, default: int) -> int:
        """The event index of ``code``, else ``default`` (a few per profile: the root's window;
        the search's lookups go through ``get_many``, and Python lists of the codes for
        bisection took longer to make than the sort)."""
        codes = self._code_array
        at = int(codes.searchsorted(code))
        if at < len(codes) and int(codes[at]) == code:
            return int(self._index_array[at])
        return default

    def get_many(self, codes: np.ndarray, default: int) -> np.ndarray:
        """``get`` of each of ``codes`` (int64), as an int64 array."""
        import numpy as np  # see [Note: numpy on first use]

        at = np.searchsorted(self._code_array, codes)
        inside = at < len(self._code_array)
        found = np.zeros(len(codes), dtype=bool)
        found[inside] = self._code_array[at[inside]] == codes[inside]
        out = np.full(len(codes), default, dtype=np.int64)
        out[found] = self._index_array[at[found]]
        return out

    def __len__(self) -> int:
        return len(self._code_array)


def _sparse_table(peaks: np.ndarray) -> np.ndarray:
    """Row ``j``: the highest of ``peaks`` over the ``2**j`` events from each index, for every
    ``2**j`` up to the number of events, as one 2-D array (``max_peak``'s O(1) range maxima).
    Row ``j`` holds ``n - 2**j + 1`` such maxima; its last ``2**j - 1`` entries copy the row
    above and no query reads them."""
    import numpy as np  # see [Note: numpy on first use]

    n = len(peaks)
    table = np.empty((max(1, n.bit_length()), n), dtype=peaks.dtype)
    table[0] = peaks
    span = 1
    for j in range(1, len(table)):
        prev, row = table[j - 1], table[j]
        row[:] = prev
        valid = n - 2 * span + 1
        np.maximum(prev[:valid], prev[span:span + valid], out=row[:valid])
        span *= 2
    return table


def _gap_start(points: list[int], i: int) -> int:
    """The first event whose peak the coded point ``points[i]`` covers (see ``_points``)."""
    if points[i] & 3:
        return points[i] >> 2
    return (points[i - 1] >> 2) + 1 if i else 0


def _encode(live, instants, grads_at):
    """Buffers with their (event, sub-step) points coded as one integer ``4 * event + sub + 1``
    (ordered as the tuples are): see ``_sweep``."""
    live = [(4 * s[0] + s[1] + 1, 4 * e[0] + e[1] + 1, nbytes, cat) for s, e, nbytes, cat in live]
    instants = [(4 * at[0] + at[1] + 1, nbytes, cat) for at, nbytes, cat in instants]
    grads_at = [(4 * at + 2, nbytes) for at, nbytes in grads_at]
    return live, instants, grads_at


def _points(profile: ActivationProfile, live, extra_bytes: dict[int, int], grads_at,
            every_event: bool = False) -> tuple[list[int], list[int]]:
    """The coded points a sweep visits, in order, and the activation bytes at each: the gap
    ending at an event holds the highest activation since the previous point's event.
    ``every_event`` adds the gap before every event (for pictures): between two points of the
    sweep no buffer starts or ends, so those gaps never exceed the sweep's highest total."""
    n = profile.num_events
    points = set(range(0, 4 * n, 4)) if every_event else {0, 4 * (n - 1)}
    points.update(start for start, _, _, _ in live)
    points.update(start & ~3 for start, _, _, _ in live)
    points.update(end & ~3 for _, end, _, _ in live)
    points.update(extra_bytes)
    # A sharded gradient appears while the reduce-scatter input still lives: for the last unit
    # to reduce nothing ends after that, so its point must be visited (a root-only plan at
    # shard size 1 holds a whole fp32 gradient twice there).
    points.update(at for at, _ in grads_at)
    if profile.loss_span is not None:  # gaps that begin and end with the loss's region
        points.update(4 * k for k in profile.loss_span)
    # The gap before an instant holds the activation peak since the previous boundary: without
    # it, a backward-prefetch copy-out hides the peak of the gap just before it.
    points.update(key & ~3 for key in extra_bytes)
    ordered = sorted(pt for pt in points if pt < 4 * n)
    levels, max_peak = profile.levels, profile.max_peak
    previous = [-1] + [pt >> 2 for pt in ordered[:-1]]
    activations = [max_peak(prev + 1, pt >> 2) if pt & 3 == 0 else levels[pt >> 2]
                   for pt, prev in zip(ordered, previous)]
    return ordered, activations


def _parts_at(point: int, live, instants, grads_at, static: dict[str, int]) -> dict[str, int]:
    """What holds memory at one coded ``point`` (activations left out), from coded buffers."""
    parts = dict(static)
    for start, end, nbytes, cat in live:
        held = (start <= point) - (end <= point)
        if held:
            parts[cat] = parts.get(cat, 0) + held * nbytes
    for at, nbytes in grads_at:
        if at <= point:
            parts["sharded_grads"] = parts.get("sharded_grads", 0) + nbytes
    parts = {k: v for k, v in parts.items() if v or k in static}
    if point & 3:
        for at, nbytes, cat in instants:
            if at == point:
                parts[cat] = parts.get(cat, 0) + nbytes
    return parts


def _phase_name(profile: ActivationProfile, event: int) -> str:
    phase = "forward" if event <= profile.forward_end else "backward"
    kind, module = profile.kind_and_module(event)
    return f"{phase} ({kind} {module or '<root>'})"


def _offload_copy_bytes(unit: UnitSpec, p: Precision) -> int:
    """Device bytes of an offloaded unit's shard while its all-gather input is built: the
    host-to-device copy (stored dtype) and, below float32, its cast to ``param_dtype``."""
    cast = p.unit_param_bytes(unit) if p.unit_param_bytes(unit) < p.orig_bytes else 0
    return unit.shard_numel * (p.orig_bytes + cast)


@dataclass(kw_only=True)
class StepBuffers:
    """What one steady step holds, as ``estimate_peak`` sweeps it: always-resident bytes,
    buffers live over a range of (event, sub-step) points, instants, and the sharded gradients
    that appear once a unit's reduce-scatter is done (see [Note: sub-steps])."""

    static: dict[str, int]
    """Resident for the whole step (sharded parameters, optimizer states, buffers, inputs)."""
    held: dict[str, int]
    """Resident during the micro-batch but not at the optimizer step ([Note: gradient
    accumulation])."""
    live: list[tuple[tuple[int, int], tuple[int, int], int, str]]
    instants: list[tuple[tuple[int, int], int, str]]
    grads_at: list[tuple[int, int]]
    optimizer_step: dict[str, int] | None
    """What the optimizer step holds (None with offload: it runs on the host)."""


# What a buffer of the step holds, per unit (``_Skeleton``): its bytes are ``rate * mult`` with
# the unit's rate of that kind (``_unit_rates``).
(_UNSHARDED, _GATHER_COPY, _OFFLOAD_COPY, _RS_INPUT, _PARAM_BYTES, _ALL_GRADS, _SHARD_ORIG,
 _LARGEST_SHARD) = range(8)


def _decode(point: int) -> tuple[int, int]:
    """The (event, sub-step) of a coded point ``4 * event + sub + 1`` (``_encode``)."""
    return (point - 1) >> 2, (point - 1) & 3


_CATEGORIES = ("unsharded_params", "comm_buffers", "unsharded_grads", "offload_copies")
"""The categories a skeleton's buffers fall in (the ``_CATEGORY`` column of
``_Placed.rows`` indexes this)."""
_CAT_PARAMS, _CAT_COMM, _CAT_GRADS, _CAT_OFFLOAD = range(4)


_START, _END, _CATEGORY, _UNIT, _KIND, _MULT = range(6)
"""The columns of ``_Placed.rows``."""


@dataclass(kw_only=True, slots=True)
class _Placed:
    """Buffers of a skeleton, a row of int64 columns each (``_START`` .. ``_MULT``): each is
    present from its coded point ``start`` to ``end`` (``_encode``; an instant only at
    ``start``: its ``_END`` column is unused, ``timed`` False), in category
    ``_CATEGORIES[category]``, with ``mult`` times its unit's rate of ``kind``
    (``_unit_rates``). One 2-D array, so that joining, interleaving and reordering buffers
    are one numpy call each, and the sweep reads the rows as they are (``_sweep_of``)."""

    rows: np.ndarray
    timed: bool

    @classmethod
    def of(cls, start: np.ndarray, end: np.ndarray | None, category: int | np.ndarray,
           unit: np.ndarray, kind: int | np.ndarray, mult: int | np.ndarray = 1) -> _Placed:
        """Buffers at ``start`` (to ``end``) of ``unit``; scalars apply to every one."""
        import numpy as np  # see [Note: numpy on first use]

        rows = np.empty((len(start), 6), dtype=np.int64)
        rows[:, _START] = start
        rows[:, _END] = end if end is not None else -1
        rows[:, _CATEGORY] = category
        rows[:, _UNIT] = unit
        rows[:, _KIND] = kind
        rows[:, _MULT] = mult
        return cls(rows=rows, timed=end is not None)

    @classmethod
    def join(cls, parts: list[_Placed], *, interleave: bool = False) -> _Placed:
        """``parts`` one after the other, or (``interleave``, parts of one length) entry by
        entry: the first of each part, then the second of each, and so on."""
        import numpy as np  # see [Note: numpy on first use]

        if interleave:
            rows = np.stack([part.rows for part in parts], axis=1).reshape(-1, 6)
        else:
            rows = (np.concatenate([part.rows for part in parts]) if parts
                    else np.zeros((0, 6), dtype=np.int64))
        return cls(rows=rows, timed=all(part.timed for part in parts))

    def take(self, indices: np.ndarray) -> _Placed:
        """The buffers at ``indices``, in that order."""
        return _Placed(rows=self.rows[indices], timed=self.timed)

    def listed(self) -> list[tuple[int, int | None, str, int, int, int]]:
        """Each buffer as (start, end or None for an instant, category name, unit, kind,
        mult), as Python values (pictures and tests: the sweep reads ``rows``)."""
        return [(start, end if self.timed else None, _CATEGORIES[category], unit, kind, mult)
                for start, end, category, unit, kind, mult in self.rows.tolist()]


@dataclass(kw_only=True)
class _Skeleton:
    """Every buffer of one steady step as ``step_buffers`` places it, without its bytes: live
    buffers (start, end, category, unit, kind of rate, multiplier) and instants (the same
    without an end), as columns of coded points (``_Placed``). It depends on the profile's
    hook frame ([Note: hook frames]), the units' modules and reshard choices, the prefetch
    depths, offload and whether sharded gradients appear, not on the shard size or dtypes,
    so the search reuses it across meshes and checkpointing mixes; the sweep's points are
    fixed by it too (``_sweep_structure``), their activations by the mix (``_sweep_of``)."""

    live: _Placed
    instants: _Placed
    reduced: np.ndarray
    """Rows (event, unit), a column per unit in backward order: the unit's post-backward,
    where its reduce-scatter runs, whether or not its sharded gradient stays."""
    grads_appear: bool
    """Whether each unit's sharded gradient appears after its reduce-scatter."""
    width: int
    """How many units (the columns of their rates, ``_unit_rates``)."""
    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    """The part of its sweep every mix shares (``_sweep_structure``)."""
    held_bytes: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    """The bytes its buffers hold at each point of its sweep, by the identity of the rates
    they were read from (kept beside, read only): every mix on the frame shares them
    (``_buffer_bytes``)."""
    serial: int = field(default_factory=lambda: next(_SKELETON_SERIALS))
    """Names the skeleton among a profile's sweeps (``ActivationProfile._sweeps``)."""

    def at(self, events: np.ndarray) -> _Skeleton:
        """This skeleton (on a hook frame) at the events ``events`` names for the frame's
        (``ActivationProfile.hook_frame``)."""
        import numpy as np  # see [Note: numpy on first use]

        def placed(buffers: _Placed) -> _Placed:
            rows = buffers.rows.copy()
            rows[:, _START] = _coded_at(rows[:, _START], events)
            if buffers.timed:
                rows[:, _END] = _coded_at(rows[:, _END], events)
            return _Placed(rows=rows, timed=buffers.timed)
        return _Skeleton(live=placed(self.live), instants=placed(self.instants),
                         reduced=np.stack((events[self.reduced[0]], self.reduced[1])),
                         grads_appear=self.grads_appear, width=self.width)

    @property
    def reduced_at(self) -> list[tuple[int, int]]:
        """(event, unit) of each reduce-scatter (``reduced``)."""
        return list(zip(*self.reduced.tolist()))

    @property
    def grads_at(self) -> list[tuple[int, int]]:
        """(event, unit): the unit's sharded gradient appears after its reduce-scatter."""
        return self.reduced_at if self.grads_appear else []


_SKELETON_SERIALS = itertools.count()


def _coded_at(points: np.ndarray, events: np.ndarray) -> np.ndarray:
    """Coded points ``4 * event + sub + 1`` on a hook frame, at the events ``events`` names
    for the frame's (``ActivationProfile.hook_frame``)."""
    return 4 * events[points >> 2] + (points & 3)


def _unit_rates(units: list[UnitSpec], p: Precision, shard: int) -> np.ndarray:
    """Bytes per unit of each kind of rate (rows ``_UNSHARDED`` .. ``_LARGEST_SHARD``)."""
    import numpy as np  # see [Note: numpy on first use]

    rows = [[0] * len(units) for _ in range(8)]
    for i, u in enumerate(units):
        pb = p.unit_param_bytes(u)
        unsharded = u.unsharded_numel(shard) * pb
        rows[_UNSHARDED][i] = unsharded
        rows[_GATHER_COPY][i] = unsharded + u.shard_numel * pb
        rows[_OFFLOAD_COPY][i] = _offload_copy_bytes(u, p)
        rows[_RS_INPUT][i] = u.unsharded_numel(shard) * p.reduce_bytes
        rows[_PARAM_BYTES][i] = pb
        rows[_ALL_GRADS][i] = u.numel * pb
        rows[_SHARD_ORIG][i] = u.shard_numel * p.orig_bytes
        rows[_LARGEST_SHARD][i] = u.largest_shard_numel * p.orig_bytes
    return np.array(rows, dtype=np.int64).reshape(8, len(units))


def _skeleton_of(profile: ActivationProfile, units: list[UnitSpec], ctx: StepContext,
                 held: dict[str, int], forward_prefetch: int, backward_prefetch: int
                 ) -> _Skeleton:
    """The skeleton ``ctx`` sweeps, on the profile's hook frame ([Note: hook frames]):
    sharded gradients appear after each reduce-scatter unless accumulation holds them from
    the start or they are stepped in backward ([Note: optimizer overlap in memory])."""
    return _framed_skeleton(profile.hook_frame()[0], units, offload=ctx.offload,
                            sharded_grads="sharded_grads" not in held
                            and not ctx.optimizer_overlap,
                            forward_prefetch=forward_prefetch,
                            backward_prefetch=backward_prefetch)


def _skeleton(profile: ActivationProfile, units: list[UnitSpec], *, offload: bool,
              sharded_grads: bool, forward_prefetch: int, backward_prefetch: int) -> _Skeleton:
    """The buffers of ``step_buffers`` ([Note: FSDP2 memory timeline]) at the profile's own
    events: its hook frame's skeleton, mapped ([Note: hook frames])."""
    frame, events = profile.hook_frame()
    return _framed_skeleton(frame, units, offload=offload, sharded_grads=sharded_grads,
                            forward_prefetch=forward_prefetch,
                            backward_prefetch=backward_prefetch).at(events)


def _framed_skeleton(frame: ActivationProfile, units: list[UnitSpec], *, offload: bool,
                     sharded_grads: bool, forward_prefetch: int, backward_prefetch: int
                     ) -> _Skeleton:
    """The buffers of ``step_buffers`` on a hook ``frame``, cached there by the units' layout
    (``_Layout``) and their choices: every mix with that frame reads them."""
    facts = _units_facts(units)
    layout = facts.layout
    key = (layout, facts.reshard, offload, sharded_grads, forward_prefetch, backward_prefetch)
    found = frame._skeletons.get(key)
    if found is None:
        # whether sharded gradients appear changes no buffer's place: the twin's are these
        twin = frame._skeletons.get((layout, facts.reshard, offload, not sharded_grads,
                                     forward_prefetch, backward_prefetch))
        if twin is not None:
            found = frame._skeletons[key] = _Skeleton(
                live=twin.live, instants=twin.instants, reduced=twin.reduced,
                grads_appear=_grads_appear(sharded_grads, offload), width=twin.width)
            return found
        placed = frame._layouts.get(layout)
        if placed is None:
            placed = frame._layouts[layout] = _layout(frame, units)
        found = frame._skeletons[key] = _place_buffers(
            placed, units, offload=offload, sharded_grads=sharded_grads,
            forward_prefetch=forward_prefetch, backward_prefetch=backward_prefetch)
    return found


@dataclass(kw_only=True, slots=True)
class _Layout:
    """What a skeleton takes from the units' modules alone, not from their reshard and
    prefetch choices: the search places some 30 skeletons per plan (70B) over a few layouts
    per hook frame, so this is worked out once per frame and layout (``_layout``). Arrays by
    unit index, or in the order named."""

    fw_start: np.ndarray
    fw_end: np.ndarray
    bw_start: np.ndarray
    bw_end: np.ndarray
    """Where the unit's backward ends, after FSDP2's early post-backward (``_layout``)."""
    fw_order: np.ndarray
    """The units that ran (with parameters) in forward order."""
    bw_sequence: np.ndarray
    """Those units by where their backward starts."""
    bw_order: np.ndarray
    """Those units by where their backward ends (their reduce-scatters, in order)."""
    forward_output: _Placed
    """The all-gather output in forward, by ``fw_order``."""
    grads: _Placed
    """Each parameter module's unsharded gradients, unit by unit in ``bw_sequence``."""
    grads_per_unit: np.ndarray
    """How many of ``grads`` each unit in ``bw_sequence`` has."""
    reduce_input: _Placed
    """The reduce-scatter inputs, by ``bw_order``."""


def _layout(profile: ActivationProfile, units: list[UnitSpec]) -> _Layout:
    """The windows (``ActivationProfile.windows``) of ``units``, their orders, and the
    buffers whose place their modules fix."""
    import numpy as np  # see [Note: numpy on first use]

    windows = profile.cached_windows_of(units)  # shared: read, never changed
    fw_start = np.array([w.fw_start for w in windows], dtype=np.int64)
    fw_end = np.array([w.fw_end for w in windows], dtype=np.int64)
    bw_start = np.array([w.bw_start for w in windows], dtype=np.int64)
    bw_end = np.array([w.bw_end for w in windows], dtype=np.int64)
    ran = np.array([i for i, w in enumerate(windows) if w.ran and units[i].numel > 0],
                   dtype=np.int64)
    fw_order = ran[fw_start[ran].argsort(kind="stable")]  # stable, as sorted()
    bw_sequence = ran[bw_start[ran].argsort(kind="stable")]
    # FSDP2 runs a unit's post-backward before the next unit's pre-backward hook, although
    # module hooks may report them the other way round: end each unit where the next begins.
    here, nxt = bw_sequence[:-1], bw_sequence[1:]
    root = np.array([u.modules == [""] for u in units], dtype=bool)
    cut = ~root[here] & (bw_start[nxt] > bw_start[here])
    bw_end[here[cut]] = np.minimum(bw_end[here[cut]], bw_start[nxt[cut]])
    bw_order = ran[np.lexsort((-bw_start[ran], bw_end[ran]))]

    # In forward FSDP2 keeps the all-gather output alive until the next unit's copy-out or
    # the root's post-forward (``comm_ctx.all_gather_state``: overlap of copy-out with the
    # next all-gather); with one root unit that is the whole forward.
    start = fw_start[fw_order]
    freed = np.empty(len(fw_order), dtype=np.int64)
    freed[:-1] = 4 * start[1:] + 2
    if len(fw_order):
        roots = ran[root[ran]]
        freed[-1] = 4 * (fw_end[roots[0]] if len(roots) else fw_end[fw_order[-1]]) + 1
    forward_output = _Placed.of(4 * start + 3, freed, _CAT_COMM, fw_order, _UNSHARDED)

    # Each parameter module's unsharded gradients, from where its backward ends (clamped to
    # its unit's backward) to the unit's post-backward.
    events, numels, counts = _gradient_modules(profile, units, bw_sequence)
    grads_end = bw_end[bw_sequence].repeat(counts)
    made_at = np.minimum(np.maximum(events, bw_start[bw_sequence].repeat(counts)),
                         grads_end)
    grads = _Placed.of(4 * made_at + 2, 4 * grads_end + 1, _CAT_GRADS,
                       bw_sequence.repeat(counts), _PARAM_BYTES, numels)

    # FSDP2 keeps one reduce-scatter input: each lives until the next unit's post-backward
    end = bw_end[bw_order]
    reduce_input = _Placed.of(4 * end + 1, 4 * np.append(end[1:], profile.num_events) + 1,
                              _CAT_COMM, bw_order, _RS_INPUT)
    return _Layout(fw_start=fw_start, fw_end=fw_end, bw_start=bw_start, bw_end=bw_end,
                   fw_order=fw_order, bw_sequence=bw_sequence, bw_order=bw_order,
                   forward_output=forward_output, grads=grads, grads_per_unit=counts,
                   reduce_input=reduce_input)


def _gradient_modules(profile: ActivationProfile, units: list[UnitSpec], order: np.ndarray
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per parameter module of the units in ``order``, unit after unit: the event where its
    backward ends (its first ``post_bw``, -1 without one) and its parameter count; and how
    many such modules each unit has.

    Until the module's backward ends, the analysis timeline already holds its weight
    gradients (they stay activation-side until their post-accumulate-grad hook), so counting
    them from pre-backward counted them twice: a tied embedding +9% on BERT."""
    import numpy as np  # see [Note: numpy on first use]

    modules = [units[i].param_modules for i in order.tolist()]
    # ``first_event("post_bw", fqn, -1)`` of each, looked up all at once
    keys = profile._event_keys("post_bw", [fqn for pm in modules for fqn, _ in pm], True)
    return (profile._first.get_many(np.array(keys, dtype=np.int64), -1),
            np.array([numel for pm in modules for _, numel in pm], dtype=np.int64),
            np.array([len(pm) for pm in modules], dtype=np.int64))


def _place_buffers(layout: _Layout, units: list[UnitSpec], *, offload: bool,
                   sharded_grads: bool, forward_prefetch: int, backward_prefetch: int
                   ) -> _Skeleton:
    """The buffers of ``step_buffers`` at coded points ``4 * event + sub + 1``, in forward,
    backward and reduce-scatter order, each unit's together: the order and every point of
    the per-unit rule that the comments state, on arrays over the units."""
    import numpy as np  # see [Note: numpy on first use]

    reshard = np.array([u.reshard_after_forward for u in units], dtype=bool)
    fw_live, fw_instants = _forward_buffers(layout, reshard, offload, forward_prefetch)
    bw_live, bw_instants = _backward_buffers(layout, reshard, offload, backward_prefetch)
    # The reduce-scatter input is filled while the unsharded gradients still exist; with
    # offload the reduced shard is copied to the host and freed on the device.
    bw_order = layout.bw_order
    filled = _Placed.of(layout.reduce_input.rows[:, _START], None, _CAT_GRADS, bw_order,
                         _ALL_GRADS)
    # Sharded gradients appear after each reduce-scatter (held from the start when
    # accumulating; on the host with offload).
    return _Skeleton(
        live=_Placed.join([fw_live, bw_live, layout.reduce_input]),
        instants=_Placed.join([fw_instants, bw_instants,
                               _with_offload(filled, offload, _SHARD_ORIG)]),
        reduced=np.stack((layout.bw_end[bw_order], bw_order)),
        grads_appear=_grads_appear(sharded_grads, offload), width=len(units))


def _grads_appear(sharded_grads: bool, offload: bool) -> bool:
    """Whether the sharded gradients appear on the device after each reduce-scatter (with
    offload they are copied to the host)."""
    return sharded_grads and not offload


def _with_offload(instants: _Placed, offload: bool, kind: int) -> _Placed:
    """``instants``, each followed (with offload) by one of the offload copies (``kind``) at
    the same point."""
    if not offload:
        return instants
    copies = _Placed.of(instants.rows[:, _START], None, _CAT_OFFLOAD, instants.rows[:, _UNIT],
                        kind)
    return _Placed.join([instants, copies], interleave=True)


def _gathered(starts: np.ndarray, order: np.ndarray, prefetch: int) -> np.ndarray:
    """Coded points where each unit in ``order`` (starting at ``starts``, in that order) has
    its parameters all-gathered: at the start of the unit ``prefetch`` places before it (no
    later than its own), right after that unit's copy-out (sub-step 2), else at its own start
    before its copy-out (sub-step 1)."""
    import numpy as np  # see [Note: numpy on first use]

    gather_at = np.minimum(starts[np.maximum(0, np.arange(len(order)) - prefetch)], starts)
    return 4 * gather_at + np.where(gather_at < starts, 3, 2)


def _forward_buffers(layout: _Layout, reshard: np.ndarray, offload: bool, prefetch: int
                     ) -> tuple[_Placed, _Placed]:
    """Live buffers and instants of the units' forward, unit after unit: its unsharded
    parameters (gathered ``prefetch`` units ahead) until its post-forward, or until its
    post-backward when it keeps them, then the all-gather output; the copy-out (and offload
    copy) instants."""
    import numpy as np  # see [Note: numpy on first use]

    order = layout.fw_order
    kept = np.where(reshard[order], layout.fw_end[order], layout.bw_end[order])
    params = _Placed.of(_gathered(layout.fw_start[order], order, prefetch), 4 * kept + 1,
                        _CAT_PARAMS, order, _UNSHARDED)
    copy_out = _Placed.of(4 * layout.fw_start[order] + 2, None, _CAT_COMM, order,
                          _GATHER_COPY)
    return (_Placed.join([params, layout.forward_output], interleave=True),
            _with_offload(copy_out, offload, _OFFLOAD_COPY))


def _backward_buffers(layout: _Layout, reshard: np.ndarray, offload: bool, prefetch: int
                      ) -> tuple[_Placed, _Placed]:
    """Live buffers and instants of the units' backward, unit after unit by where backward
    starts: a resharded unit's parameters gathered again (``prefetch`` units ahead) until its
    post-backward, with their copy-out (and offload copy) instant; then its parameter
    modules' unsharded gradients (``_Layout.grads``)."""
    import numpy as np  # see [Note: numpy on first use]

    order = layout.bw_sequence
    again = reshard[order]
    start = layout.bw_start[order]
    params = _Placed.of(_gathered(start, order, prefetch)[again],
                        4 * layout.bw_end[order][again] + 1, _CAT_PARAMS, order[again],
                        _UNSHARDED)
    copy_out = _Placed.of(4 * start[again] + 2, None, _CAT_COMM, order[again], _GATHER_COPY)
    # each unit's slots: its parameters (when gathered again), then its gradients
    slots = again.astype(np.int64) + layout.grads_per_unit
    first = (slots.cumsum() - slots)[again]
    take = np.empty(int(slots.sum()), dtype=np.int64)
    is_grad = np.ones(len(take), dtype=bool)
    is_grad[first] = False
    take[first] = np.arange(len(first))
    take[is_grad] = len(first) + np.arange(len(layout.grads.rows))
    return (_Placed.join([params, layout.grads]).take(take),
            _with_offload(copy_out, offload, _OFFLOAD_COPY))


def _sweep_of(profile: ActivationProfile, skeleton: _Skeleton) -> dict[str, np.ndarray]:
    """The sweep of a skeleton on the profile's hook frame (``_skeleton_of``) over this
    profile: the frame's part (``_sweep_structure``) with the activations at each of its
    points here: the highest event peak since the previous point for the gap before an
    event, else the event's level (``ActivationProfile.framed_activations``)."""
    import numpy as np  # see [Note: numpy on first use]

    a = profile._sweeps.get(skeleton.serial)
    if a is not None:
        return a
    fixed = _sweep_structure(profile.hook_frame()[0], skeleton)
    levels, gap_peaks = profile.framed_activations()
    activations = levels[fixed["events"]]
    activations[fixed["gaps"]] = np.maximum.reduceat(gap_peaks, fixed["gap_bounds"])[0::2]
    a = profile._sweeps[skeleton.serial] = {**fixed, "activations": activations}
    return a


def _sweep_structure(frame: ActivationProfile, skeleton: _Skeleton) -> dict[str, np.ndarray]:
    """The skeleton's buffers as coded int64 arrays (``_encode``) and the part of its sweep
    its hook ``frame`` fixes ([Note: hook frames]): the points ``_points`` visits, their
    frame events, which are gaps and the ranges of frame events they span, and where each
    point reads the running sum of buffers and instants."""
    import numpy as np  # see [Note: numpy on first use]
    a = skeleton.arrays
    if a:
        return a
    n = frame.num_events
    live, inst = skeleton.live.rows, skeleton.instants.rows  # read, never changed
    reduced = skeleton.reduced
    grads = (np.stack((4 * reduced[0] + 2, reduced[1]), axis=1) if skeleton.grads_appear
             else np.zeros((0, 2), dtype=np.int64))
    starts, ends = live[:, _START], live[:, _END]
    inst_keys = inst[:, _START]
    # the points of ``_points``: every buffer's start (and the gap before it), every end's
    # gap, the instants (and the gaps before them), the sharded gradients, the loss's region
    span = [4 * k for k in frame.loss_span] if frame.loss_span is not None else []
    points = _unique(np.concatenate((
        np.array([0, 4 * (n - 1), *span], dtype=np.int64), starts, starts & ~3, ends & ~3,
        inst_keys, inst_keys & ~3, grads[:, 0])))
    points = points[points < 4 * n]
    gap = (points & 3) == 0
    # each gap's events on the frame, from the one after the previous point's to its own:
    # bounds for ``reduceat`` over the frame's gap peaks (``framed_activations``), each
    # range followed by the one up to the next gap's start (read, then dropped)
    event = points >> 2
    gaps = np.flatnonzero(gap)
    gap_bounds = np.empty(2 * len(gaps), dtype=np.int64)
    gap_bounds[0::2] = np.where(gaps > 0, event[gaps - 1] + 1, 0)
    gap_bounds[1::2] = event[gaps] + 1  # at most the frame's events: a 0 closes its peaks
    # each buffer's bytes are ``rates[kind, unit] * mult``: read from the flattened rates
    width = skeleton.width
    live_rate = live[:, _KIND] * width + live[:, _UNIT]
    grad_rate = _SHARD_ORIG * width + grads[:, 1]
    live_mult = live[:, _MULT].copy()
    inst_rate = inst[:, _KIND] * width + inst[:, _UNIT]
    # one running sum over every key: a buffer adds its bytes at its start and takes them
    # back at its end; an instant is there at its own sub-step point only (never at a
    # gap's), so it adds at its point and takes them back at the next code
    counted = (inst_keys & 3) != 0
    inst_mult = inst[counted, _MULT]
    keys = np.concatenate((starts, ends, grads[:, 0], inst_keys[counted],
                           inst_keys[counted] + 1))
    order = keys.argsort(kind="stable")
    a.update(live=live, inst=inst, grads=grads, live_rate=live_rate, live_mult=live_mult,
             grad_rate=grad_rate, inst_rate=inst_rate,
             sum_rate=np.concatenate((live_rate, live_rate, grad_rate, inst_rate[counted],
                                      inst_rate[counted]))[order],
             sum_mult=np.concatenate((live_mult, -live_mult,
                                      np.ones(len(grads), dtype=np.int64), inst_mult,
                                      -inst_mult))[order],
             points=points, events=event, gaps=gaps, gap_bounds=gap_bounds,
             sum_at=keys[order].searchsorted(points, side="right"))
    return a


def _unique(values: np.ndarray) -> np.ndarray:
    """``np.unique(values)`` (sorted, each once) by a sort, in place (``values``: the
    caller's scratch array): numpy 2.4's ``unique`` hashes, some ten times slower on the
    sweep's few thousand points."""
    import numpy as np  # see [Note: numpy on first use]

    ordered = values
    ordered.sort()
    if len(ordered) < 2:
        return ordered
    return ordered[np.concatenate(([True], ordered[1:] != ordered[:-1]))]


_RATES: dict[tuple, np.ndarray] = {}
"""``_unit_rates`` by everything they read (``_rates_of``): one layout's are the same under
every checkpointing mix and prefetch, so they are kept across profiles and skeletons (read
only: the arrays are not writeable). Emptied when it holds ``_RATES_KEPT``."""
_RATES_KEPT = 4096


def _rates_of(units: list[UnitSpec], p: Precision, shard: int) -> np.ndarray:
    """``_unit_rates`` of ``units``, cached in ``_RATES``."""
    key = (shard, p, tuple((u.numel, u.shard_numel, u.full_precision, u.largest_shard_numel)
                           for u in units))
    rates = _RATES.get(key)
    if rates is None:
        if len(_RATES) >= _RATES_KEPT:
            _RATES.clear()
        rates = _RATES[key] = _unit_rates(units, p, shard)
        rates.flags.writeable = False
    return rates


class _UnitsFacts:
    """What the memory model reads of one list of units whatever the evaluation: the key of
    its layout and reshard choices (``_framed_skeleton``), its totals, and its rates by
    precision and shard size. The search evaluates one list, built once per layout and never
    changed, under many checkpointing mixes, prefetch depths and contexts (``_units_facts``)."""

    __slots__ = ("layout", "num_params", "numel", "rates", "reshard", "shard_numel", "units")

    def __init__(self, units: list[UnitSpec]) -> None:
        self.units = units
        self.layout = tuple((tuple(u.modules), u.numel > 0, len(u.param_modules))
                            for u in units)
        """What names the units' modules (``_Layout``'s key)."""
        self.reshard = tuple(u.reshard_after_forward for u in units)
        self.shard_numel = sum(u.shard_numel for u in units)
        self.num_params = sum(u.num_params for u in units)
        self.numel = sum(u.numel for u in units)
        self.rates: dict[tuple[Precision, int], np.ndarray] = {}
        """``_rates_of`` by precision and shard size."""

    def rates_at(self, p: Precision, shard: int) -> np.ndarray:
        """``_rates_of`` these units."""
        found = self.rates.get((p, shard))
        if found is None:
            found = self.rates[(p, shard)] = _rates_of(self.units, p, shard)
        return found


_UNITS_FACTS: dict[int, _UnitsFacts] = {}
"""``_UnitsFacts`` by the identity of their list, which each keeps alive (so no other list
takes its id while kept). Emptied when it holds ``_RATES_KEPT``."""


def _units_facts(units: list[UnitSpec]) -> _UnitsFacts:
    """The facts of ``units``, kept by the list's identity: a list given to the memory model
    is read, never changed afterwards (nothing in the package changes a unit or a list of
    them once built)."""
    found = _UNITS_FACTS.get(id(units))
    if found is None or found.units is not units:
        if len(_UNITS_FACTS) >= _RATES_KEPT:
            _UNITS_FACTS.clear()
        found = _UNITS_FACTS[id(units)] = _UnitsFacts(units)
    return found


def estimate_peak(profile: ActivationProfile, units: list[UnitSpec], ctx: StepContext, *,
                  forward_prefetch: int = 0, backward_prefetch: int = 1) -> MemoryEstimate:
    """Peak bytes per rank of one steady step for ``units`` (children first, root last).

    The highest total over the gaps between boundary events and the sub-step instants
    ([Note: sub-steps]): every buffer is present on the half-open range ``start <= point <
    end`` of coded points ``4 * event + sub + 1``, so one sweep suffices. The search calls this
    for every candidate, so the sweep runs on int64 arrays whose points, order and activations
    the skeleton fixes (``_sweep_of``); only the bytes change with the shard size and dtypes:
    the running total at each point is a prefix sum (``_buffer_bytes``). It visits ``_points``'s points (``memory_timeline``;
    tests/test_pictures.py checks both agree for every candidate).
    """
    static, held = _static_and_held(units, ctx)
    skeleton = _skeleton_of(profile, units, ctx, held, forward_prefetch, backward_prefetch)
    a = _sweep_of(profile, skeleton)
    grid = _units_facts(units).rates_at(ctx.precision, ctx.shard_size)
    rates = grid.ravel()  # by ``kind * units + unit``: see _sweep_structure
    base = {**static, **held}
    totals = a["activations"] + _buffer_bytes(skeleton, a, grid)
    best_at = int(totals.argmax())  # the first highest point
    point = int(a["points"][best_at])  # on the frame; ``event``: here
    here = profile.hook_frame()[1]
    event = int(here[a["events"][best_at]])
    gap_start = event if point & 3 else int(here[a["events"][best_at - 1]]) + 1 if best_at else 0
    best = MemoryEstimate(
        peak_bytes=sum(base.values()) + int(totals[best_at]), phase=_phase_name(profile, event),
        breakdown=Deferred(functools.partial(
            _breakdown_at, point, a, rates, base,
            profile.split_loss(gap_start, event, int(a["activations"][best_at])))))
    optimizer_step = _optimizer_step(units, ctx, static)
    if optimizer_step is not None and sum(optimizer_step.values()) > best.peak_bytes:
        best = MemoryEstimate(peak_bytes=sum(optimizer_step.values()), phase="optimizer step",
                              breakdown=dict(optimizer_step))
    if ctx.optimizer_overlap and not ctx.offload:
        for point, parts in _steps_in_backward(skeleton, a, here, grid, base, ctx.optimizer):
            if sum(parts.values()) > best.peak_bytes:
                best = MemoryEstimate(peak_bytes=sum(parts.values()), breakdown=parts,
                                      phase="optimizer step in " + _phase_name(profile, point >> 2))
    return best


def _buffer_bytes(skeleton: _Skeleton, a: dict[str, np.ndarray], grid: np.ndarray
                  ) -> np.ndarray:
    """The bytes ``skeleton``'s buffers and instants hold at each point of its sweep ``a``
    with ``grid``'s rates (``_unit_rates``): the running sum at each point
    (``_sweep_structure``), worked out once per skeleton and rates."""
    found = skeleton.held_bytes.get(id(grid))
    if found is None or found[0] is not grid:
        found = skeleton.held_bytes[id(grid)] = (
            grid, _prefix_sums(grid.ravel()[a["sum_rate"]] * a["sum_mult"])[a["sum_at"]])
    return found[1]


def _breakdown_at(point: int, a: dict[str, np.ndarray], rates: np.ndarray,
                  static: dict[str, int], activations: dict[str, int]) -> dict[str, int]:
    """``estimate_peak``'s breakdown at the coded ``point`` on the hook frame: what
    ``_parts_of`` finds there, then the ``activations`` (and the loss) at it."""
    parts = _parts_of(point, a, rates, static)
    parts.update(activations)
    return parts


def _prefix_sums(values: np.ndarray) -> np.ndarray:
    """0, then the running sums of ``values`` (int64, added in order)."""
    import numpy as np  # see [Note: numpy on first use]

    out = np.zeros(len(values) + 1, dtype=np.int64)
    values.cumsum(out=out[1:])
    return out


def _steps_in_backward(skeleton: _Skeleton, a: dict[str, np.ndarray], here: np.ndarray,
                       rates: np.ndarray, static: dict[str, int], optimizer: str
                       ) -> list[tuple[int, dict[str, int]]]:
    """(coded point at the profile's events, what is held) while each unit's parameters
    step in backward ([Note: optimizer overlap in memory]): the buffers live at its
    post-backward point (no instants), the point's activations, its sharded gradient and one
    parameter's step temporary. ``skeleton`` and ``a``: on the hook frame (``_sweep_of``),
    whose events are at ``here`` in the profile (``ActivationProfile.hook_frame``)."""
    import numpy as np  # see [Note: numpy on first use]

    flat = rates.ravel()
    points = a["points"]
    out = []
    for event, unit in skeleton.reduced_at:
        point = 4 * event + 1
        at = int(np.searchsorted(points, point))
        if at >= len(points) or int(points[at]) != point:
            continue
        parts = _parts_of(point, a, flat, static, instants=False)
        parts["activations"] = int(a["activations"][at])
        parts["sharded_grads"] = parts.get("sharded_grads", 0) + int(rates[_SHARD_ORIG, unit])
        temporary = step_temporaries(optimizer) * int(rates[_LARGEST_SHARD, unit])
        if temporary:
            parts["optimizer_temporaries"] = temporary
        out.append((4 * int(here[a["events"][at]]) + 1, parts))
    return out


def _parts_of(point: int, a: dict[str, np.ndarray], rates: np.ndarray, static: dict[str, int],
              *, instants: bool = True) -> dict[str, int]:
    """``_parts_at`` of the coded ``point`` from a sweep's arrays (``_sweep_structure``; same
    order of keys) and the units' flattened ``rates``; ``instants`` False leaves out the
    buffers that exist only at that instant."""
    import numpy as np  # see [Note: numpy on first use]
    parts = dict(static)
    live = a["live"]
    held = (live[:, _START] <= point).astype(np.int64) - (live[:, _END] <= point)
    rows = np.flatnonzero(held)
    nbytes = rates[a["live_rate"][rows]] * a["live_mult"][rows]
    for category, h, b in zip(live[rows, _CATEGORY].tolist(), held[rows].tolist(),
                              nbytes.tolist()):
        cat = _CATEGORIES[category]
        parts[cat] = parts.get(cat, 0) + h * b
    made = a["grads"][:, 0] <= point
    if made.any():
        parts["sharded_grads"] = parts.get("sharded_grads", 0) + int(
            rates[a["grad_rate"][made]].sum())
    parts = {k: v for k, v in parts.items() if v or k in static}
    if point & 3 and instants:
        inst, inst_rate = a["inst"], a["inst_rate"]
        for j in np.flatnonzero(inst[:, _START] == point).tolist():
            cat = _CATEGORIES[int(inst[j, _CATEGORY])]
            parts[cat] = parts.get(cat, 0) + int(rates[inst_rate[j]]) * int(inst[j, _MULT])
    return parts


def _static_and_held(units: list[UnitSpec], ctx: StepContext
                     ) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes resident for the whole step, and those held during the micro-batch only."""
    p = ctx.precision
    facts = _units_facts(units)
    total_shard = facts.shard_numel
    static = {
        "sharded_params": total_shard * p.orig_bytes,
        "optimizer_states": optimizer_state_bytes(ctx.optimizer, total_shard,
                                                  facts.num_params, p.orig_bytes),
        "buffers": ctx.buffer_bytes,
        "inputs": ctx.input_bytes,
    }
    if ctx.offload:  # [Note: CPU offload on the device]: these live on the host
        static["sharded_params"] = static["optimizer_states"] = 0
    # what earlier micro-batches leave held: [Note: gradient accumulation]
    held: dict[str, int] = {}
    if ctx.grad_accum_steps > 1 and ctx.gradient_sync == "every" and not ctx.offload:
        held["sharded_grads"] = total_shard * p.orig_bytes
    if ctx.grad_accum_steps > 1 and ctx.gradient_sync == "last":
        accum_bytes = p.reduce_bytes if p.reduce_bytes != p.param_bytes else p.param_bytes
        held["accumulated_grads"] = facts.numel * accum_bytes
    return static, held


def _optimizer_step(units: list[UnitSpec], ctx: StepContext, static: dict[str, int]
                    ) -> dict[str, int] | None:
    """What the optimizer step holds (None with offload: it runs on the host; None with
    optimizer overlap: it ran in backward)."""
    if ctx.offload or ctx.optimizer_overlap:
        return None
    grads = _units_facts(units).shard_numel * ctx.precision.orig_bytes
    temporaries = grads if OPTIMIZER_STATES.get(ctx.optimizer, 0) else 0
    return {**static, "sharded_grads": grads, "optimizer_temporaries": temporaries}


def step_buffers(profile: ActivationProfile, units: list[UnitSpec], ctx: StepContext, *,
                 forward_prefetch: int = 0, backward_prefetch: int = 1) -> StepBuffers:
    """Every buffer of one steady step for ``units`` ([Note: FSDP2 memory timeline]), before
    the sweep: ``estimate_peak`` takes their highest total, ``memory_timeline`` all of them."""
    static, held = _static_and_held(units, ctx)
    skeleton = _skeleton_of(profile, units, ctx, held, forward_prefetch,
                            backward_prefetch).at(profile.hook_frame()[1])
    rates = _rates_of(units, ctx.precision, ctx.shard_size).tolist()
    assert skeleton.live.timed, "live buffers end"
    return StepBuffers(
        static=static, held=held,
        live=[(_decode(s), _decode(e), rates[k][u] * m, cat)
              for s, e, cat, u, k, m in skeleton.live.listed()],
        instants=[(_decode(at), rates[k][u] * m, cat)
                  for at, _, cat, u, k, m in skeleton.instants.listed()],
        grads_at=[(at, rates[_SHARD_ORIG][u]) for at, u in skeleton.grads_at],
        optimizer_step=_optimizer_step(units, ctx, static))


@dataclass(kw_only=True)
class MemoryTimeline:
    """Memory over one steady step as the model sees it: every point the sweep visits (coded
    ``4 * event + sub + 1``, see ``_sweep``) with its activation bytes, and the step's
    buffers (coded the same way), then the optimizer step. ``peak_bytes`` is
    ``estimate_peak``'s figure: the same points and buffers, not a second model."""

    events: list[Event]
    forward_end: int
    """Index of the last forward event."""
    points: list[int]
    activations: list[int]
    static: dict[str, int]
    held: dict[str, int]
    live: list[tuple[int, int, int, str]]
    instants: list[tuple[int, int, str]]
    grads_at: list[tuple[int, int]]
    optimizer_step: dict[str, int] | None
    loss_span: tuple[int, int] | None = None
    """Where the loss is computed ([Note: the loss in the breakdown]); None shows no ``loss``."""
    steps_in_backward: list[tuple[int, dict[str, int]]] = field(default_factory=list)
    """(coded point, what is held) while each unit's parameters step in backward ([Note:
    optimizer overlap in memory]); empty without optimizer overlap."""

    def parts(self, i: int) -> dict[str, int]:
        """What holds memory at ``points[i]``, activations (and what the loss holds) included."""
        parts = _parts_at(self.points[i], self.live, self.instants, self.grads_at,
                          {**self.static, **self.held})
        parts.update(split_loss(self.events, self.loss_span, _gap_start(self.points, i),
                                self.points[i] >> 2, self.activations[i]))
        return parts

    def totals(self) -> list[int]:
        """Bytes at every point, then at the optimizer step (when it runs on the device)."""
        out = [sum(self.parts(i).values()) for i in range(len(self.points))]
        out += [sum(parts.values()) for _, parts in self.steps_in_backward]
        if self.optimizer_step is not None:
            out.append(sum(self.optimizer_step.values()))
        return out

    @property
    def peak_bytes(self) -> int:
        return max(self.totals(), default=0)


def memory_timeline(profile: ActivationProfile, units: list[UnitSpec], ctx: StepContext, *,
                    forward_prefetch: int = 0, backward_prefetch: int = 1) -> MemoryTimeline:
    """Every point of ``estimate_peak``'s sweep with what holds memory there (for pictures:
    memory over the step, and an allocation trace; not called by the search)."""
    b = step_buffers(profile, units, ctx, forward_prefetch=forward_prefetch,
                     backward_prefetch=backward_prefetch)
    live, instants, grads_at = _encode(b.live, b.instants, b.grads_at)
    extra_bytes = {key: 0 for key, _, _ in instants}
    points, activations = _points(profile, live, extra_bytes, grads_at, every_event=True)
    steps = []
    if ctx.optimizer_overlap and not ctx.offload:  # the points estimate_peak adds
        skeleton = _skeleton_of(profile, units, ctx, b.held, forward_prefetch, backward_prefetch)
        steps = _steps_in_backward(skeleton, _sweep_of(profile, skeleton),
                                   profile.hook_frame()[1],
                                   _rates_of(units, ctx.precision, ctx.shard_size),
                                   {**b.static, **b.held}, ctx.optimizer)
    return MemoryTimeline(events=profile.events, forward_end=profile.forward_end, points=points,
                          activations=activations, static=b.static, held=b.held, live=live,
                          instants=instants, grads_at=grads_at, optimizer_step=b.optimizer_step,
                          loss_span=profile.loss_span, steps_in_backward=steps)
