"""Python's cycle collector paused around work that allocates much and leaves few cycles.

[Note: pausing the cycle collector]
The search allocates millions of short-lived tuples and dataclasses, and Dynamo and
AOTAutograd allocate heavily while ``--compile`` traces blocks. Reference counting frees
nearly all of it at once, but each allocation counts towards the collector's next pass, and
every full pass walks every live object: the model's graph and analysis (tens of thousands of
objects for 10,000 modules) and everything torch has imported (about half a million once blocks
are traced). Paused, a 10,006-module search took 18.5 s instead of 25.3 s, and planning the
70B shape with ``--compile`` spent 1.1 s instead of 2.6 s in the collector. The few cycles the
work leaves are all young (the collector was off while it ran), so one collection of the young
generations at the end frees them without walking torch's objects.

The plan command pauses the collector for its whole run with no collection at the end
(``collect_after=False``): one short process that ends when the plan is written, whose cycles
(torch's modules and the fake step's graphs) would only be walked, never worth freeing. Off,
README's first command took 8.5 s of CPU instead of 9.6 when it traced the 70B shape and
0.25 s less from cached facts, its peak RSS 723 MB instead of 706 (issue 29). In process
(tests, the library) the collector is on again afterwards, as it was.

``analyze_model`` pauses it too, from importing torch to the last pass: importing torch's
compiler stack (which the first fake op imports) and the fake passes allocate about a million
objects that live on, and with the collector on each full pass walked all of them again. The
library's ``make_plan`` of the 70B shape took 5.2 s instead of 6.0, peak RSS unchanged
(448 MB), the same as the plan command's paused run (issue 29, stop 42). But torch's modules,
imported inside that pause, were young too, and the one collection at its end walked them
all: 0.31 s of that ``make_plan``. So what is alive once torch is imported is frozen for the
passes (``alive_now_frozen``) and handed back as the oldest generation before that collection,
which then walks only what the passes made (stop 43). What torch's import left unreachable is
freed by the next full collection instead (in the library; the plan command never collects).

The search leaves no cycles at all (its young collection freed 0 of some 127,000 objects on
the 70B shape, 31 ms of each 340 ms search in the library, 0.22 s of ``--compile``'s plan), so
``run_search`` and the frontier pause it with ``promote_after``: what survives (the ranked
candidates, the evaluator's caches) is handed to the oldest generation in O(1)
(``gc.freeze`` then ``gc.unfreeze``) and the next full collection sees it, as it would have
once it outlived two young ones. Not where the process froze objects of its own (a
server forking workers keeps them out of the collector): unfreezing would release those,
so there the young generations are collected as before.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def cycle_collector_paused(*, collect_after: bool = True, resume: bool = True,
                           promote_after: bool = False) -> Iterator[None]:
    """Pause the cycle collector within the block, then (``collect_after``) collect the young
    generations once ([Note: pausing the cycle collector]); a collector already off stays off.
    ``collect_after=False``: for one command's whole run; ``resume=False``: the process ends
    right after it, so the collector stays off (on again, it would walk everything the run
    made before the process ends); ``promote_after``: work that leaves no cycles (the
    search) hands what it made to the oldest generation instead of collecting it."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled and resume:
            promoted = promote_after and _young_promoted()
            gc.enable()
            if collect_after and not promoted:
                gc.collect(1)


def _young_promoted() -> bool:
    """Move every young object to the oldest generation without walking any (``gc.freeze``
    then ``gc.unfreeze``), unless the process froze objects itself (False then: unfreezing
    would hand those back too)."""
    if gc.get_freeze_count():
        return False
    gc.freeze()
    gc.unfreeze()
    return True


@contextlib.contextmanager
def alive_now_frozen() -> Iterator[None]:
    """Every object alive now kept out of the collector's generations within the block
    (``gc.freeze``), then handed back as its oldest generation (``gc.unfreeze``): a
    collection of the young generations at the block's end walks only what the block made
    ([Note: pausing the cycle collector])."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
