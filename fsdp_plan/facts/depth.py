"""Analyse deep models in constant time: cut each stack of repeated blocks to three, then repeat.

[Note: depth reduction]
A decoder's blocks are identical, so their activation segments and FLOPs are too. The analysis
deletes all but the first three blocks of each repeated stack (an ``nn.ModuleList`` or
``nn.Sequential``; the forward iterates over it), runs the fake pass, checks that the second
and third blocks behaved the same (the same level change and FLOPs in forward), and then
rebuilds the full timeline: the second block's segment is repeated for every missing block
and the third stands for the last. A model whose forward indexes blocks by count, or whose
blocks differ, fails the check and is analysed in full.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from torch import nn

from fsdp_plan.facts.types import Event, ModuleCompute, Timeline, fill_flops

KEEP = 3


@dataclass
class DepthCut:
    """What was cut: per stack, the container's FQN and its full block count."""

    stacks: list[tuple[str, int]]
    kept_blocks: list[str]


def reduced_copy(model: nn.Module, blocks: list[str]) -> tuple[nn.Module, DepthCut] | None:
    """A copy of ``model`` holding only the first ``KEEP`` blocks of each stack, and what was
    cut; None if no stack is worth cutting (``model`` itself is left as it was).

    Only the kept blocks are copied: each container's module dict is swapped for its first
    ``KEEP`` entries while ``deepcopy`` runs (copying 10,000 modules to delete most of them
    took seconds)."""
    by_container: dict[str, list[str]] = {}
    for fqn in blocks:
        parent, _, _ = fqn.rpartition(".")
        by_container.setdefault(parent, []).append(fqn)
    stacks: list[tuple[str, int]] = []
    for parent, members in by_container.items():
        container = model.get_submodule(parent) if parent else model
        names = [f.rpartition(".")[2] for f in members]
        if not isinstance(container, (nn.ModuleList, nn.Sequential)) or len(members) <= KEEP + 1:
            continue
        if names != [str(i) for i in range(len(container))]:
            continue
        stacks.append((parent, len(members)))
    if not stacks:
        return None
    swapped = []
    kept: list[str] = []
    try:
        for parent, _count in stacks:
            container = model.get_submodule(parent) if parent else model
            full = container._modules
            container._modules = type(full)(list(full.items())[:KEEP])
            swapped.append((container, full))
            kept += [f"{parent}.{i}" if parent else str(i) for i in range(KEEP)]
        copied = copy.deepcopy(model)
    except Exception:  # a module holding something uncopyable: analyse every block instead
        return None
    finally:
        for container, full in swapped:
            container._modules = full
    return copied, DepthCut(stacks=stacks, kept_blocks=kept)


def _rename(fqn: str, src: str, dst: str) -> str:
    if fqn == src or fqn.startswith(src + "."):
        return dst + fqn[len(src):]
    return fqn


def _index_of(events: list[Event], kind: str, module: str) -> int | None:
    for i, ev in enumerate(events):
        if ev.kind == kind and ev.module == module:
            return i
    return None


def _same_block(events: list[Event], a: int, b: int, length: int) -> bool:
    """Blocks starting at events ``a`` and ``b`` have the same boundaries, levels and FLOPs."""
    if a + length > b:
        return False
    for i in range(length):
        x, y = events[a + i], events[b + i]
        if x.kind != y.kind or x.level - events[a].level != y.level - events[b].level:
            return False
        if abs((x.flops - events[a].flops) - (y.flops - events[b].flops)) > 1e-6 * (1 + abs(x.flops)):
            return False
    return True


def _expand_one(events: list[Event], modules: dict[str, ModuleCompute], stack: str, count: int
                ) -> list[Event] | None:
    def name(i: int) -> str:
        return f"{stack}.{i}" if stack else str(i)
    b0, b1, b2 = name(0), name(1), name(2)
    f1, f2 = _index_of(events, "pre_fw", b1), _index_of(events, "pre_fw", b2)
    r1, r0 = _index_of(events, "pre_bw", b1), _index_of(events, "pre_bw", b0)
    f3 = _index_of(events, "post_fw", b2)
    if None in (f1, f2, r1, r0, f3):
        return None
    fw_seg, bw_seg = events[f1:f2], events[r1:r0]
    d_level_fw, d_flops_fw = events[f2].level - events[f1].level, events[f2].flops - events[f1].flops
    if not _same_block(events, f1, f2, f3 - f2 + 1):
        return None
    d_level_bw, d_flops_bw = events[r0].level - events[r1].level, events[r0].flops - events[r1].flops
    extra = count - KEEP

    def renaming(seg: list[Event]) -> list[tuple[int, str]]:
        """Per event of ``seg``, where its module sits: (1, the rest of its name) under block
        1, (2, the rest) under block 2, else (0, its name). ``shifted`` renames thousands of
        copies of a segment (a deep stack): the names are split once, not per copy."""
        out = []
        for e in seg:
            m = e.module
            if m == b1 or m.startswith(b1 + "."):
                out.append((1, m[len(b1):]))
            elif m == b2 or m.startswith(b2 + "."):
                out.append((2, m[len(b2):]))
            else:
                out.append((0, m))
        return out

    def shifted(seg: list[Event], split: list[tuple[int, str]], dl: int, df: float, dst: int
                ) -> list[Event]:
        # A backward segment also holds the previous block's post-backward (it fires when this
        # block's output gradient is ready), so block 2's name maps to the block after ``dst``.
        # (dst >= 2: a name under block 1 never maps to block 1 itself.)
        heads = ("", name(dst), name(dst + 1))
        return [Event(kind=e.kind, module=heads[under] + rest if under else rest,
                      level=e.level + dl, peak=e.peak + dl, flops=e.flops + df, ops=e.ops)
                for e, (under, rest) in zip(seg, split)]

    fw_split, bw_split = renaming(fw_seg), renaming(bw_seg)
    out = events[:f2]
    for j in range(extra):
        out += shifted(fw_seg, fw_split, (j + 1) * d_level_fw, (j + 1) * d_flops_fw, 2 + j)
    lvl, fl = extra * d_level_fw, extra * d_flops_fw
    last = name(count - 1)
    for e in events[f2:r1]:
        out.append(Event(kind=e.kind, module=_rename(e.module, b2, last), level=e.level + lvl,
                         peak=e.peak + lvl, flops=e.flops + fl, ops=e.ops))
    # backward: block 2 (now last) already emitted; repeat block 1's backward for count-2 .. 2
    for j in range(extra):
        out += shifted(bw_seg, bw_split, lvl + j * d_level_bw, fl + j * d_flops_bw,
                       count - 2 - j)
    lvl2, fl2 = lvl + extra * d_level_bw, fl + extra * d_flops_bw
    for e in events[r1:]:
        out.append(Event(kind=e.kind, module=e.module, level=e.level + lvl2, peak=e.peak + lvl2,
                         flops=e.flops + fl2, ops=e.ops))
    # per-module figures: copies of block 1 for the missing blocks, block 2 becomes the last
    for fqn in [f for f in list(modules) if f == b2 or f.startswith(b2 + ".")]:
        modules[_rename(fqn, b2, last)] = modules.pop(fqn)
    for fqn in [f for f in list(modules) if f == b1 or f.startswith(b1 + ".")]:
        for j in range(extra):
            modules[_rename(fqn, b1, name(2 + j))] = copy.copy(modules[fqn])
    return out


def expand_pass(timeline: Timeline, modules: dict[str, ModuleCompute], input_bytes: int,
                cut: DepthCut) -> tuple[Timeline, dict[str, ModuleCompute], int] | None:
    """The full-depth timeline and module figures from a reduced pass, or None if blocks differ."""
    events = timeline.events
    released = dict(timeline.autocast_released)
    for stack, count in cut.stacks:
        expanded = _expand_one(events, modules, stack, count)
        if expanded is None:
            return None
        events = expanded
        released = _expand_released(released, stack, count)
    fill_flops(events, modules)
    return (Timeline(events=events, checkpointed=timeline.checkpointed,
                     final_level=timeline.final_level, seconds=timeline.seconds,
                     autocast_released=released),
            modules, input_bytes)


def _expand_released(released: dict[str, int], stack: str, count: int) -> dict[str, int]:
    """``Timeline.autocast_released`` at full depth: block 2 becomes the last block and block 1
    stands for each missing one, as the events are expanded."""
    def name(i: int) -> str:
        return f"{stack}.{i}" if stack else str(i)
    b1, b2, last = name(1), name(2), name(count - 1)
    out: dict[str, int] = {}
    for fqn, nbytes in released.items():
        out[_rename(fqn, b2, last)] = out.get(_rename(fqn, b2, last), 0) + nbytes
        if fqn == b1 or fqn.startswith(b1 + "."):
            for j in range(count - KEEP):
                out[_rename(fqn, b1, name(2 + j))] = nbytes
    return out
