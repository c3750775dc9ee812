"""Compiled blocks (issue 22): predicted vs FSDPMemTracker peak per checkpointing mode.

Each case is planned with ``--compile`` and room to spare (strategy full), its blocks given
one checkpointing mode (none, selective, full: every block), predicted as written
(``predict``), then measured with FSDPMemTracker on the fake process group at the real world
size with the compiled graphs running (measure/memory.py [Note: measuring compiled blocks]).
The eager prediction of the same plan is printed beside it.

    PYTHONPATH=. python3 benchmarks/compiled_memory.py [tiny|8b|gpt2xl ...] [--modes none,full]
"""

from __future__ import annotations

import sys
import time

from fsdp_plan.api import make_plan, predict
from fsdp_plan.facts.checkpointing import DEFAULT_SELECTIVE_OPS
from fsdp_plan.measure.memory import measure_peak
from fsdp_plan.model.source import ModelSource
from fsdp_plan.plan.document import Plan
from fsdp_plan.plan.emit import load_policy_module, render_policy_module
from fsdp_plan.search.request import PlanRequest

CASES = {
    "tiny": (ModelSource(source="examples/llama.py", args={"size": "tiny"}, batch_size=2,
                         seq_len=256), 2),
    "tinygpt": (ModelSource(source="examples/gpt2.py", args={"size": "tiny"}, batch_size=2,
                            seq_len=256), 2),
    "8b": (ModelSource(source="examples/llama.py", args={"size": "8b"}, batch_size=1,
                       seq_len=4096), 8),
    "gpt2xl": (ModelSource(source="examples/gpt2.py", args={"size": "xl"}, batch_size=4,
                           seq_len=1024), 8),
}


def with_modes(plan: Plan, blocks: list[str], mode: str) -> Plan:
    """``plan`` with every block in checkpointing ``mode`` (none, selective, full)."""
    doc = plan.to_dict()
    doc["fsdp_plan_version"] = 2
    if mode == "none":
        doc["activation_checkpointing"] = {}
    else:
        doc["activation_checkpointing"] = {b: mode for b in blocks}
    doc["selective_ops"] = list(DEFAULT_SELECTIVE_OPS) if mode == "selective" else []
    return Plan.from_dict(doc)


def run(name: str, modes: list[str]) -> None:
    source, world = CASES[name]
    planned = {}
    for compile_blocks in (False, True):
        started = time.perf_counter()
        result = make_plan(PlanRequest(source=source, budget_bytes=10**15, world_size=world,
                                       strategy="full", compile_blocks=compile_blocks))
        planned[compile_blocks] = (result, time.perf_counter() - started)
    eager, comp = planned[False][0], planned[True][0]
    blocks = comp.facts.graph.blocks
    for mode in modes:
        plan = with_modes(comp.plan, blocks, mode)
        eager_plan = with_modes(eager.plan, blocks, mode)
        pred = predict(plan, comp.facts).predicted
        eager_pred = predict(eager_plan, eager.facts).predicted
        measured = measure_peak(comp.loaded, plan, load_policy_module(render_policy_module(plan)))
        m = measured.peak_bytes
        print(f"{name:>7} world {world} AC {mode:>9}: eager predicted "
              f"{eager_pred['peak_bytes'] / 2**30:.4g} GiB, {eager_pred['step_time_s']:.3f} s; "
              f"compiled predicted {pred['peak_bytes'] / 2**30:.4g} GiB, "
              f"{pred['step_time_s']:.3f} s; measured {m / 2**30:.4g} GiB "
              f"({(pred['peak_bytes'] - m) / m:+.1%}); measuring {measured.seconds:.0f} s",
              flush=True)


if __name__ == "__main__":
    args = sys.argv[1:]
    modes = ["none", "selective", "full"]
    if "--modes" in args:
        i = args.index("--modes")
        modes = args[i + 1].split(",")
        del args[i:i + 2]
    for case in args or ["8b", "gpt2xl"]:
        run(case, modes)
