"""[Note: pausing the cycle collector]: what ``cycle_collector_paused`` leaves behind."""

from __future__ import annotations

import gc

from fsdp_plan.common.collector import cycle_collector_paused


class _Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def _young_collections(work) -> tuple[list[int], object]:
    """The generations collected while ``work`` runs, and what it returned."""
    seen: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            seen.append(info["generation"])
    gc.callbacks.append(count)
    try:
        return seen, work()
    finally:
        gc.callbacks.remove(count)


def test_promoting_walks_nothing_and_empties_the_young_generations():
    """The search's pause (``promote_after``) collects nothing at its end: what it made is in
    the oldest generation, the young ones are empty, and the next full collection still finds
    a cycle it left."""
    def work():
        with cycle_collector_paused(promote_after=True):
            kept = [(i, [i]) for i in range(20_000)]
            _Node()  # garbage, in a cycle
        return kept
    assert gc.isenabled()
    seen, kept = _young_collections(work)
    assert seen == [] and gc.isenabled() and gc.get_freeze_count() == 0
    assert len(gc.get_objects(0)) < 1_000 and len(gc.get_objects(1)) < 1_000
    assert id(kept[0][1]) in {id(o) for o in gc.get_objects(2)}
    assert gc.collect() >= 1  # the cycle, freed by the next full collection


def test_objects_the_process_froze_stay_frozen():
    """A process that froze objects of its own (a server before forking workers) keeps them
    frozen: the pause collects the young generations as before instead of promoting."""
    frozen = [[i] for i in range(100)]
    gc.freeze()
    try:
        before = gc.get_freeze_count()

        def work():
            with cycle_collector_paused(promote_after=True):
                _Node()
        seen, _ = _young_collections(work)
        # still frozen: in no generation the collector walks (the count alone is no proof: a
        # frozen object that reference counting frees meanwhile lowers it)
        tracked = {id(o) for o in gc.get_objects()}
        assert before > 0 and gc.get_freeze_count() > 0
        assert not any(id(item) in tracked for item in frozen)
        assert seen == [1]  # the young generations, collected once
    finally:
        gc.unfreeze()
    assert frozen


def test_collecting_after_is_the_default():
    """Without ``promote_after`` the young generations are collected once at the end (the
    analysis' pause, whose passes leave cycles)."""
    def work():
        with cycle_collector_paused():
            _Node()
    seen, _ = _young_collections(work)
    assert seen == [1]
