"""Planning time (analysis + search) and peak RSS of large shapes and of many small modules.

    python benchmarks/planning_speed.py            # every case, each in a fresh process
    python benchmarks/planning_speed.py --quick    # 70b eager and --compile, 10,000 modules
    python benchmarks/planning_speed.py --profile  # README's first command, stage by stage,
                                                   # and the search's hot spots (cProfile)
    python benchmarks/planning_speed.py --targets  # issue 29's figures: README's first command
                                                   # traced and from cached facts, make_plan
                                                   # 70b and 405b, candidates per second

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


def user_env(**extra: str) -> dict[str, str]:
    """The environment a user's command runs in: this one, with ``extra``, and with Python
    writing and reading its bytecode (``.pyc``) as it does by default. Sandboxes often set
    ``PYTHONDONTWRITEBYTECODE=1``, and every fresh process then compiles every module of the
    package again: 0.2 s of each command here that no user pays."""
    env = {**os.environ, **extra}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def warm_bytecode() -> None:
    """Run README's first command once (facts in a throwaway cache) so that every module it
    imports has its bytecode written before anything is timed."""
    import tempfile
    with tempfile.TemporaryDirectory() as cache:
        subprocess.run([sys.executable, "-m", "fsdp_plan.cli.main", *README_ARGV],
                       capture_output=True, cwd=ROOT, check=False,
                       env=user_env(FSDP_PLAN_CACHE_DIR=cache, PYTHONPATH=ROOT))


README_ARGV = ["examples/llama.py", "--model-arg", "size=70b", "--mem", "80GB",
               "--world-size", "64"]
"""README's first command (table report, so its "more memory" frontier too)."""

_STAGES = """
import builtins, json, sys, time
t0, c0 = time.perf_counter(), time.process_time()
spent, cpu = {}, {}
_import = builtins.__import__
def timed_import(name, *a, **k):  # the first import of torch, whoever asks for it
    if name.partition(".")[0] != "torch" or "torch" in sys.modules:
        return _import(name, *a, **k)
    s, c = time.perf_counter(), time.process_time()
    try:
        return _import(name, *a, **k)
    finally:
        spent["torch import"] = time.perf_counter() - s
        cpu["torch import"] = time.process_time() - c
builtins.__import__ = timed_import
import fsdp_plan.cli.main as main_module
import fsdp_plan.cli.plan as plan_verb
import fsdp_plan.facts.analyze as analyze
spent["start-up (imports, no torch)"] = time.perf_counter() - t0
cpu["start-up (imports, no torch)"] = time.process_time() - c0
def timed(owner, name, label):
    inner = getattr(owner, name)
    def wrapper(*a, **k):
        s, c = time.perf_counter(), time.process_time()
        try:
            return inner(*a, **k)
        finally:
            spent[label] = spent.get(label, 0.0) + time.perf_counter() - s
            cpu[label] = cpu.get(label, 0.0) + time.process_time() - c
    setattr(owner, name, wrapper)
_stages = analyze._torch_stages
def torch_stages():  # time the model build once model.load is imported (torch with it)
    s, c = time.perf_counter(), time.process_time()
    a, g, load = _stages()  # the first call imports the tracing stack (Dynamo comes with it)
    label = "tracing stack imports"
    spent[label] = spent.get(label, 0.0) + time.perf_counter() - s
    cpu[label] = cpu.get(label, 0.0) + time.process_time() - c
    if not getattr(load.load_model, "timed", False):
        timed(load, "load_model", "model build (meta)")
        load.load_model.timed = True
    return a, g, load
analyze._torch_stages = torch_stages
timed(analyze, "analyze_loaded", "tracing and analysis")
timed(plan_verb, "make_plan", "make_plan")
timed(plan_verb, "plan_frontier", "frontier (more memory)")
timed(plan_verb, "format_report", "report")
from fsdp_plan.cli.process import mark_process_ends_after_command
mark_process_ends_after_command()  # as the console script (fsdp_plan.cli.main.entry) does
code = main_module.main(sys.argv[1:])
for d in (spent, cpu):
    d["make_plan"] = d.get("make_plan", 0.0) - d.get("tracing and analysis", 0.0) - d.get(
        "model build (meta)", 0.0) - d.get("tracing stack imports", 0.0)
    d["search"] = d.pop("make_plan")
spent["in process"] = time.perf_counter() - t0
cpu["in process"] = time.process_time() - c0
sys.stderr.write("STAGES " + json.dumps({"wall": spent, "cpu": cpu,
                                         "process_cpu": time.process_time()}) + "\\n")
from fsdp_plan.cli.process import end_process
end_process(code)  # as the console script ends (fsdp_plan.cli.main.entry)
"""

_HOT = """
import cProfile, pstats, sys
from fsdp_plan.api import PlanRequest, make_plan
from fsdp_plan.model.source import ModelSource
import fsdp_plan.api as api
profiler = cProfile.Profile()
inner = api.run_search
def profiled(*a, **k):
    profiler.enable()
    try:
        return inner(*a, **k)
    finally:
        profiler.disable()
api.run_search = profiled
make_plan(PlanRequest(source=ModelSource(source="examples/llama.py", args={"size": "70b"},
                                         seq_len=4096), budget_bytes=80 * 10**9, world_size=64))
pstats.Stats(profiler).sort_stats("tottime").print_stats(18)
"""


def profile_stages(cache: str, label: str) -> None:
    """README's first command in a fresh process, with the time of each stage (facts cache
    in ``cache``)."""
    env = user_env(FSDP_PLAN_CACHE_DIR=cache)
    env.pop("FSDP_PLAN_NO_CACHE", None)
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _STAGES, *README_ARGV], capture_output=True,
                         text=True, cwd=ROOT, check=False, env=env)
    wall = time.perf_counter() - started
    line = next((x for x in out.stderr.splitlines() if x.startswith("STAGES ")), None)
    if out.returncode != 0 or line is None:
        raise SystemExit(out.stderr[-2000:])
    data = json.loads(line[len("STAGES "):])
    spent, cpu = data["wall"], data["cpu"]
    inside, inside_cpu = spent.pop("in process"), cpu.pop("in process")
    order = ["start-up (imports, no torch)", "torch import", "tracing stack imports",
             "model build (meta)",
             "tracing and analysis", "search", "frontier (more memory)", "report"]
    # what make_plan and the verb do besides (reading cached facts is in search; the frontier
    # and freeing what the search built are here)
    spent["other (request, writing, rest)"] = inside - sum(spent.get(k, 0.0) for k in order)
    cpu["other (request, writing, rest)"] = inside_cpu - sum(cpu.get(k, 0.0) for k in order)
    spent["python start-up and exit"] = wall - inside
    print(f"README's first command ({label}): fsdp-plan {' '.join(README_ARGV)}")
    print(f"{'stage':>32} {'wall s':>7} {'share':>6} {'cpu s':>6}")
    for stage in [*order, "other (request, writing, rest)", "python start-up and exit"]:
        seconds = spent.get(stage, 0.0)
        c = f"{cpu[stage]:6.2f}" if stage in cpu else f"{'':>6}"
        print(f"{stage:>32} {seconds:7.2f} {seconds / wall:6.1%} {c}")
    print(f"{'wall (whole process)':>32} {wall:7.2f} {'':>6} {data['process_cpu']:6.2f}")


def profile_search() -> None:
    """cProfile of make_plan's search (not the analysis), top functions by own time."""
    out = subprocess.run([sys.executable, "-c", _HOT], capture_output=True, text=True,
                         cwd=ROOT, check=False, env=user_env())
    if out.returncode != 0:
        raise SystemExit(out.stderr[-2000:])
    text = out.stdout
    print(text[text.find("   ncalls"):].rstrip() if "   ncalls" in text else text)


def readme_command(cache: str, repeats: int) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of README's first command as a user runs it (a fresh process, the
    table report with its "more memory" line), with the facts cache at ``cache``."""
    import resource
    env = user_env(FSDP_PLAN_CACHE_DIR=cache, PYTHONPATH=ROOT)
    env.pop("FSDP_PLAN_NO_CACHE", None)
    out = []
    for _ in range(repeats):
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        started = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "fsdp_plan.cli.main", *README_ARGV],
                              capture_output=True, text=True, cwd=ROOT, env=env, check=False)
        wall = time.perf_counter() - started
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        if done.returncode != 0:
            raise SystemExit(done.stderr[-2000:])
        out.append((wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime))
    return out


def _median(values: list[float]) -> float:
    values = sorted(values)
    return values[len(values) // 2]


def targets(repeats: int = 3) -> None:
    """Issue 29's acceptance figures, each the median of ``repeats`` fresh processes (wall
    and CPU seconds: on a shared machine compare CPU)."""
    import tempfile
    print(f"{'figure':>44} {'wall s':>7} {'cpu s':>6} {'target':>8}")
    with tempfile.TemporaryDirectory() as cache:
        cold = []
        for _ in range(repeats):  # each run traced: an empty cache folder every time
            with tempfile.TemporaryDirectory() as empty:
                cold += readme_command(empty, 1)
        readme_command(cache, 1)  # fill the cache
        warm = readme_command(cache, repeats)
    for label, runs, target in (("README's first command, traced", cold, "4 s"),
                                ("README's first command, cached facts", warm, "2 s")):
        print(f"{label:>44} {_median([w for w, _ in runs]):7.2f} "
              f"{_median([c for _, c in runs]):6.2f} {target:>8}")
    for label, target in (("llama 70b", "2.5 s"), ("llama 405b", "3.5 s")):
        _, model, args, budget, world, seq, request = next(c for c in CASES if c[0] == label)
        runs = [one(model, args, budget, world, seq, request) for _ in range(repeats)]
        print(f"{'make_plan ' + label:>44} {_median([r['wall_s'] for r in runs]):7.2f} "
              f"{_median([r['cpu_s'] for r in runs]):6.2f} {target:>8}")
        if label == "llama 70b":
            rate = _median([r["candidates"] / max(r["search_s"], 1e-9) for r in runs])
            print(f"{'candidates per second, 70b search (wall)':>44} {rate:7.0f} {'':>6} "
                  f"{'2,000':>8}")


def one(model: str, args: dict, budget: int, world: int, seq: int, request: dict) -> dict:
    spec = json.dumps({"model": model, "args": args, "budget": budget, "world": world,
                       "seq": seq, "request": request})
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", _CHILD, spec], capture_output=True, text=True,
                         cwd=ROOT, check=False, env=user_env())
    if out.returncode != 0:
        raise SystemExit(out.stderr[-2000:])
    data = json.loads(out.stdout.strip().splitlines()[-1])
    data["process_s"] = time.perf_counter() - started
    return data


if __name__ == "__main__":
    warm_bytecode()
    if "--profile" in sys.argv:
        print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load: "
              f"{open('/proc/loadavg').read().split()[0]}")
        import tempfile
        with tempfile.TemporaryDirectory() as cache:
            profile_stages(cache, "traced")
            print()
            profile_stages(cache, "facts from the cache")
        print("\nthe search's hot spots (make_plan's search, cProfile, by own time):")
        profile_search()
        raise SystemExit(0)
    if "--targets" in sys.argv:
        print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load: "
              f"{open('/proc/loadavg').read().split()[0]}")
        targets()
        print(f"# done, load: {open('/proc/loadavg').read().split()[0]}")
        raise SystemExit(0)
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
