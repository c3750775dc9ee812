"""Time analysis + search of the Llama 3 70b and 405b shapes; print wall time and peak RSS.

    python benchmarks/planning_speed.py            # 70b and 405b, batch 1, seq 4096, world 64
Also prints an 8b figure and a 70b run with half the layers, to show time against depth.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = [("8b", None, "80GB", 8), ("70b", 40, "80GB", 64), ("70b", None, "80GB", 64),
         ("405b", None, "80GB", 128)]


def one(size: str, layers: int | None, mem: str, world: int) -> tuple[float, float, int]:
    cmd = [sys.executable, "-c",
           "import sys,time,resource;from fsdp_plan.cli.main import main;t=time.perf_counter();"
           "c=main(sys.argv[1:]);print('T',time.perf_counter()-t,"
           "resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,c)",
           os.path.join(ROOT, "examples", "llama.py"), "--model-arg", f"size={size}",
           "--mem", mem, "--world-size", str(world), "--format", "json"]
    if layers:
        cmd[-2:-2] = ["--model-arg", f"n_layers={layers}"]
    start = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    wall = time.perf_counter() - start
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("T ")]
    if not line:
        raise SystemExit(out.stderr[-2000:])
    _, inner, rss_kb, code = line[-1].split()
    return wall, float(inner), int(rss_kb) * 1024 if code in ("0", "3") else -1


if __name__ == "__main__":
    print(f"{'shape':>14} {'world':>5} {'plan s':>8} {'process s':>10} {'peak RSS GiB':>13}")
    for size, layers, mem, world in CASES:
        wall, inner, rss = one(size, layers, mem, world)
        name = size + (f" ({layers} layers)" if layers else "")
        print(f"{name:>14} {world:>5} {inner:8.1f} {wall:10.1f} {rss / 2**30:13.2f}")
    del resource
