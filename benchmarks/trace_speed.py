"""How long ``fsdp-plan trace`` takes on a large trace, and its peak memory (issue 26).

    python benchmarks/trace_speed.py [--mb 200] [--source tests/data/hta/sampled_rank-0.json.gz]
                                     [--keep PATH]

Synthesises a trace of about ``--mb`` MB of JSON by replicating the steps of a real one (its
events copied step after step, times shifted by the step span, correlation ids by the largest
one, ``ProfilerStep#N`` renumbered), written as Kineto writes (an event per line), then
analyses it in a fresh process (``fsdp_plan.measure.trace_ranks.analyze_traces``, the verb's
whole analysis) and prints the seconds and the child's peak RSS. Target: a 200 MB trace in
under 30 s and 2 GiB. The CPU seconds are printed too: on a shared machine the wall time is
mostly other processes' (the analysis is single-threaded).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHILD = """
import resource, sys, time
from fsdp_plan.measure.trace_ranks import analyze_traces
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
t, c = time.perf_counter(), cpu()
a = analyze_traces([sys.argv[1]])
r = a.ranks[0]
print(f"{time.perf_counter() - t:.2f} {cpu() - c:.2f} {len(r.steps)} "
      f"{r.step_s_p50:.6f} "
      f"{len(r.timeline.activities)}")
"""


def _load(path: str) -> dict:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def synthesise(source: str, target_mb: float, out: str) -> int:
    """Write a trace of about ``target_mb`` MB made of ``source``'s steps; returns its bytes."""
    trace = _load(source)
    events = trace["traceEvents"]
    timed = [e for e in events if e.get("ph") != "M" and "ts" in e]
    meta = [e for e in events if e.get("ph") == "M"]
    start = min(float(e["ts"]) for e in timed)
    span = max(float(e["ts"]) + float(e.get("dur", 0)) for e in timed) - start
    marks = [e for e in timed if re.fullmatch(r"ProfilerStep#\d+", str(e.get("name")))]
    per_copy = len(marks)
    corr = max((e.get("args", {}).get("correlation", 0) for e in timed
                if isinstance(e.get("args", {}).get("correlation", 0), int)), default=0) + 1
    lines = [json.dumps(e) for e in meta]
    one = sum(len(json.dumps(e)) + 2 for e in timed)
    copies = max(1, int(target_mb * 1e6 / one))
    header = {k: v for k, v in trace.items() if k != "traceEvents"}
    with open(out, "w") as f:
        f.write('{\n  "schemaVersion": 1,\n  "traceEvents": [\n')
        f.write(",\n".join(lines))
        for c in range(copies):
            for e in timed:
                e2 = dict(e)
                e2["ts"] = float(e["ts"]) + c * (span + 1)
                args = e.get("args")
                if isinstance(args, dict):
                    args = dict(args)
                    if isinstance(args.get("correlation"), int):
                        args["correlation"] += c * corr
                    e2["args"] = args
                if e2.get("id") is not None and e.get("cat") == "ac2g":
                    e2["id"] = e["id"] + c * corr
                m = re.fullmatch(r"ProfilerStep#(\d+)", str(e.get("name")))
                if m:
                    e2["name"] = f"ProfilerStep#{c * per_copy + int(m.group(1))}"
                f.write(",\n" + json.dumps(e2))
        f.write("\n  ],\n")
        f.write(",\n".join(f'  "{k}": {json.dumps(v)}' for k, v in header.items()
                           if k != "schemaVersion"))
        f.write("\n}\n")
    return os.path.getsize(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=200.0)
    parser.add_argument("--source",
                        default=os.path.join(ROOT, "tests/data/hta/sampled_rank-0.json.gz"))
    parser.add_argument("--keep", default=None, help="write the synthetic trace here and keep it")
    args = parser.parse_args()
    out = args.keep or tempfile.mktemp(suffix=".json")
    try:
        t = time.perf_counter()
        size = synthesise(args.source, args.mb, out)
        print(f"synthesised {size / 1e6:.0f} MB from {os.path.basename(args.source)} in "
              f"{time.perf_counter() - t:.0f} s")
        env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
        t = time.perf_counter()
        done = subprocess.run([sys.executable, "-c", CHILD, out], env=env, check=True,
                              capture_output=True, text=True)
        wall = time.perf_counter() - t
        seconds, cpu, steps, p50, acts = done.stdout.split()
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        print(f"analysed {size / 1e6:.0f} MB: {seconds} s in the analysis, {cpu} s of it on "
              f"the CPU ({wall:.1f} s with the interpreter), peak RSS {peak / 2**30:.2f} GiB; "
              f"{steps} stable steps, {acts} activities, step p50 {float(p50) * 1e3:.3f} ms")
        print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    finally:
        if not args.keep and os.path.exists(out):
            os.unlink(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
