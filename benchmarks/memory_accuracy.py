"""Predicted peak vs FSDPMemTracker for planned Llama shapes; prints one row per case.

    python benchmarks/memory_accuracy.py          # quick: reduced-depth Llama shapes
    python benchmarks/memory_accuracy.py --full   # the bundled examples at real shapes (~15 min)
    python benchmarks/memory_accuracy.py --modes [--full]  # selective and mixed AC modes
Each case is planned with the library API (``make_plan``), then measured on the fake process group at the plan's
world size through the generated ``apply_fully_shard`` (about 5-30 s per case on 2 cores).
"""

from __future__ import annotations

import os
import sys

from fsdp_plan.api import PlanRequest, make_plan
from fsdp_plan.common.errors import NoFeasiblePlan
from fsdp_plan.common.sizes import parse_bytes
from fsdp_plan.measure.memory import measure_peak
from fsdp_plan.model.source import ModelSource, parse_model_args
from fsdp_plan.plan.emit import load_policy_module

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA = os.path.join(ROOT, "examples", "llama.py")
GPT2 = os.path.join(ROOT, "examples", "gpt2.py")
VIT = os.path.join(ROOT, "examples", "vit.py")
HSDP = {"gpus_per_node": 8, "strategy": "hybrid"}
# (model file, --model-arg values, batch, seq, budget, world size, extra flags)
QUICK = [
    (LLAMA, ["size=70b", "n_layers=4"], "1", "4096", "40GB", "64", {}),
    (LLAMA, ["size=70b", "n_layers=6"], "1", "4096", "20GB", "64", {}),
    (LLAMA, ["size=8b", "n_layers=4"], "2", "2048", "24GB", "8", {}),
    (LLAMA, ["size=8b", "n_layers=4"], "1", "4096", "30GB", "16", HSDP),
]
# The bundled examples at their real shapes: three budgets, world sizes 8 and 64, and HSDP 2x8.
FULL = [
    (model, margs, batch, seq, mem, world, extra)
    for model, margs, batch, seq in ((LLAMA, ["size=8b"], "1", "4096"),
                                     (GPT2, ["size=xl"], "16", "1024"),
                                     (VIT, ["size=huge"], "128", "1"))
    for mem in ("24GB", "40GB", "80GB")
    for world, extra in (("8", {}), ("64", {}), ("16", HSDP))
]


# Per-block checkpointing modes (issue 10): each case planned with room to spare, then its
# blocks given the modes named here and predicted as written (``predict``), then measured.
# (model file, --model-arg values, batch, seq, world size, modes)
MODES = [
    (LLAMA, ["size=8b"], "2", "8192", "8", "selective"),
    (LLAMA, ["size=8b"], "2", "8192", "8", "mixed"),
    (GPT2, ["size=xl"], "16", "1024", "8", "selective"),
    (GPT2, ["size=xl"], "16", "1024", "8", "mixed"),
]
MODES_QUICK = [(LLAMA, ["size=8b", "n_layers=4"], "2", "2048", "8", "selective"),
               (LLAMA, ["size=8b", "n_layers=4"], "2", "2048", "8", "mixed")]
# Grouped units (issue 10.2): blocks in fully_shard groups of 4, alone or with mixed modes.
BERT_LARGE = os.path.join(ROOT, "examples", "hf", "bert_large.json")
MODES += [(VIT, ["size=huge"], "32", "1", "8", "grouped"),
          (VIT, ["size=huge"], "32", "1", "8", "grouped+mixed"),
          (BERT_LARGE, [], "8", "512", "8", "grouped"),
          (BERT_LARGE, [], "1", "512", "8", "grouped+mixed")]
MODES_QUICK += [(VIT, ["size=base"], "8", "1", "8", "grouped+mixed")]


def grouped_units(units: list[dict], blocks: list[str], size: int = 4) -> list[dict]:
    """The plan's one-block units merged into units of ``size`` consecutive blocks."""
    out: list[dict] = []
    pending: list[str] = []
    for unit in units + [{"modules": [None]}]:
        mods = unit["modules"]
        if len(mods) == 1 and mods[0] in blocks and not unit.get("mixed_precision"):
            pending.append(mods[0])
            if len(pending) < size:
                continue
        if pending:
            out.append({"modules": pending, "reshard_after_forward": True})
            pending = []
        if mods[0] is not None and mods[0] not in blocks:
            out.append(unit)
    return out


def modes_for(blocks: list[str], kind: str) -> dict[str, str]:
    """``selective``: every block; ``mixed``: the first quarter full, the next half selective,
    the last quarter not checkpointed."""
    if kind == "selective":
        return {b: "selective" for b in blocks}
    if kind == "grouped":
        return {}
    n = len(blocks)
    return {**{b: "full" for b in blocks[: n // 4]},
            **{b: "selective" for b in blocks[n // 4: 3 * n // 4]}}


def run_modes(cases: list[tuple]) -> None:
    """Predicted vs FSDPMemTracker for plans with selective and mixed checkpointing modes."""
    from fsdp_plan.api import predict
    from fsdp_plan.facts.checkpointing import DEFAULT_SELECTIVE_OPS
    from fsdp_plan.plan.document import Plan
    from fsdp_plan.plan.emit import render_policy_module

    for model, margs, batch, seq, world, kind in cases:
        hf = {"kind": "hf-config", "entry": "from_config"} if model.endswith(".json") else {}
        source = ModelSource(source=model, args=parse_model_args(margs), batch_size=int(batch),
                             seq_len=int(seq), **hf)
        result = make_plan(PlanRequest(source=source, budget_bytes=10**15, world_size=int(world),
                                       strategy="full"))
        doc = result.plan.to_dict()
        doc.update(fsdp_plan_version=2, selective_ops=list(DEFAULT_SELECTIVE_OPS),
                   activation_checkpointing=modes_for(result.facts.graph.blocks,
                                                      kind.removeprefix("grouped+")))
        if kind.startswith("grouped"):
            doc.update(units=grouped_units(doc["units"], result.facts.graph.blocks),
                       forward_prefetch={}, backward_prefetch={})
        plan = Plan.from_dict(doc)
        pred = predict(plan, result.facts).predicted["peak_bytes"]
        measured = measure_peak(result.loaded, plan,
                                load_policy_module(render_policy_module(plan))).peak_bytes
        err = (pred - measured) / measured
        print(f"{os.path.basename(model)} {' '.join(margs):>24} {batch + 'x' + seq:>8} "
              f"{world:>5} {kind:>9} {pred / 1e9:13.2f} {measured / 1e9:12.2f} {err:+7.1%} "
              f"{len(plan.units):>5}", flush=True)


if __name__ == "__main__":
    if "--modes" in sys.argv:  # checkpointing modes only (the --full cases take ~1 min each)
        print(f"{'model':>24} {'b x s':>8} {'world':>5} {'AC modes':>9} {'predicted GB':>13} "
              f"{'measured GB':>12} {'error':>7} {'units':>5}")
        run_modes(MODES if "--full" in sys.argv else MODES_QUICK)
        sys.exit(0)
    print(f"{'model':>24} {'b x s':>8} {'world':>5} {'budget':>7} {'predicted GB':>13} "
          f"{'measured GB':>12} {'error':>7} {'AC':>3}")
    cases = FULL if "--full" in sys.argv else QUICK
    for model, margs, batch, seq, mem, world, extra in cases:
        source = ModelSource(source=model, args=parse_model_args(margs), batch_size=int(batch),
                             seq_len=int(seq))
        try:
            result = make_plan(PlanRequest(source=source, budget_bytes=parse_bytes(mem),
                                           world_size=int(world), **extra))
        except NoFeasiblePlan:
            print(f"{os.path.basename(model)} {' '.join(margs):>24} {batch + 'x' + seq:>8} "
                  f"{world:>5} {mem:>7} (no plan fits)")
            continue
        plan = result.plan
        measured = measure_peak(result.loaded, plan, load_policy_module(result.policy_source()))
        pred = plan.predicted["peak_bytes"]
        err = (pred - measured.peak_bytes) / measured.peak_bytes
        print(f"{os.path.basename(model)} {' '.join(margs):>24} {batch + 'x' + seq:>8} "
              f"{world:>5} {mem:>7} {pred / 1e9:13.2f} {measured.peak_bytes / 1e9:12.2f} "
              f"{err:+7.1%} {len(plan.activation_checkpointing):>3}")
