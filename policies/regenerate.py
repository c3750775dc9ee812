"""Regenerate the bundled examples' policies at typical budgets (one command, deterministic).

    python policies/regenerate.py          # rewrites policies/*.py and policies/*.yaml
    python policies/regenerate.py --check  # exit 1 if any file differs from what the planner writes now

Each entry is one ``fsdp_plan.api.PlanRequest``; ``command_line(name)`` gives the equivalent
``fsdp-plan`` command a user would type. The plans record their model relative to this folder
(``../examples/...``), so they work from any working folder.
"""

from __future__ import annotations

import filecmp
import os
import sys
import tempfile
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
GB = 10**9

# name -> (model file under examples/, --model-arg values, batch, seq, PlanRequest fields)
POLICIES: dict[str, tuple[str, dict[str, Any], int, int, dict[str, Any]]] = {
    "llama8b_h100x8": ("llama.py", {"size": "8b"}, 1, 4096,
                       {"budget_bytes": 80 * GB, "world_size": 8}),
    "llama70b_h100x64": ("llama.py", {"size": "70b"}, 1, 4096,
                         {"budget_bytes": 80 * GB, "world_size": 64}),
    "llama405b_h100x512": ("llama.py", {"size": "405b"}, 1, 4096,
                           {"budget_bytes": 80 * GB, "world_size": 512}),
    "gpt2xl_a100x8": ("gpt2.py", {"size": "xl"}, 8, 1024,
                      {"budget_bytes": 40 * GB, "world_size": 8, "gpu": "a100"}),
    "vit_huge_h100x16": ("vit.py", {"size": "huge"}, 64, 4096,
                         {"budget_bytes": 80 * GB, "world_size": 16, "gpus_per_node": 8}),
}


def command_line(name: str) -> str:
    """The ``fsdp-plan`` command that writes the same files as ``write_one(name, ...)``."""
    model, args, batch, seq, fields = POLICIES[name]
    flags = [f"examples/{model}", *(f"--model-arg {k}={v}" for k, v in args.items()),
             f"--mem {fields['budget_bytes'] // GB}GB", f"--world-size {fields['world_size']}",
             f"--batch-size {batch}", f"--seq-len {seq}"]
    if "gpu" in fields:
        flags.append(f"--gpu {fields['gpu']}")
    if "gpus_per_node" in fields:
        flags.append(f"--gpus-per-node {fields['gpus_per_node']}")
    return "fsdp-plan " + " ".join(flags) + f" -o policies/{name}.py --plan policies/{name}.yaml"


def write_one(name: str, folder: str) -> None:
    from fsdp_plan.api import PlanRequest, make_plan
    from fsdp_plan.cost.hardware import hardware_for
    from fsdp_plan.model.source import ModelSource
    model, args, batch, seq, fields = POLICIES[name]
    fields = dict(fields)
    hardware = hardware_for(fields.pop("gpu", "h100"))
    source = ModelSource(source=os.path.join(ROOT, "examples", model), args=args,
                         batch_size=batch, seq_len=seq)
    source = ModelSource(source=os.path.relpath(source.source), args=args, batch_size=batch,
                         seq_len=seq)
    result = make_plan(PlanRequest(source=source, hardware=hardware, **fields))
    result.relocate_source(HERE)
    result.write(policy=os.path.join(folder, f"{name}.py"),
                 plan=os.path.join(folder, f"{name}.yaml"))


def main() -> int:
    if "--check" in sys.argv:
        with tempfile.TemporaryDirectory() as tmp:
            for name in POLICIES:
                write_one(name, tmp)
            stale = [f for name in POLICIES for f in (f"{name}.py", f"{name}.yaml")
                     if not os.path.exists(os.path.join(HERE, f))
                     or not filecmp.cmp(os.path.join(tmp, f), os.path.join(HERE, f), shallow=False)]
        if stale:
            print("stale policies (run python policies/regenerate.py):", ", ".join(stale))
            return 1
        print("policies are current")
        return 0
    for name in POLICIES:
        write_one(name, HERE)
        print(f"wrote policies/{name}.py and .yaml  ({command_line(name)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
