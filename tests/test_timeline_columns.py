"""The column-wise composer and skeleton placement give what the per-event rules gave.

cost/timeline.py [Note: timeline columns] builds a checkpointing mix from the passes' columns
and cost/memory.py places a step's buffers on arrays over the units. Both must be identical,
bit for bit and in order, to the per-event and per-unit rules they replaced, which are kept
here as the references (as they read before issue 29 item 3). Fixture-level: the tiny Llama
facts, plus a selective pass and autocast releases derived from them, no torch model.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import numpy as np
import pytest

from fsdp_plan.cost.memory import (
    _CATEGORIES,
    ActivationProfile,
    StepContext,
    _coded_at,
    _decode,
    _framed_skeleton,
    _layout,
    _place_buffers,
    _skeleton,
    _sweep_of,
    _sweep_structure,
    estimate_peak,
    memory_timeline,
)
from fsdp_plan.cost.precision import Precision
from fsdp_plan.cost.timeline import (
    AUTOCAST_EXIT,
    EventColumns,
    EventNames,
    TimelineComposer,
    find_segments,
)
from fsdp_plan.cost.units import UnitSpec, build_units
from fsdp_plan.facts.types import Event, ModelFacts, Timeline

FIXTURE = Path(__file__).parent / "fixtures" / "tiny_llama_facts.json"


# --- the per-event and per-unit rules, as they read before the columns ---------------------

def _reference_events(c: TimelineComposer, which: frozenset[int],
                      selective: frozenset[int]) -> list[Event]:
    """``TimelineComposer.events`` as one Event at a time (cb9d64d): a pass's own events
    for no block, or every block, in one mode."""
    every = frozenset(range(len(c.blocks)))
    passes = {(frozenset(), frozenset()): c.plain, (every, frozenset()): c.ckpt,
              (frozenset(), every): c.sel}
    if (which, selective) in passes:
        return passes[(which, selective)].events
    p = c.plain_seg
    cached = sum(c.released_delta(i, "full") for i in which) + sum(
        c.released_delta(i, "selective") for i in selective)
    release_at = next((k for k in range(*p.middle)
                       if c.plain.events[k].kind in (AUTOCAST_EXIT, "pre_bw")), p.middle[1])

    def source(i):
        if i in which:
            return c.ckpt.events, c.ckpt_seg
        if i in selective:
            return c.sel.events, c.sel_seg
        return c.plain.events, c.plain_seg
    pieces = [(c.plain.events, 0, p.prefix_end)]
    pieces += [(source(i)[0], *source(i)[1].fw[i]) for i in range(len(c.blocks))]
    pieces.append((c.plain.events, *p.middle))
    pieces += [(source(i)[0], *source(i)[1].bw[i]) for i in reversed(range(len(c.blocks)))]
    pieces.append((c.plain.events, p.suffix_start, len(c.plain.events)))
    out, level, flops = [], 0, 0.0
    for src, start, end in pieces:
        if start >= end:
            continue
        base_level, base_flops = src[start].level, src[start].flops
        glue = src is c.plain.events and (start, end) == p.middle
        if glue and cached:
            shift, flops_shift = level - base_level, flops - base_flops
            first = shift + src[start].level
            for k in range(start, end):
                e = src[k]
                now = shift + e.level - (cached if k >= release_at else 0)
                peak = shift + e.peak - (cached if k > release_at else 0)
                out.append(Event(kind=e.kind, module=e.module, level=now,
                                 peak=max(first, peak) if k == start else max(peak, now),
                                 flops=flops_shift + e.flops, ops=e.ops))
        else:
            for e in src[start:end]:
                peak = level + e.peak - base_level
                out.append(Event(kind=e.kind, module=e.module, level=level + e.level - base_level,
                                 peak=max(level, peak) if e is src[start] else peak,
                                 flops=flops + e.flops - base_flops, ops=e.ops))
        nxt = src[end] if end < len(src) else src[end - 1]
        level += nxt.level - base_level - (cached if glue else 0)
        flops += nxt.flops - base_flops
    return out


def _reference_indices(events: list[Event]) -> tuple[int, dict, dict, tuple[int, int] | None]:
    """Backward start, first and last index per (kind, module, in backward), loss span."""
    start = next((i for i, e in enumerate(events) if e.kind == "pre_bw"), len(events) - 1)
    first, last = {}, {}
    for i, e in enumerate(events):
        first.setdefault((e.kind, e.module, i >= start), i)
        last[(e.kind, e.module, i >= start)] = i
    last_fw = max((i for i in range(min(start, len(events)))
                   if events[i].kind == "post_fw" and events[i].module), default=None)
    first_bw = next((i for i in range(start, len(events))
                     if events[i].kind == "pre_bw" and events[i].module), None)
    span = None if last_fw is None or first_bw is None else (last_fw, first_bw)
    return start, first, last, span


def _reference_left(events: list[Event], modules: tuple[str, ...], start: int, stop: int) -> int:
    """``ActivationProfile._backward_left`` event by event (cb9d64d)."""
    def inside(fqn):
        return any(fqn == m or fqn.startswith(m + ".") for m in modules)

    def around(fqn):
        return fqn == "" or any(m.startswith(fqn + ".") for m in modules)
    last_inside = start
    for i in range(start, stop + 1):
        if events[i].kind == "pre_bw" and inside(events[i].module):
            last_inside = i
    for i in range(last_inside + 1, stop + 1):
        if events[i].kind == "pre_bw" and not inside(events[i].module) \
                and not around(events[i].module):
            return i
    return stop


def _reference_windows(events: list[Event], modules: list[str]) -> tuple:
    """A unit's windows, module by module (as ``_find_windows`` read before its lookups
    were reduced per unit): (fw_start, fw_end, bw_start, bw_end, ran)."""
    start, first, last, _ = _reference_indices(events)
    end = len(events) - 1
    if modules == [""]:
        return 0, last.get(("post_fw", "", False), max(0, start - 1)), start, end, True
    fw_starts = [first[k] for m in modules if (k := ("pre_fw", m, False)) in first]
    if not fw_starts:
        return 0, 0, end, end, False
    fw_ends = [last[k] for m in modules if (k := ("post_fw", m, False)) in last]
    bw_starts = [first[k] for m in modules if (k := ("pre_bw", m, True)) in first]
    bw_ends = [last[k] for m in modules if (k := ("post_bw", m, True)) in last]
    bw_start = min(bw_starts) if bw_starts else start
    bw_end = max(bw_ends) if bw_ends and len(bw_ends) == len(bw_starts) else end
    if bw_ends and len(bw_ends) == len(bw_starts):
        bw_end = min(bw_end, _reference_left(events, tuple(modules), bw_start, bw_end))
    return min(fw_starts), max(fw_ends or fw_starts), bw_start, max(bw_end, bw_start), True


def _reference_buffers(profile, units, *, offload, sharded_grads, forward_prefetch,
                       backward_prefetch):
    """``_place_buffers`` unit by unit, with (event, sub-step) points (cb9d64d)."""
    windows = [profile.windows(u) for u in units]
    ran = [i for i, w in enumerate(windows) if w.ran and units[i].numel > 0]
    fw_order = sorted(ran, key=lambda i: windows[i].fw_start)
    bw_sequence = sorted(ran, key=lambda i: windows[i].bw_start)
    for here, nxt in zip(bw_sequence, bw_sequence[1:]):  # noqa: RUF007 - as it read
        if units[here].modules != [""] and windows[nxt].bw_start > windows[here].bw_start:
            windows[here].bw_end = min(windows[here].bw_end, windows[nxt].bw_start)
    live, instants = [], []
    for pos, i in enumerate(fw_order):
        u, w = units[i], windows[i]
        gather_at = windows[fw_order[max(0, pos - forward_prefetch)]].fw_start
        end = (w.fw_end, 0) if u.reshard_after_forward else (w.bw_end, 0)
        live.append(((gather_at, 2 if gather_at < w.fw_start else 1), end,
                     "unsharded_params", i, 0, 1))
        instants.append(((w.fw_start, 1), "comm_buffers", i, 1, 1))
        if offload:
            instants.append(((w.fw_start, 1), "offload_copies", i, 2, 1))
        if pos + 1 < len(fw_order):
            freed = (windows[fw_order[pos + 1]].fw_start, 1)
        else:
            root = [j for j in ran if units[j].modules == [""]]
            freed = (windows[root[0]].fw_end if root else w.fw_end, 0)
        live.append(((w.fw_start, 2), freed, "comm_buffers", i, 0, 1))
    for pos, i in enumerate(bw_sequence):
        u, w = units[i], windows[i]
        if u.reshard_after_forward:
            gather_at = min(windows[bw_sequence[max(0, pos - backward_prefetch)]].bw_start,
                            w.bw_start)
            live.append(((gather_at, 2 if gather_at < w.bw_start else 1), (w.bw_end, 0),
                         "unsharded_params", i, 0, 1))
            instants.append(((w.bw_start, 1), "comm_buffers", i, 1, 1))
            if offload:
                instants.append(((w.bw_start, 1), "offload_copies", i, 2, 1))
        for fqn, numel in u.param_modules:
            made_at = min(max(profile.first_event("post_bw", fqn, w.bw_start), w.bw_start),
                          w.bw_end)
            live.append(((made_at, 1), (w.bw_end, 0), "unsharded_grads", i, 4, numel))
    bw_order = sorted(ran, key=lambda i: (windows[i].bw_end, -windows[i].bw_start))
    grads_at, reduced_at = [], []
    for pos, i in enumerate(bw_order):
        w = windows[i]
        reduced_at.append((w.bw_end, i))
        nxt = windows[bw_order[pos + 1]].bw_end if pos + 1 < len(bw_order) \
            else profile.num_events
        live.append(((w.bw_end, 0), (nxt, 0), "comm_buffers", i, 3, 1))
        instants.append(((w.bw_end, 0), "unsharded_grads", i, 5, 1))
        if offload:
            instants.append(((w.bw_end, 0), "offload_copies", i, 6, 1))
        elif sharded_grads:
            grads_at.append((w.bw_end, i))
    return live, instants, grads_at, reduced_at


# --- fixtures ----------------------------------------------------------------------------

def _facts() -> ModelFacts:
    with open(FIXTURE) as f:
        return ModelFacts.from_dict(json.load(f))


def _with_passes(facts: ModelFacts, *, autocast: bool, int_flops: bool) -> ModelFacts:
    """The facts with a selective pass (the plain one with other levels), optionally with
    autocast releases (every block's checkpointed forward frees casts at the autocast exit)
    and integer FLOPs (Python ints mixed into the float arithmetic). Peaks are jittered, some
    below their level, and FLOPs made inexact, so that every ``max`` and the order of every
    floating-point operation show in the result."""
    a = facts.analysis
    rng = random.Random(7)

    def varied(t: Timeline, scale: float) -> Timeline:
        out = dataclasses.replace(t, events=[
            dataclasses.replace(e, level=int(e.level * scale),
                                peak=int((e.level if rng.random() < 0.5 else e.peak) * scale)
                                + rng.randrange(-3000, 1000),
                                flops=(int(e.flops) if int_flops
                                       else e.flops * 1.1 + rng.random() * 1e-3))
            for e in t.events])
        seg = find_segments(out, facts.graph.blocks)
        for start, _ in [*seg.fw, *seg.bw, seg.middle]:  # a piece's first peak below its level
            out.events[start].peak = out.events[start].level - 1000
        return out
    plain = varied(a.timeline, 1.0)
    ckpt = varied(a.checkpointed_timeline, 1.0)
    sel = varied(a.timeline, 0.75)
    blocks = facts.graph.blocks
    if autocast:
        plain.autocast_released = {b: 100 * i for i, b in enumerate(blocks)}
        ckpt.autocast_released = {f"{b}.attention": 5000 + 37 * i for i, b in enumerate(blocks)}
        sel.autocast_released = {b: 2000 + i for i, b in enumerate(blocks)}
    analysis = dataclasses.replace(a, timeline=plain, checkpointed_timeline=ckpt,
                                   selective_timeline=sel)
    return dataclasses.replace(facts, analysis=analysis)


def _mixes(n: int) -> list[tuple[frozenset[int], frozenset[int]]]:
    rng = random.Random(3)
    out = [(frozenset(range(k)), frozenset(range(k, j))) for k in range(n + 1)
           for j in range(k, n + 1)]
    out += [(frozenset(rng.sample(range(n), rng.randint(0, n))),
             frozenset(rng.sample(range(n), rng.randint(0, n)))) for _ in range(10)]
    return out


# --- the tests ---------------------------------------------------------------------------

@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("int_flops", [False, True])
def test_composite_columns_are_the_per_event_composite(autocast, int_flops):
    facts = _with_passes(_facts(), autocast=autocast, int_flops=int_flops)
    c = TimelineComposer(facts.analysis, facts.graph.blocks)
    assert c.supports_mixed()
    released = 0
    for which, selective in _mixes(len(facts.graph.blocks)):
        selective = selective - which
        got = c.events(which, selective)
        assert isinstance(got, EventColumns)
        want = _reference_events(c, which, selective)
        assert len(got) == len(want) and got == want
        for g, w in zip(got.as_list(), want):
            assert (type(g.level), type(g.peak), type(g.flops)) == \
                (type(w.level), type(w.peak), type(w.flops))
            assert g.ops is w.ops
        released += sum(c.released_delta(i, "full") for i in which) > 0
    assert released or not autocast  # the glue's autocast release was composed


def test_a_pass_gives_back_its_own_events():
    facts = _facts()
    c = TimelineComposer(facts.analysis, facts.graph.blocks)
    assert c.events(0).as_list() is facts.analysis.timeline.events
    assert c.events(len(facts.graph.blocks)).as_list() is \
        facts.analysis.checkpointed_timeline.events


def test_profile_from_columns_reads_as_the_per_event_profile():
    facts = _with_passes(_facts(), autocast=True, int_flops=False)
    c = TimelineComposer(facts.analysis, facts.graph.blocks)
    modules = list(facts.graph.modules)
    rng = random.Random(5)
    for which, selective in _mixes(len(facts.graph.blocks))[::3]:
        columns = c.events(which, selective - which)
        events = list(columns)
        for profile in (ActivationProfile(columns), ActivationProfile(events)):
            start, first, last, span = _reference_indices(events)
            assert (profile.backward_start, profile.loss_span) == (start, span)
            for index, reference in ((profile._first, first), (profile._last, last)):
                assert len(index) == len(reference)
                assert all(profile._index(index, *key, -1) == i for key, i in reference.items())
            assert profile.levels == [e.level for e in events]
            assert profile.events == events
            assert [profile.max_peak(i, j) for i, j in ((0, len(events) - 1), (3, 40))] == \
                [max(e.peak for e in events), max(e.peak for e in events[3:41])]
            # the sweep's gaps: ascending, disjoint, non-empty ranges ending anywhere, the
            # last event included
            for _ in range(20):
                cuts = sorted(rng.sample(range(1, len(events)), rng.randint(1, 30)))
                ends = np.array([c - 1 for c in cuts] + [len(events) - 1], dtype=np.int64)
                starts = np.array([0, *cuts], dtype=np.int64)
                keep = np.array([rng.random() < 0.6 for _ in ends])
                keep[-1] = True
                assert profile._gap_maxima(starts[keep], ends[keep]).tolist() == [
                    max(e.peak for e in events[lo:hi + 1])
                    for lo, hi in zip(starts[keep].tolist(), ends[keep].tolist())]
            for _ in range(100):
                group = tuple(rng.sample(modules, rng.randint(1, 3)))
                lo = rng.randrange(len(events))
                hi = rng.randrange(lo, len(events))
                assert profile._backward_left(group, lo, hi) == \
                    _reference_left(events, group, lo, hi)


def test_windows_are_the_per_module_lookup():
    """Each unit's windows, its modules' events looked up all at once and reduced per unit,
    are the module-by-module rule's, for units of one module, several, modules that never
    ran, a module that has no event of some kinds, and the root."""
    facts = _with_passes(_facts(), autocast=False, int_flops=False)
    c = TimelineComposer(facts.analysis, facts.graph.blocks)
    modules = list(facts.graph.modules)
    rng = random.Random(11)
    groups = [[m] for m in modules] + [[""], ["not.a.module"], ["not.a.module", modules[1]]]
    groups += [rng.sample(modules[1:], rng.randint(2, 6)) for _ in range(40)]
    for which, selective in _mixes(len(facts.graph.blocks))[::4]:
        events = list(c.events(which, selective - which))
        profile = ActivationProfile(c.events(which, selective - which))
        rng.shuffle(groups)
        for at in range(0, len(groups), 17):  # looked up together, as a layout's units are
            units = [UnitSpec(modules=g) for g in groups[at:at + 17]]
            got = [(w.fw_start, w.fw_end, w.bw_start, w.bw_end, w.ran)
                   for w in profile._find_windows(units)]
            assert got == [_reference_windows(events, u.modules) for u in units]
    # random timelines: forwards that never end, backwards without a post-backward (inputs
    # that need no gradient), modules that run twice or only in backward
    names = ["a", "a.x", "a.y", "b", "b.x", "c", "d"]
    for _ in range(30):
        kinds = [rng.choice(("pre_fw", "post_fw")) for _ in range(rng.randint(3, 25))]
        kinds += ["pre_bw"] + [rng.choice(("pre_bw", "post_bw", "pre_fw", "post_fw"))
                               for _ in range(rng.randint(0, 25))]
        events = [Event(kind=k, module=rng.choice(["", *names]), level=0, peak=0, flops=0.0)
                  for k in kinds]
        profile = ActivationProfile(events)
        units = [UnitSpec(modules=rng.sample(names, rng.randint(1, 3))) for _ in range(12)]
        got = [(w.fw_start, w.fw_end, w.bw_start, w.bw_end, w.ran)
               for w in profile._find_windows([*units, UnitSpec(modules=[""])])]
        assert got == [_reference_windows(events, u.modules) for u in [*units,
                                                                        UnitSpec(modules=[""])]]


LAYOUTS = (
    lambda b: [[m] for m in b],                                  # one unit per block
    lambda b: [b[:2], b[2:]],                                   # grouped blocks
    lambda b: [["tok_embeddings"]] + [[m] for m in b] + [["output"]],
    lambda b: [[f"{m}.attention" for m in b], [f"{m}.feed_forward" for m in b]],
    lambda b: [],                                               # the root alone
)


@pytest.mark.parametrize("layout", range(len(LAYOUTS)))
def test_skeleton_columns_are_the_per_unit_placement(layout):
    facts = _facts()
    blocks = facts.graph.blocks
    groups = [g for g in LAYOUTS[layout](blocks) if all(m in facts.graph.modules for m in g)]
    c = TimelineComposer(facts.analysis, blocks)
    rng = random.Random(layout)
    for k in (0, 2, len(blocks)):
        profile = ActivationProfile(c.events(k))
        for _ in range(6):
            reshard = [rng.random() < 0.6 for _ in groups] + [rng.random() < 0.3]
            units = build_units(facts.graph, groups, reshard, 4)
            for offload in (False, True):
                kw = {"offload": offload, "sharded_grads": rng.random() < 0.7,
                      "forward_prefetch": rng.randint(0, 2),
                      "backward_prefetch": rng.randint(0, 2)}
                got = _skeleton(profile, units, **kw)
                live, instants, grads_at, reduced_at = _reference_buffers(profile, units, **kw)
                assert [(_decode(s), _decode(e), c, u, k, m)
                        for s, e, c, u, k, m in got.live.listed()] == live
                assert [(_decode(s), c, u, k, m)
                        for s, _, c, u, k, m in got.instants.listed()] == instants
                assert (got.grads_at, got.reduced_at) == (grads_at, reduced_at)
                assert {c for _, _, c, *_ in got.live.listed()} <= set(_CATEGORIES)


def test_hook_frames_place_and_sweep_as_the_mix_itself():
    """[Note: hook frames]: a layout's buffers placed once on a hook frame and mapped onto a
    mix are the ones placed on the mix's own events, and the frame's sweep read at the mix
    visits the same points in the same order with the activations there; mixes whose hooks
    name the same modules in the same order share one frame."""
    facts = _with_passes(_facts(), autocast=True, int_flops=False)
    blocks = facts.graph.blocks
    c = TimelineComposer(facts.analysis, blocks)
    rng = random.Random(13)
    mixes = _mixes(len(blocks))
    frames = set()
    for which, selective in mixes:
        profile = ActivationProfile(c.events(which, selective - which))
        frame, events = profile.hook_frame()
        frames.add(id(frame))
        assert frame.num_events < profile.num_events or not which
        for make in LAYOUTS:
            groups = [g for g in make(blocks) if all(m in facts.graph.modules for m in g)]
            reshard = [rng.random() < 0.6 for _ in groups] + [rng.random() < 0.3]
            units = build_units(facts.graph, groups, reshard, 4)
            kw = {"offload": rng.random() < 0.3, "sharded_grads": rng.random() < 0.7,
                  "forward_prefetch": rng.randint(0, 2), "backward_prefetch": rng.randint(0, 2)}
            own = _place_buffers(_layout(profile, units), units, **kw)
            mapped = _skeleton(profile, units, **kw)
            for got, want in ((mapped.live, own.live), (mapped.instants, own.instants)):
                assert got.listed() == want.listed()
            assert mapped.reduced.tolist() == own.reduced.tolist()
            assert mapped.grads_appear == own.grads_appear
            sweep = _sweep_of(profile, _framed_skeleton(frame, units, **kw))
            direct = _sweep_structure(profile, own)
            assert _coded_at(sweep["points"], events).tolist() == direct["points"].tolist()
            assert events[sweep["events"]].tolist() == direct["events"].tolist()
            for name in ("sum_rate", "sum_mult", "sum_at", "gaps"):
                assert sweep[name].tolist() == direct[name].tolist(), name
            points = direct["points"].tolist()
            assert sweep["activations"].tolist() == [
                profile.max_peak((points[i - 1] >> 2) + 1 if i else 0, p >> 2) if p & 3 == 0
                else profile.levels[p >> 2] for i, p in enumerate(points)]
    assert len(frames) < len(mixes)
    # random timelines (as test_windows_are_the_per_module_lookup's): forwards that never
    # end, backwards without a post-backward, replayed forwards, the root without hooks
    names = ["a", "a.x", "a.y", "b", "b.x", "c", "d"]
    for _ in range(60):
        kinds = [rng.choice(("pre_fw", "post_fw", "end")) for _ in range(rng.randint(3, 25))]
        kinds += ["pre_bw"] + [rng.choice(("pre_bw", "post_bw", "pre_fw", "post_fw", "end"))
                               for _ in range(rng.randint(0, 25))]
        events = [Event(kind=k, module=rng.choice(["", *names]), level=0, peak=0, flops=0.0)
                  for k in kinds]
        profile = ActivationProfile(events)
        frame, at = profile.hook_frame()
        units = [UnitSpec(modules=rng.sample(names, rng.randint(1, 3))) for _ in range(12)]
        units.append(UnitSpec(modules=[""]))
        assert [(int(at[w.fw_start]), int(at[w.fw_end]), int(at[w.bw_start]),
                 int(at[w.bw_end]), w.ran) for w in frame._find_windows(units)] == [
            (w.fw_start, w.fw_end, w.bw_start, w.bw_end, w.ran)
            for w in profile._find_windows(units)]
        assert profile.loss_span == (None if frame.loss_span is None else tuple(
            int(at[i]) for i in frame.loss_span))


def test_peak_and_timeline_agree_on_the_column_skeletons():
    """estimate_peak's figure is memory_timeline's, the one sweep both read (the pictures'
    check, here over mixes and offload)."""
    facts = _facts()
    blocks = facts.graph.blocks
    c = TimelineComposer(facts.analysis, blocks)
    units = build_units(facts.graph, [[b] for b in blocks], [True] * len(blocks) + [False], 2)
    for k in range(len(blocks) + 1):
        profile = ActivationProfile(c.events(k))
        for offload in (False, True):
            ctx = StepContext(precision=Precision(orig_bytes=4, param_bytes=2, reduce_bytes=4),
                              shard_size=2, optimizer="adamw", buffer_bytes=0,
                              input_bytes=1024, offload=offload)
            peak = estimate_peak(profile, units, ctx, forward_prefetch=1)
            assert peak.peak_bytes == memory_timeline(profile, units, ctx,
                                                      forward_prefetch=1).peak_bytes
            assert all(isinstance(v, int) for v in peak.breakdown.values())


def test_passes_with_the_same_events_share_codes_and_segments():
    # the checkpointed passes replay the same hooks: one codes array and one split for them,
    # each still what its own events give (another block list, other events: their own)
    facts = _facts()
    a, blocks = facts.analysis, facts.graph.blocks
    names = EventNames()
    again = [dataclasses.replace(e, level=e.level + 1) for e in a.checkpointed_timeline.events]
    ckpt = EventColumns.of(a.checkpointed_timeline.events, names)
    same = EventColumns.of(again, names)
    assert same.codes is ckpt.codes and not same.codes.flags.writeable
    alone = EventColumns.of(again)  # names of its own
    assert [names.named(c) for c in same.codes.tolist()] == [
        alone.names.named(c) for c in alone.codes.tolist()]
    plain = EventColumns.of(a.timeline.events, names)
    assert plain.codes is not ckpt.codes and len(plain) == len(a.timeline.events)
    split = find_segments(a.checkpointed_timeline, blocks, ckpt)
    assert find_segments(Timeline(events=again), blocks, same) is split
    assert split == find_segments(a.checkpointed_timeline, blocks)  # columns of its own
    assert find_segments(a.timeline, blocks, plain) == find_segments(a.timeline, blocks)
    assert find_segments(a.timeline, blocks, plain) != split
    fewer = find_segments(a.checkpointed_timeline, blocks[:-1], ckpt)
    assert fewer is not split and fewer == find_segments(a.checkpointed_timeline, blocks[:-1])
