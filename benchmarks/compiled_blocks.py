"""Compiled blocks (issue 22): predicted vs measured peak of compiled plans, and eager beside.

For each case: plan eager and with ``--compile`` (strategy full), then measure the compiled plan
with FSDPMemTracker on the fake process group at the real world size, the compiled graphs
running (measure/memory.py [Note: measuring compiled blocks]). Prints one row per case.

    PYTHONPATH=. python3 benchmarks/compiled_blocks.py [tiny|8b|gpt2xl ...]
"""

from __future__ import annotations

import sys
import time

from fsdp_plan.api import make_plan
from fsdp_plan.measure import runtime
from fsdp_plan.measure.memory import measure_peak
from fsdp_plan.model.source import ModelSource
from fsdp_plan.search.request import PlanRequest

CASES = {
    "tiny": (ModelSource(source="examples/llama.py", args={"size": "tiny"}, batch_size=2,
                         seq_len=256), 2, 2 * 10**9),
    "8b": (ModelSource(source="examples/llama.py", args={"size": "8b"}, batch_size=1,
                       seq_len=4096), 8, 200 * 10**9),
    "gpt2xl": (ModelSource(source="examples/gpt2.py", args={"size": "xl"}, batch_size=4,
                           seq_len=1024), 8, 200 * 10**9),
}


def run(name: str) -> None:
    source, world, budget = CASES[name]
    rows = {}
    for compile_blocks in (False, True):
        started = time.perf_counter()
        result = make_plan(PlanRequest(source=source, budget_bytes=budget, world_size=world,
                                       strategy="full", compile_blocks=compile_blocks))
        rows[compile_blocks] = (result, time.perf_counter() - started)
    comp, planning_s = rows[True]
    measured = measure_peak(comp.loaded, comp.plan,
                            runtime.load_policy(runtime.policy_source(comp.plan)))
    eager = rows[False][0].plan.predicted["peak_bytes"]
    predicted = comp.plan.predicted["peak_bytes"]
    print(f"{name}: world {world}, AC {comp.plan.activation_checkpointing or 'none'}; eager "
          f"predicted {eager / 2**30:.2f} GiB; compiled predicted {predicted / 2**30:.2f} GiB, "
          f"measured {measured.peak_bytes / 2**30:.2f} GiB, off by "
          f"{(predicted - measured.peak_bytes) / measured.peak_bytes:+.1%}; planning "
          f"{planning_s:.1f} s, measuring {measured.seconds:.1f} s", flush=True)


if __name__ == "__main__":
    for case in sys.argv[1:] or ["tiny", "8b", "gpt2xl"]:
        run(case)
