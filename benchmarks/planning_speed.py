"""Planning time (analysis + search) and peak RSS of large shapes and of many small modules.

    python benchmarks/planning_speed.py            # every case, each in a fresh process
    python benchmarks/planning_speed.py --quick    # 70b eager and --compile, 10,000 modules

"Planning" is what ``make_plan`` does (analysis and search), as the report's "planned in" line
counts it: not Python's and torch's start-up (process s has them) nor the report's "more
memory" frontier (further searches at other budgets, made only for the table report and the
HTML page).

Each case runs ``fsdp_plan.api.make_plan`` in its own Python process (so RSS and the torch
import are per case) and prints wall time inside the process, CPU time, the number of
candidates the search evaluated and how many per second, and peak RSS. On a busy machine
compare CPU seconds, not wall seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA = os.path.join(ROOT, "examples", "llama.py")
MANY = os.path.join(ROOT, "benchmarks", "models", "many_modules.py")
# (label, model file, model args, memory budget bytes, world size, seq len, more PlanRequest
# fields)
CASES = [
    ("llama 8b", LLAMA, {"size": "8b"}, 80 * 10**9, 8, 4096, {}),
    ("llama 70b", LLAMA, {"size": "70b"}, 80 * 10**9, 64, 4096, {}),
    # --compile (issue 22): the partition of the block class traced in each checkpointing
    # mode, on top of the eager analysis
    ("70b --compile", LLAMA, {"size": "70b"}, 80 * 10**9, 64, 4096, {"compile_blocks": True}),
    ("llama 405b", LLAMA, {"size": "405b"}, 80 * 10**9, 512, 4096, {}),
    ("2,006 modules", MANY, {"n": 667}, 10**9, 8, 8, {}),
    ("10,006 modules", MANY, {"n": 3333}, 10**9, 8, 8, {}),
]
QUICK = ("llama 70b", "70b --compile", "10,006 modules")

_CHILD = """
import json, resource, sys, time
from fsdp_plan.api import PlanRequest, make_plan
from fsdp_plan.search.evaluator import Evaluator
from fsdp_plan.model.source import ModelSource
spec = json.loads(sys.argv[1])
count = [0]
evaluate = Evaluator.evaluate
def counting(self, layout, name):
    count[0] += 1
    return evaluate(self, layout, name)
Evaluator.evaluate = counting
started, cpu = time.perf_counter(), time.process_time()
result = make_plan(PlanRequest(source=ModelSource(source=spec["model"], args=spec["args"],
                                                  seq_len=spec["seq"]),
                               budget_bytes=spec["budget"], world_size=spec["world"],
                               **spec["request"]))
print(json.dumps({"wall_s": time.perf_counter() - started, "cpu_s": time.process_time() - cpu,
                  "search_s": result.search_seconds, "candidates": count[0],
                  "modules": len(result.facts.graph.modules),
                  "rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def one(model: str, args: dict, budget: int, world: int, seq: int, request: dict) -> dict:
    spec = json.dumps({"model": model, "args": args, "budget": budget, "world": world,
                       "seq": seq, "request": request})
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _CHILD, spec], capture_output=True, text=True,
                         cwd=ROOT, check=False)
    if out.returncode != 0:
        raise SystemExit(out.stderr[-2000:])
    data = json.loads(out.stdout.strip().splitlines()[-1])
    data["process_s"] = time.perf_counter() - started
    return data


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    print(f"{'case':>15} {'modules':>8} {'plan s':>7} {'cpu s':>6} {'process s':>9} "
          f"{'candidates':>10} {'cand/s':>7} {'RSS GiB':>8}")
    for label, model, args, budget, world, seq, request in CASES:
        if quick and label not in QUICK:
            continue
        r = one(model, args, budget, world, seq, request)
        print(f"{label:>15} {r['modules']:>8,} {r['wall_s']:7.1f} {r['cpu_s']:6.1f} "
              f"{r['process_s']:9.1f} {r['candidates']:>10} "
              f"{r['candidates'] / max(r['search_s'], 1e-9):7.0f} {r['rss_bytes'] / 2**30:8.2f}")
