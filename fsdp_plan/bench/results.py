"""Benchmark results that last: one JSON file per run (written atomically, never overwritten),
the report printed from it, the check against the plan's prediction, and ``--compare``.

A result file holds what is needed to tell whether a later run regressed and why: the plan's
hash, the model, world size and mesh, torch version, device name, git commit, and all figures.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import subprocess
import time
from typing import Any

import torch
from tabulate import tabulate

from fsdp_plan.bench.overlap import report_lines as overlap_lines
from fsdp_plan.bench.result_check import (  # noqa: F401 - re-exported: results.read_result
    MAX_RESULT_BYTES,
    RESULT_VERSION,
    check_result,
    is_number,
    read_result,
)
from fsdp_plan.bench.tune import relative_spread
from fsdp_plan.common.errors import BadInput
from fsdp_plan.common.files import atomic_write_all
from fsdp_plan.common.sizes import format_bytes

DEFAULT_RESULTS_DIR = os.path.join("benchmarks", "results")
"""Where bench, tune and the GPU check write their results unless told otherwise."""


def plan_hash(plan_dict: dict[str, Any]) -> str:
    """A short hash of the plan document (canonical JSON)."""
    text = json.dumps(plan_dict, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def git_commit(folder: str = ".") -> dict[str, Any]:
    """The checked-out commit and whether the tree has local changes (``None`` outside git)."""
    def git(*cmd: str) -> str | None:
        try:
            done = subprocess.run(["git", *cmd], check=False, cwd=folder, capture_output=True, text=True,
                                  timeout=10)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None
    commit = git("rev-parse", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": commit, "dirty": bool(dirty) if commit else None}


def device_name() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (``q`` in 0..100): an observed value, no interpolation."""
    ordered = sorted(values)
    index = max(0, math.ceil(q / 100 * len(ordered)) - 1)
    return ordered[index]


def _step_times(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    per_rank = [{"rank": r["rank"], "median_s": statistics.median(r["step_times_s"]),
                 "p99_s": percentile(r["step_times_s"], 99), "steps_s": r["step_times_s"]}
                for r in ranks]
    slowest = max(per_rank, key=lambda r: r["median_s"])
    # A step ends when its slowest rank ends: the step time is the per-step maximum over ranks.
    per_step = [max(vals) for vals in zip(*(r["step_times_s"] for r in ranks))]
    return {"median_s": statistics.median(per_step), "p99_s": percentile(per_step, 99),
            "mean_s": statistics.fmean(per_step), "slowest_rank": slowest["rank"],
            "slowest_rank_median_s": slowest["median_s"], "per_rank": per_rank}


def _phases(ranks: list[dict[str, Any]], median_s: float,
            predicted: dict[str, float] | None) -> dict[str, Any]:
    """Rank 0's profiled step per phase (``profiled``: seconds as ``fsdp-plan trace`` reports
    them, measure/profile.py ``PHASE_FIGURES``) and ``measured``: each phase's share of the
    profiled step (the profiler slows every op, so shares, not its seconds) times the median
    step; beside the plan's ``predicted.phases_s``."""
    profiled = ranks[0].get("phases_s") or {}
    step_s = (ranks[0].get("comm") or {}).get("step_s") or sum(profiled.values())
    if not step_s:
        return {"measured": None, "predicted": predicted}
    return {"measured": {k: v / step_s * median_s for k, v in profiled.items()},
            "profiled": {"step": (ranks[0].get("comm") or {}).get("step"), "step_s": step_s,
                         **profiled},
            "predicted": predicted}


def build_result(prepared: Any, ranks: list[dict[str, Any]], memory: dict[str, Any],
                 overlap: dict[str, Any] | None = None) -> dict[str, Any]:
    """The result document of one run from every rank's figures. ``prepared`` is a
    ``session.Prepared`` (typed ``Any``: the session imports this module); ``overlap``:
    ``--baseline no-overlap``'s figures (bench/overlap.py), kept under ``overlap``."""
    plan, plan_path = prepared.plan, prepared.request.plan_path
    predicted = plan.predicted or {}
    fsdp_version = prepared.request.fsdp_version
    counts_key = "collectives_per_step_fsdp1" if fsdp_version == 1 else "collectives_per_step"
    counts = ranks[0]["counts"]
    comm = ranks[0]["comm"]
    worst = max(ranks, key=lambda r: r["comm"].get("exposed_s", 0.0))
    return {
        "fsdp_plan_bench_version": RESULT_VERSION,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "plan": {"path": plan_path, "abspath": os.path.abspath(plan_path),
                 "hash": plan_hash(plan.to_dict()),
                 "world_size": plan.world_size, "gpu": plan.gpu, "strategy": plan.strategy,
                 "mesh": {"replicate": plan.mesh.replicate, "shard": plan.mesh.shard}},
        "model": plan.model.to_dict(),
        "run": {"nproc": prepared.nproc, "mesh": {"replicate": prepared.mesh[0],
                                                  "shard": prepared.mesh[1]},
                "fsdp_version": fsdp_version, "steps": prepared.payload["steps"],
                "warmup": prepared.payload["warmup"], "device": ranks[0]["device"],
                "device_name": device_name(), "torch": torch.__version__,
                "python": platform.python_version(), "git": git_commit()},
        "collectives": {"measured": counts, "predicted": predicted.get(counts_key),
                        "predicted_key": counts_key,
                        "ranks_agree": all(r["counts"] == counts for r in ranks)},
        "step_time": {**_step_times(ranks), "predicted_s": predicted.get("step_time_s"),
                      "phases": _phases(ranks, _step_times(ranks)["median_s"],
                                        predicted.get("phases_s"))},
        "memory": {**memory, "predicted_bytes": predicted.get("peak_bytes")},
        "predicted_extra": {k: predicted.get(k) for k in ("compute_s", "total_comm_s")},
        **({"compiled_graphs": ranks[0]["compiled_graphs"]}
           if ranks[0].get("compiled_graphs") is not None else {}),
        **({"ddp_buckets": {"measured": ranks[0]["ddp_buckets"],
                            "predicted": predicted.get("buckets")}}
           if ranks[0].get("ddp_buckets") is not None else {}),
        "comm": {"rank0": comm, "max_exposed_s": worst["comm"].get("exposed_s"),
                 "max_exposed_rank": worst["rank"],
                 "per_rank": [{"rank": r["rank"], **r["comm"]} for r in ranks],
                 "predicted_exposed_s": predicted.get("exposed_comm_s")},
        **({"overlap": overlap} if overlap is not None else {}),
    }


def result_filename(result: dict[str, Any]) -> str:
    stem = os.path.splitext(os.path.basename(str(result["model"].get("source", "model"))))[0]
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run = result["run"]
    return (f"{stamp}-{stem}-{_engine(result).lower()}-n{run['nproc']}-"
            f"{result['plan']['hash'][:8]}")


def _engine(result: dict[str, Any]) -> str:
    """``DDP`` for a DistributedDataParallel plan, else ``FSDP1`` / ``FSDP2``."""
    if result["plan"].get("strategy") == "ddp":
        return "DDP"
    return f"FSDP{result['run']['fsdp_version']}"


def write_result(result: dict[str, Any], out_dir: str, *, trace_from: str | None = None,
                 predicted_trace: dict[str, Any] | None = None,
                 held_trace_from: str | None = None) -> str:
    """Write ``<out>/<name>.json``, with ``<name>.trace.json`` (rank 0's profiler trace),
    given the planner's ``predicted_trace``, ``<name>.side-by-side.trace.json``, and given
    ``held_trace_from`` (``--baseline no-overlap``), ``<name>.held.trace.json``: all of them
    or none (temporaries renamed together), never over an earlier result. ``out_dir`` is
    created here, once the run is done. A write failure is ``BadInput`` naming the path."""
    try:
        os.makedirs(out_dir, exist_ok=True)
    except OSError as e:
        raise BadInput(f"--out {out_dir!r} cannot be created ({e.strerror or e}); nothing was "
                       "written.") from e
    base = os.path.join(out_dir, result_filename(result))
    n = 1
    name = base
    while os.path.exists(name + ".json"):
        n += 1
        name = f"{base}-{n}"
    files = []
    if trace_from and os.path.exists(trace_from):
        with open(trace_from, encoding="utf-8") as f:
            measured_text = f.read()
        files.append((name + ".trace.json", measured_text))
        result["trace"] = os.path.basename(name + ".trace.json")
        if predicted_trace is not None:
            merged = side_by_side_trace(predicted_trace, json.loads(measured_text),
                                        step=result["comm"]["rank0"].get("step"))
            files.append((name + ".side-by-side.trace.json", json.dumps(merged)))
            result["side_by_side_trace"] = os.path.basename(name + ".side-by-side.trace.json")
    if held_trace_from and os.path.exists(held_trace_from) and result.get("overlap"):
        with open(held_trace_from, encoding="utf-8") as f:
            files.append((name + ".held.trace.json", f.read()))
        result["overlap"]["trace"] = os.path.basename(name + ".held.trace.json")
    files.append((name + ".json", json.dumps(result, indent=2, default=str) + "\n"))
    atomic_write_all(files)
    return name + ".json"


def side_by_side_trace(predicted: dict[str, Any], measured: dict[str, Any],
                       step: int | None = None) -> dict[str, Any]:
    """One Chrome/Perfetto trace holding the planner's predicted timeline (``--trace``) and the
    measured steps of rank 0, both starting at 0 (the measured at ``ProfilerStep#<step>``,
    the step bench's figures are of, else its first ``fsdp_plan.step``), as two named
    processes."""
    def events(trace: dict[str, Any]) -> list[dict[str, Any]]:
        return [e for e in trace.get("traceEvents", []) if isinstance(e, dict)]
    measured_events = events(measured)
    named = f"ProfilerStep#{step}" if step is not None else None
    marks = [e for e in measured_events if "ts" in e and e.get("name") == named] or [
        e for e in measured_events if "ts" in e and e.get("name") == "fsdp_plan.step"]
    origin = float(marks[0]["ts"]) if marks else min(
        (float(e["ts"]) for e in measured_events if "ts" in e), default=0.0)
    merged = []
    for e in events(predicted):
        merged.append({**e, "pid": "predicted"})
    for e in measured_events:
        if "ts" in e:
            e = {**e, "ts": float(e["ts"]) - origin}
        merged.append({**e, "pid": f"measured {e.get('pid', '')}".strip()})
    merged += [{"name": "process_name", "ph": "M", "pid": "predicted",
                "args": {"name": "predicted (fsdp-plan --trace)"}},
               {"name": "process_sort_index", "ph": "M", "pid": "predicted",
                "args": {"sort_index": 0}}]
    return {"traceEvents": merged, "displayTimeUnit": "ms"}


def counts_differ(measured: dict[str, int], predicted: dict[str, int]) -> list[str]:
    """Kinds whose counts differ (a kind missing on one side counts as 0)."""
    kinds = sorted(set(measured) | set(predicted))
    return [k for k in kinds if int(measured.get(k, 0)) != int(predicted.get(k, 0))]


def check_prediction(result: dict[str, Any]) -> list[str]:
    """Failures against the plan: collective counts must match exactly (SPEC 5)."""
    coll = result["collectives"]
    problems = []
    if coll["predicted"] is not None:
        wrong = counts_differ(coll["measured"], coll["predicted"])
        if wrong:
            problems.append("collective counts differ from the plan's prediction for " + ", ".join(
                f"{k} (measured {coll['measured'].get(k, 0)}, predicted {coll['predicted'].get(k, 0)})"
                for k in wrong))
    if not coll["ranks_agree"]:
        problems.append("ranks issued different collectives")
    buckets = result.get("ddp_buckets") or {}
    if buckets.get("predicted") is not None and buckets["measured"] != buckets["predicted"]:
        problems.append(f"DDP built {len(buckets['measured'])} buckets of "
                        f"{buckets['measured']} bytes, the plan predicts "
                        f"{len(buckets['predicted'])} of {buckets['predicted']}")
    return problems


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.2f} ms"


def _bytes(value: int | None) -> str:
    return "-" if value is None else format_bytes(value)


def format_report(result: dict[str, Any], notes: list[str] | None = None) -> str:
    """The human-readable report of one run."""
    run, coll, st, mem, comm = (result["run"], result["collectives"], result["step_time"],
                                result["memory"], result["comm"])
    head = (f"bench {result['model'].get('source')} on {run['nproc']} rank(s), mesh "
            f"{run['mesh']['replicate']}x{run['mesh']['shard']}, {_engine(result)}, "
            f"{run['device_name']}, torch {run['torch']}")
    predicted = coll["predicted"] or {}
    kinds = sorted(set(coll["measured"]) | set(predicted))
    count_rows = [[k, coll["measured"].get(k, 0), predicted.get(k, "-") if coll["predicted"]
                   else "-", "ok" if not coll["predicted"] or int(coll["measured"].get(k, 0))
                   == int(predicted.get(k, 0)) else "DIFFERS"] for k in kinds]
    rows = [
        ["step time (median, slowest rank per step)", _secs(st["median_s"]), _secs(st.get("predicted_s"))],
        *[[f"  {phase} (share of the profiled step)",
           _secs(((st.get("phases") or {}).get("measured") or {}).get(phase)),
           _secs(((st.get("phases") or {}).get("predicted") or {}).get(phase))]
          for phase in ("forward", "backward", "optimizer", "tail", "idle")
          if ((st.get("phases") or {}).get("measured") or {}).get(phase) is not None],
        ["step time P99", _secs(st["p99_s"]), ""],
        [f"slowest rank (rank {st['slowest_rank']}) median", _secs(st["slowest_rank_median_s"]), ""],
        ["peak memory per rank", _bytes(mem.get("peak_bytes")), _bytes(mem.get("predicted_bytes"))],
        ["communication (rank 0)", _secs(comm["rank0"].get("comm_s")), ""],
        ["  hidden behind compute", _secs(comm["rank0"].get("hidden_s")), ""],
        ["  exposed", _secs(comm["rank0"].get("exposed_s")), _secs(comm.get("predicted_exposed_s"))],
        ["  exposed tail after backward", _secs(comm["rank0"].get("tail_exposed_s")), ""],
        [f"exposed, worst rank (rank {comm['max_exposed_rank']})", _secs(comm["max_exposed_s"]), ""],
        ["backward slowed while overlapped", _secs(comm["rank0"].get("backward_overlap_slowdown_s")), ""],
    ]
    parts = [head, "", tabulate(count_rows, headers=["collective / step", "measured", "predicted",
                                                     ""]),
             "", tabulate(rows, headers=["figure", "measured", "predicted"])]
    parts.append(f"memory: {mem.get('source')}")
    if result.get("compiled_graphs") is not None:
        parts.append(f"compiled blocks: {result['compiled_graphs']} forward/backward graph "
                     "pair(s) compiled by inductor (torch.compile(block.forward, fullgraph=True), "
                     "no eager fallback): the steps ran them")
    if result.get("ddp_buckets"):
        b = result["ddp_buckets"]
        same = b["measured"] == b.get("predicted")
        parts.append(f"DDP buckets after the rebuild: {len(b['measured'])} measured, "
                     f"{len(b.get('predicted') or [])} predicted: "
                     + ("equal, byte for byte" if same else f"DIFFER: measured {b['measured']}, "
                        f"predicted {b.get('predicted')}"))
    if st.get("predicted_s"):
        parts.append(f"step time: predicted {_secs(st['predicted_s'])}, measured "
                     f"{_secs(st['median_s'])}: {_versus(st['median_s'], st['predicted_s'])}")
    if not str(run.get("device", "")).startswith("cuda") and not str(
            result["plan"].get("gpu", "")).startswith("calibrated-cpu"):
        parts.append(f"note: predicted step time and exposed communication are for the plan's "
                     f"GPU ({result['plan'].get('gpu', 'see the plan')}); gloo on CPU blocks "
                     "the issuing thread while a collective runs, so a CPU run hides nothing and "
                     "its times are not comparable. Counts and memory are.")
    if result.get("overlap"):
        parts.extend(overlap_lines(result["overlap"]))
    for note in notes or []:
        parts.append(f"note: {note}")
    folder = os.path.dirname(str(result.get("path") or ""))
    if result.get("trace"):
        parts.append(f"profiler trace (Chrome/Perfetto): {os.path.join(folder, result['trace'])}")
    if (result.get("overlap") or {}).get("trace"):
        parts.append("profiler trace, communication held: "
                     f"{os.path.join(folder, result['overlap']['trace'])}")
    if result.get("side_by_side_trace"):
        parts.append("predicted vs measured (open in Perfetto): "
                     f"{os.path.join(folder, result['side_by_side_trace'])}")
    return "\n".join(parts)


def _versus(measured: float, predicted: float) -> str:
    """``measured 12.3% slower than predicted`` (or faster; ``12.3x the predicted time``
    when it is more than twice it), the way round a reader expects."""
    if measured >= 2 * predicted:
        return f"measured {measured / predicted:.1f}x the predicted time"
    change = measured / predicted - 1
    return (f"measured {abs(change):.1%} {'slower' if change > 0 else 'faster'} than predicted"
            if abs(change) >= 0.0005 else "measured as predicted")


def _change(old: float | None, new: float | None) -> float | None:
    if old in (None, 0) or new is None:
        return None
    return (new - old) / old


def step_noise(result: dict[str, Any]) -> float | None:
    """The relative spread of a run's step times (its slowest rank's, ``tune.relative_spread``),
    or None for a result without per-step times."""
    listed = result["step_time"].get("per_rank")
    per_rank = [r.get("steps_s") for r in (listed if isinstance(listed, list) else [])
                if isinstance(r, dict) and isinstance(r.get("steps_s"), list) and r["steps_s"]]
    if not per_rank or not all(is_number(t) for r in per_rank for t in r):
        return None  # check_result refuses such an old result; a new one never holds it
    slowest = max(per_rank, key=statistics.median)
    spread = relative_spread([float(t) for t in slowest])
    return spread if math.isfinite(spread) else None


def compare(old: dict[str, Any], new: dict[str, Any], threshold: float) -> tuple[str, list[str]]:
    """Side-by-side table of two results and the regressions past ``threshold``.

    [Note: judging a change against the noise]
    A machine shared with other jobs runs the same plan 60% slower from one launch to the
    next. As ``tune`` does, each run's own spread (the inter-quartile range of its slowest
    rank's steps over their median) says how far its median can move by chance; a step-time
    change is a regression only when it is past ``threshold`` and past the two runs' spreads
    added together, and a change within them is reported as "within noise". Collective
    counts and peak memory do not vary between runs: any change past ``threshold`` counts."""
    rows, problems = [], []
    spreads = [step_noise(old), step_noise(new)]
    noise = sum(spreads) if None not in spreads else None  # type: ignore[arg-type]
    o_counts, n_counts = old["collectives"]["measured"], new["collectives"]["measured"]
    for kind in sorted(set(o_counts) | set(n_counts)):
        o, n = int(o_counts.get(kind, 0)), int(n_counts.get(kind, 0))
        status = "ok" if o == n else "CHANGED"
        rows.append([f"{kind} / step", o, n, "" if o == n else f"{n - o:+d}", status])
        if o != n:
            problems.append(f"{kind} per step changed from {o} to {n}")
    for label, o, n, fmt in (
        ("step time median", old["step_time"]["median_s"], new["step_time"]["median_s"], _secs),
        ("step time P99", old["step_time"]["p99_s"], new["step_time"]["p99_s"], _secs),
        ("peak memory", old["memory"].get("peak_bytes"), new["memory"].get("peak_bytes"), _bytes),
        ("exposed communication", old["comm"]["rank0"].get("exposed_s"),
         new["comm"]["rank0"].get("exposed_s"), _secs),
    ):
        change = _change(o, n)
        gated = label in ("step time median", "peak memory")
        timed = label != "peak memory"
        noisy = timed and noise is not None and change is not None and abs(change) <= noise
        regressed = gated and change is not None and change > threshold and not noisy
        status = ("REGRESSED" if regressed else f"within noise (±{noise:.0%})" if noisy
                  else "ok" if gated else "info")
        rows.append([label, fmt(o), fmt(n), "-" if change is None else f"{change:+.1%}",
                     status])
        if regressed:
            problems.append(f"{label} regressed {change:+.1%} (threshold {threshold:.0%}"
                            + (f", noise ±{noise:.0%})" if timed and noise is not None
                               else ")"))
    for label, key in (("plan hash", "hash"),):
        if old["plan"][key] != new["plan"][key]:
            rows.append([label, old["plan"][key], new["plan"][key], "", "differs"])
    for label in ("torch", "device_name"):
        if old["run"].get(label) != new["run"].get(label):
            rows.append([label, old["run"].get(label), new["run"].get(label), "", "differs"])
    if noise is not None:
        rows.append(["step-time noise (old + new spread)", f"{spreads[0]:.1%}",
                     f"{spreads[1]:.1%}", f"±{noise:.1%}", "info"])
    table = tabulate(rows, headers=["compare", "old", "new", "change", "status"])
    return table, problems
